"""What a run leaves to inspect, from one short in-process runlocal run: the rollout and held-out
dumps read back against the metrics of the same steps, the perf/* metrics, the profiler trace."""
import glob
import gzip
import os

import pytest

from dapo_jax import dumps, metrics


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  from configs import dapo_qwen2_5_32b
  from dapo_jax import builders
  cfg = dapo_qwen2_5_32b.get_config("runlocal")
  cfg.reward.update(fn="dapo_jax.testing:length_reward", workers=1)
  cfg.train.update(num_steps=2, eval_every=2, profile_steps=(2, 2), dump_rollouts_every=-1)  # -1: small job
  cfg.optim.update(lr=1e-2, warmup_steps=0)
  workdir = str(tmp_path_factory.mktemp("run"))
  builders.run(cfg, workdir)
  return workdir


@pytest.mark.slow  # one short training (~45 s on 2 cores)
def test_rollout_dumps_hold_every_scored_sample_of_the_step(run_dir):
  recs = metrics.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  for step in (1, 2):
    rows = dumps.read(dumps.path(run_dir, step))
    m = recs[step]
    assert len(rows) == m["rollout/samples"] > 0  # kept and dropped groups alike
    assert {r["step"] for r in rows} == {step} and {r["policy_step"] for r in rows} == {step - 1}
    groups = {r["group"] for r in rows}
    assert len(groups) * 4 == len(rows) and sorted({r["sample"] for r in rows}) == [0, 1, 2, 3]
    assert sum(r["kept"] for r in rows) / len(rows) == pytest.approx(m["train/kept_fraction"])
    assert sum(r["acc"] for r in rows) / len(rows) == pytest.approx(m["rollout/acc_all"])
    for r in rows:
      assert r["prompt"].startswith("What is ") and r["acc"] == (len(r["response"]) % 2 == 0)  # length_reward
      assert 1 <= r["length"] <= 8 and isinstance(r["truncated"], bool) and (r["length"] == 8 or not r["truncated"])
  with gzip.open(dumps.path(run_dir, 1), "rt") as f:  # what `zcat | head` shows
    assert f.readline().startswith('{"prompt": "What is ')


@pytest.mark.slow  # one short training (~45 s on 2 cores)
def test_eval_dumps_match_the_logged_accuracy(run_dir):
  recs = metrics.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  for step in (0, 2):
    rows = dumps.read(dumps.path(run_dir, step, "eval"))
    assert len(rows) == 8 * 2  # data.num_eval x eval.k
    assert sum(r["acc"] for r in rows) / len(rows) == pytest.approx(recs[step]["val/acc/mean@2"])
    assert {r["policy_step"] for r in rows} == {step}


@pytest.mark.slow  # one short training (~45 s on 2 cores)
def test_perf_metrics_are_logged_each_step(run_dir):
  recs = metrics.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  for step in (1, 2):
    m = recs[step]
    assert 0.05 < m["perf/cpu_memory_used_gb"] <= m["perf/cpu_memory_peak_gb"] < 100
    assert m["perf/gen_tokens_per_s"] > 0 and m["perf/model_flops_per_s"] > 0
    if "actor/pg_loss" in m:
      assert m["perf/update_tokens_per_s"] > 0
    assert "perf/mfu" not in m and "perf/memory_allocated_gb" not in m  # CPU: no peak table, no memory stats


@pytest.mark.slow  # one short training (~45 s on 2 cores)
def test_profile_trace_of_the_asked_steps(run_dir):
  traces = glob.glob(os.path.join(run_dir, "profile", "plugins", "profile", "*", "*.trace.json.gz"))
  assert len(traces) == 1 and os.path.getsize(traces[0]) > 1000
  with gzip.open(traces[0], "rt") as f:
    assert '"traceEvents"' in f.read(10_000)


def test_speed_and_mfu_arithmetic():
  out = metrics.speed(gen_tokens=100, gen_s=2.0, prompt_tokens=50, update_tokens=40, update_s=0.5, forward_tokens=40,
                      step_s=4.0, flops_per_token=10.0, peak=100.0, devices=2)
  flops = 10.0 * (2 * (100 + 50 + 40) + 6 * 40)
  assert out == {"perf/gen_tokens_per_s": 50.0, "perf/update_tokens_per_s": 80.0,
                 "perf/model_flops_per_s": flops / 4.0, "perf/mfu": flops / 4.0 / 200.0}
  assert metrics.peak_flops("NVIDIA H200") == 989e12 and metrics.peak_flops("TPU v5 lite") == 197e12
  assert metrics.peak_flops("cpu") is None


