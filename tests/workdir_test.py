"""One run per workdir: real processes take WORKDIR/run.lock; a second one is refused
naming the first, and a run killed with SIGKILL leaves no stale lock."""
import os
import signal
import socket
import subprocess
import sys

import pytest

from dapo_jax import testing
from dapo_jax.builders import record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, XLA_FLAGS=testing.FAST_COMPILE_XLA_FLAGS, JAX_PLATFORMS="cpu")
HOLD = ("import sys, time; from dapo_jax.builders import record; record.lock(sys.argv[1]); print('locked', flush=True); "
        "time.sleep(600)")
TRY = ("import sys; from dapo_jax.builders import record\n"
       "try:\n  record.lock(sys.argv[1]); print('locked')\n"
       "except record.WorkdirBusyError as e:\n  print(e); sys.exit(3)")


def holder(path):
  """A process that holds `path`'s lock until killed (started once it says so)."""
  p = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
  assert p.stdout.readline().strip() == "locked"
  return p


def try_lock(path):
  return subprocess.run([sys.executable, "-c", TRY, str(path)], cwd=ROOT, env=ENV, capture_output=True, text=True,
                        timeout=120)


def test_second_process_is_refused_naming_the_first_and_kill_9_frees_the_lock(tmp_path):
  p = holder(tmp_path)
  try:
    out = try_lock(tmp_path)
    assert out.returncode == 3, out.stderr
    line = out.stdout.strip()
    assert line.startswith(f"workdir {tmp_path} is in use by another run: pid {p.pid} on host "
                           f"{socket.gethostname()}, started 20") and "use another --workdir" in line
  finally:
    p.send_signal(signal.SIGKILL)
    p.wait()
  out = try_lock(tmp_path)  # The kernel dropped the dead process's lock: no stale lock.
  assert out.returncode == 0 and out.stdout.strip() == "locked", out.stdout + out.stderr


