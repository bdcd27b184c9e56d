"""Two JAX processes on 127.0.0.1 (CPU, gloo collectives) equal one process with two devices."""
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from dapo_jax import testing
from tests.integration import multihost_worker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multihost_worker.py")


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
  """With generation batches, streamed (every host takes the same admission and stop decisions, so
  the metrics match too), and streamed one step off (one process overlaps the next rollout with the
  update in a thread; two run it before the update, in the order every process issues); a
  vision-language model whose prompts' pictures each process reads; an MoE replaying the sampler's
  expert records (R3); difficulty pools and per-file counts fed by every process's groups."""
  base = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  one = subprocess.run([sys.executable, WORKER, str(tmp_path / "one"), str(tmp_path / "one")], cwd=ROOT,
                       env=dict(base, XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {testing.FAST_COMPILE_XLA_FLAGS}"),
                       capture_output=True, text=True, timeout=900)
  assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
  port = free_port()
  procs = [subprocess.Popen([sys.executable, WORKER, str(tmp_path / "two"), str(tmp_path / "two"),
                             str(rank), "2", str(port)], cwd=ROOT, env=dict(base, XLA_FLAGS=testing.FAST_COMPILE_XLA_FLAGS),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
  outs = [p.communicate(timeout=900)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
  for mode in multihost_worker.MODES:
    a, b = np.load(tmp_path / f"one_{mode}.npz"), np.load(tmp_path / f"two_{mode}.npz")
    np.testing.assert_allclose(a["losses"], b["losses"], rtol=1e-5, atol=1e-6, err_msg=mode)
    assert list(a["metric_names"]) == list(b["metric_names"]), mode
    for name, x, y in zip(a["metric_names"], a["metrics"].T, b["metrics"].T):
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=f"{mode}: {name}")
    assert ("rollout/prompts_returned" in list(a["metric_names"])) == (mode in ("streaming", "one_step_off"))
    assert (a["vision_prompts"] > 0) == (b["vision_prompts"] > 0) == (mode == "vision_language")
    assert ("router/replayed_tokens" in list(a["metric_names"])) == (mode == "routing_replay")
    if mode == "curriculum":  # The pools set prompts aside and the stream skipped them.
      by_name = dict(zip(a["metric_names"], a["metrics"].T))
      assert by_name["data/curriculum_set_aside"].sum() > 0 and by_name["data/curriculum_skipped"].sum() > 0
      assert by_name["data/source/a/groups"].sum() > 0 and by_name["data/source/b/groups"].sum() > 0
    staleness = dict(zip(a["metric_names"], a["metrics"].T)).get("rollout/staleness_max")
    assert mode != "one_step_off" or list(staleness) == [0, 1], staleness  # Step 1 by the params before update 0.
    assert set(a.files) == set(b.files), mode
    for k in set(a.files) - {"metric_names", "metrics", "losses", "vision_prompts"}:
      np.testing.assert_allclose(a[k], b[k], atol=1e-5, err_msg=f"{mode}: {k}")
    assert os.path.isdir(tmp_path / "two" / mode / "checkpoints" / "2")  # A multi-host orbax checkpoint.
