"""One run per workdir (issue #37): real processes take WORKDIR/run.lock; a second one is refused
naming the first, and a run killed with SIGKILL leaves no stale lock."""
import os
import signal
import socket
import subprocess
import sys

import pytest

from dapo_jax import testing, workdir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, XLA_FLAGS=testing.FAST_COMPILE_XLA_FLAGS, JAX_PLATFORMS="cpu")
HOLD = ("import sys, time; from dapo_jax import workdir; workdir.lock(sys.argv[1]); print('locked', flush=True); "
        "time.sleep(600)")
TRY = ("import sys; from dapo_jax import workdir\n"
       "try:\n  workdir.lock(sys.argv[1]); print('locked')\n"
       "except workdir.WorkdirBusyError as e:\n  print(e); sys.exit(3)")


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
  path = workdir.lock(str(tmp_path))
  assert workdir.lock(str(tmp_path)) == path == os.path.join(os.path.realpath(tmp_path), workdir.LOCK_FILE)
  assert workdir.holder(str(tmp_path))["pid"] == os.getpid()
  assert try_lock(tmp_path).returncode == 3
  workdir.release(str(tmp_path))
  assert try_lock(tmp_path).returncode == 0


@pytest.mark.parametrize("where", ["gs://bucket/run", "other-process"])
def test_remote_workdirs_and_other_hosts_take_no_lock(tmp_path, where):
  if where == "other-process":  # Multi-host: process 0 holds the shared workdir's lock.
    assert workdir.lock(str(tmp_path), process_index=1) == ""
    assert not os.path.exists(tmp_path / workdir.LOCK_FILE)
  else:
    assert workdir.lock(where) == ""