@pytest.mark.parametrize("launcher,config", [("train", "dapo_qwen2_5_32b"), ("rm", "rm_arith"), ("dpo", "dpo_arith")])
def test_launch_on_a_busy_workdir_is_one_line(tmp_path, launcher, config):
  p = holder(tmp_path)
  try:
    out = subprocess.run([sys.executable, "-m", f"launch.{launcher}", f"--config={ROOT}/configs/{config}.py:runlocal",
                          f"--workdir={tmp_path}"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
  finally:
    p.send_signal(signal.SIGKILL)
    p.wait()
  assert out.returncode == 1 and "Traceback" not in out.stderr
  assert out.stderr.strip().splitlines()[-1].startswith(f"error: workdir {tmp_path} is in use by another run: "
                                                        f"pid {p.pid} on host")
  assert not os.path.exists(tmp_path / "checkpoints")  # Refused before writing anything.
  assert not os.path.exists(tmp_path / f"{launcher}_config.json")


def test_lock_is_reentrant_in_a_process_and_release_frees_it(tmp_path):
  path = record.lock(str(tmp_path))
  assert record.lock(str(tmp_path)) == path == os.path.join(os.path.realpath(tmp_path), record.LOCK_FILE)
  assert record.holder(str(tmp_path))["pid"] == os.getpid()
  assert try_lock(tmp_path).returncode == 3
  record.release(str(tmp_path))
  assert try_lock(tmp_path).returncode == 0


@pytest.mark.parametrize("where", ["gs://bucket/run", "other-process"])
def test_remote_workdirs_and_other_hosts_take_no_lock(tmp_path, where):
  if where == "other-process":  # Multi-host: process 0 holds the shared workdir's lock.
    assert record.lock(str(tmp_path), process_index=1) == ""
    assert not os.path.exists(tmp_path / record.LOCK_FILE)
  else:
    assert record.lock(where) == ""


# --- the model directories a run writes into its workdir -----------------------------------------

@pytest.mark.parametrize("launcher,config,out", [("sft", "sft_chat_arith", "sft_model"), ("rm", "rm_arith", "rm_model"),
                                                 ("dpo", "dpo_arith", "dpo_model"), ("train", "default", "sft_model")])
def test_a_model_dir_holding_a_users_files_is_refused_before_any_work(tmp_path, launcher, config, out):
  """launch.sft|rm|dpo (and launch.train's SFT warm start) never write over files they did not write:
  a user's file in W/<out> stops the command in one line naming the directory and the file."""
  (tmp_path / out).mkdir()
  (tmp_path / out / "notes.txt").write_text("mine")
  (tmp_path / out / "config.json").write_text("{}")  # A name a model export writes: not named below.
  config_arg = f"--config={ROOT}/configs/{config}.py" + ("" if config == "default" else ":runlocal")
  out_ = subprocess.run([sys.executable, "-m", f"launch.{launcher}", config_arg, f"--workdir={tmp_path}"], cwd=ROOT,
                        env=ENV, capture_output=True, text=True, timeout=300)
  assert out_.returncode == 1 and "Traceback" not in out_.stderr, out_.stderr[-2000:]
  assert out_.stderr.strip().splitlines()[-1] == (
      f"error: {tmp_path / out} holds files {'the SFT warm start' if launcher == 'train' else 'launch.' + launcher} "
      "does not write (notes.txt); move them away, or pass --overwrite to replace the directory")
  assert sorted(os.listdir(tmp_path / out)) == ["config.json", "notes.txt"]
  assert (tmp_path / out / "notes.txt").read_text() == "mine"
  assert not os.path.exists(tmp_path / "checkpoints") and not os.path.exists(tmp_path / "sft" / "checkpoints")


def test_check_model_dir_accepts_what_an_export_writes_and_names_the_rest(tmp_path):
  d = tmp_path / "m"
  record.check_model_dir(str(d), "x")  # Absent: fine.
  d.mkdir()
  for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
    (d / name).write_text("")
  record.check_model_dir(str(d), "x")  # Our own earlier write: a rerun replaces it.
  for i in range(7):
    (d / f"model-0000{i}-of-00007.safetensors").write_text("")
  with pytest.raises(record.ModelDirError, match=r"holds files x does not write \(model-00000-of-00007.safetensors, "
                     r".*model-00004-of-00007.safetensors and 2 more\)"):
    record.check_model_dir(str(d), "x")
  record.check_model_dir(str(d), "x", overwrite=True)
  record.check_model_dir(str(d), "x", extra=[f"model-0000{i}-of-00007.safetensors" for i in range(7)])
  (tmp_path / "f").write_text("")
  with pytest.raises(record.ModelDirError, match="is a file"):
    record.check_model_dir(str(tmp_path / "f"), "x", overwrite=True)


WRITE = ("import os, sys, time; from dapo_jax.builders import record\n"
         "def write(d):\n"
         "  open(os.path.join(d, 'config.json'), 'w').write('new')\n"
         "  print('writing', flush=True); time.sleep(600)\n"
         "record.write_model_dir(sys.argv[1], write)")


def test_a_kill_during_a_model_write_leaves_the_old_model_whole(tmp_path):
  d = tmp_path / "sft_model"
  record.write_model_dir(str(d), lambda t: (open(os.path.join(t, "config.json"), "w").write("old"),
                                             open(os.path.join(t, "model.safetensors"), "w").write("old")))
  p = subprocess.Popen([sys.executable, "-c", WRITE, str(d)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
  assert p.stdout.readline().strip() == "writing"
  p.send_signal(signal.SIGKILL)
  p.wait()
  assert {f: (d / f).read_text() for f in os.listdir(d)} == {"config.json": "old", "model.safetensors": "old"}
  assert (tmp_path / "sft_model.partial" / "config.json").read_text() == "new"  # The cut write, set apart.
  record.write_model_dir(str(d), lambda t: open(os.path.join(t, "config.json"), "w").write("newer"))
  assert {f: (d / f).read_text() for f in os.listdir(d)} == {"config.json": "newer"}  # Replaced whole.
  assert sorted(os.listdir(tmp_path)) == ["sft_model"]


def test_a_kill_between_the_swaps_renames_is_finished_by_the_next_reader(tmp_path):
  d = tmp_path / "m"
  (tmp_path / "m.replaced").mkdir()
  (tmp_path / "m.replaced" / "config.json").write_text("old")
  (tmp_path / "m.partial").mkdir()
  (tmp_path / "m.partial" / "config.json").write_text("new")  # Complete: the first rename had happened.
  record.recover_model_dir(str(d))
  assert sorted(os.listdir(tmp_path)) == ["m"] and (d / "config.json").read_text() == "new"
