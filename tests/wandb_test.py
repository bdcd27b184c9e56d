"""The W&B writer under WANDB_MODE=offline, with the real wandb package: the run files it writes
are read back record by record (the .wandb file is a LevelDB-style log of protobuf records)."""
import glob
import json
import math
import os
import struct
import time

import pytest

from dapo_jax import metrics

wandb_pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")


def read_records(path):
  """Every record of a .wandb file: a 7-byte file header, then 32 KiB blocks of chunks, each
  chunk with a 7-byte header (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last)."""
  with open(path, "rb") as f:
    data = f.read()
  ident, magic, _ = struct.unpack("<4sHB", data[:7])
  assert (ident, magic) == (b":W&B", 0xBEE1), path
  block, pos, buf, out = 32768, 7, b"", []
  while pos + 7 <= len(data):
    if block - pos % block < 7:  # A block's tail too short for a header is padding.
      pos += block - pos % block
      continue
    _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
    if kind == 0:
      break
    buf += data[pos + 7:pos + 7 + n]
    pos += 7 + n
    if kind in (1, 4):
      record = wandb_pb.Record()
      record.ParseFromString(buf)
      out.append(record)
      buf = b""
  return out


def finished_records(path, timeout_s=60.0):
  """The records of a run's .wandb file once it holds the run's exit record: the file is written by
  wandb's service process, which may still be flushing it when `finish()` has returned."""
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      records = read_records(path)
    except Exception:  # A record being written: read again.
      if time.monotonic() > deadline:
        raise
      records = []
    if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
      return records
    time.sleep(0.2)


def read_run(run_dir):
  """(run id, config dict, {step: {name: value}}) of one offline run directory."""
  (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
  run_id, config, history = None, {}, {}
  for r in finished_records(path):
    kind = r.WhichOneof("record_type")
    if kind == "run":
      run_id = r.run.run_id
      config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
    elif kind == "config":
      config.update({i.key: json.loads(i.value_json) for i in r.config.update})
    elif kind == "history":
      row = {"/".join(i.nested_key) if i.nested_key else i.key: json.loads(i.value_json) for i in r.history.item}
      history.setdefault(int(row["_step"]), {}).update(row)
  return run_id, config, history


def offline_runs(workdir):
  return sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*")))


@pytest.fixture
def offline(monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")


def test_scalars_config_and_samples_offline(tmp_path, offline):
  cfg = metrics.WriterConfig(writers=("jsonl", "wandb"), wandb_project="arith")
  run_config = {"seed": 3, "rollout": {"group_size": 4, "temperature": 1.0}, "data": {"ops": "+"}}
  w = metrics.MetricWriter(str(tmp_path), cfg=cfg, run_config=run_config)
  w.scalars(1, {"critic/score/mean": 0.25, "actor/entropy": 1.5})
  w.scalars(2, {"critic/score/mean": 0.5, "actor/entropy": float("nan")})
  w.text(2, "samples", "PROMPT: '1+1'\nRESPONSE: 'Answer: 2'  score=+1.00\n\nPROMPT: '2+2'\nRESPONSE: '5'  score=-1.00")
  w.close()

  (run_dir,) = offline_runs(tmp_path)
  run_id, config, history = read_run(run_dir)
  assert run_id == (tmp_path / "wandb_run_id").read_text().strip()
  assert config["seed"] == 3 and config["rollout"] == {"group_size": 4, "temperature": 1.0}
  assert history[1]["critic/score/mean"] == 0.25 and history[1]["actor/entropy"] == 1.5
  assert history[2]["critic/score/mean"] == 0.5 and math.isnan(history[2]["actor/entropy"])
  # The same names and values as metrics.jsonl.
  recs = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert recs[1]["critic/score/mean"] == history[1]["critic/score/mean"]
  # The samples table: one row per prompt/response block, in the run's files.
  assert history[2]["samples/_type"] == "table-file"
  with open(os.path.join(run_dir, "files", history[2]["samples/path"])) as f:
    table = json.load(f)
  assert table["columns"] == ["step", "text"]
  assert [row[0] for row in table["data"]] == [2, 2]
  assert table["data"][1][1].startswith("PROMPT: '2+2'")
  assert not (tmp_path / "tb").exists()  # Only the writers asked for.


def test_resume_continues_the_same_run(tmp_path, offline):
  cfg = metrics.WriterConfig(writers=("wandb",))
  w = metrics.MetricWriter(str(tmp_path), cfg=cfg, run_config={"seed": 0})
  w.scalars(1, {"loss": 1.0})
  w.close()
  w = metrics.MetricWriter(str(tmp_path), cfg=cfg, run_config={"seed": 0})
  w.scalars(2, {"loss": 0.5})
  w.close()
  first, second = (read_run(d) for d in offline_runs(tmp_path))
  assert first[0] == second[0] == (tmp_path / "wandb_run_id").read_text().strip()
  assert first[2][1]["loss"] == 1.0 and second[2][2]["loss"] == 0.5


def test_default_writers_unchanged_and_bad_names(tmp_path):
  w = metrics.MetricWriter(str(tmp_path))
  w.scalars(1, {"x": 1.0})
  w.close()
  assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "tb"]
  with pytest.raises(metrics.MetricsConfigError, match="'wandbb' is not a writer"):
    metrics.WriterConfig(writers=("jsonl", "wandbb"))


def test_missing_wandb_is_one_line(tmp_path, monkeypatch):
  monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # As if it were not installed.
  with pytest.raises(metrics.MetricsConfigError, match=r'pip install -e "\.\[wandb\]"'):
    metrics.MetricWriter(str(tmp_path), cfg=metrics.WriterConfig(writers=("wandb",)))