def test_recorder_writes_what_the_rollout_scored(tmp_path, tiny_tokenizer_dir):
  """Fast: a real Rollout's own `score` and `call_reward` on hand-made samples (no model runs)."""
  import numpy as np

  from dapo_jax import sharding, testing
  from dapo_jax.data import prompts as data_lib
  from dapo_jax.data import tokenizer as tokenizer_lib
  from dapo_jax.rollout import rollout as rollout_lib
  from dapo_jax.rollout import sampling
  tok = tokenizer_lib.load(tiny_tokenizer_dir)
  reward = lambda texts, gts: [testing.length_reward(t, g) for t, g in zip(texts, gts)]
  r = rollout_lib.Rollout(tok, testing.tiny_model_config(vocab_size=320), sharding.make_mesh({"fsdp": -1}),
                          rollout_lib.RolloutConfig(max_prompt_len=16, overlong_buffer=0),
                          sampling.SamplerConfig(max_new_tokens=4, pad_id=tok.pad_token_id, eos_ids=(0,)), reward)
  rec = dumps.RolloutRecorder(str(tmp_path), r, filter_groups=True)
  examples = [data_lib.Example(messages=[{"role": "user", "content": f"What is {q}+1?"}], ground_truth=str(q + 1),
                               index=q) for q in range(2)]
  ids = tok("1 2 3 4 5 6 7 8", add_special_tokens=False)["input_ids"]
  tokens_BC = np.array([ids[:4], ids[:4], ids[1:5], ids[2:6]], np.int32)
  lengths = np.array([4, 2, 3, 1], np.int32)
  mask_BC = np.arange(4)[None] < lengths[:, None]
  samples = sampling.Samples(tokens_BC=tokens_BC, logp_BC=np.zeros((4, 4), np.float32), mask_BC=mask_BC,
                             length_B=lengths, truncated_B=lengths == 4)
  with rec.recording("step", 3, 2):
    out = r.score(examples, samples, 2)
  r.score(examples, samples, 2)  # not recorded: no recording open
  rows = dumps.read(dumps.path(str(tmp_path), 3))
  assert [x["response"] for x in rows] == out["texts"] and [x["length"] for x in rows] == [4, 2, 3, 1]
  assert [x["acc"] for x in rows] == list(out["acc"].reshape(-1)) and [x["group"] for x in rows] == [0, 0, 1, 1]
  assert [x["kept"] for x in rows] == [bool(out["acc"][q].any() != out["acc"][q].all()) for q in (0, 0, 1, 1)]
  assert [x["truncated"] for x in rows] == [True, False, False, False] and rows[2]["prompt"] == "What is 1+1?"
  assert {x["step"] for x in rows} == {3} and {x["policy_step"] for x in rows} == {2}
  with rec.recording("eval", 3, 3):
    res = r.call_reward(["ab", "abc", "x"], [examples[0], examples[0], examples[1]])
  rows = dumps.read(dumps.path(str(tmp_path), 3, "eval"))
  assert [(x["group"], x["sample"], x["acc"]) for x in rows] == [(0, 0, True), (0, 1, False), (1, 0, False)]
  assert [x["score"] for x in rows] == [x["score"] for x in res]


def test_plot_writes_a_png_of_the_curves(tmp_path):
  """launch.plot on a metrics.jsonl written by the run's own writer (a process: no jax, seconds)."""
  import subprocess
  import sys

  import numpy as np
  pytest.importorskip("matplotlib")
  import matplotlib.image
  w = metrics.MetricWriter(str(tmp_path), cfg=metrics.WriterConfig(writers=("jsonl",)))
  w.scalars(0, {"val/acc/mean@2": 0.1})
  for step in range(1, 11):
    w.scalars(step, {"critic/score/mean": step / 10, "critic/acc/mean": step / 20, "response_length/mean": 30 - step,
                     "actor/entropy": 2.0 / step, "actor/pg_clipfrac_eps_high": 0.01, "train/kept_fraction": 0.5,
                     "actor/pg_clipfrac_eps_low": float("nan"),
                     **({"val/acc/mean@2": step / 10} if step % 5 == 0 else {})})
  w.close()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, "-m", "launch.plot", f"--workdir={tmp_path}"], cwd=root, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=root))
  assert out.returncode == 0, out.stderr[-2000:]
  png = os.path.join(tmp_path, "curves.png")
  assert out.stdout.strip() == f"wrote {png}: 7 curves over 11 logged steps"
  image = matplotlib.image.imread(png)
  assert image.shape[:2] == (800, 1500) and np.asarray(image).std() > 0.01
  bad = subprocess.run([sys.executable, "-m", "launch.plot", f"--workdir={tmp_path}/none"], cwd=root,
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=root))
  assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1].startswith(f"error: {tmp_path}/none/metrics.jsonl")


@pytest.mark.parametrize("field, value, message", [
    ("profile_steps", (3, 1), "train.profile_steps=(3, 1): expected () or (a, b) with 1 <= a <= b (rollout steps)"),
    ("profile_steps", (0, 2), "train.profile_steps=(0, 2): expected () or (a, b) with 1 <= a <= b (rollout steps)"),
    ("dump_rollouts_every", -2, "train.dump_rollouts_every=-2: expected an integer >= -1"),
])
def test_bad_dump_and_profile_fields_are_one_line(field, value, message):
  from configs import dapo_qwen2_5_32b
  from dapo_jax import builders
  cfg = dapo_qwen2_5_32b.get_config("runlocal")
  cfg.train[field] = value
  with pytest.raises(builders.ConfigError) as e:
    builders.dump_rollouts_every(cfg)
  assert str(e.value) == message


def test_dumps_every_step_on_small_jobs_only():
  from configs import dapo_qwen2_5_32b, default
  from dapo_jax import builders
  assert builders.dump_rollouts_every(default.get_config()) == 1
  assert builders.dump_rollouts_every(dapo_qwen2_5_32b.get_config("runlocal")) == 1
  assert builders.dump_rollouts_every(dapo_qwen2_5_32b.get_config()) == 0
