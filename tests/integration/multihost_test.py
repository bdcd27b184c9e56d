"""Two JAX processes on 127.0.0.1 (CPU, gloo collectives) equal one process with two devices."""
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multihost_worker.py")


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("streaming", [False, True], ids=["generation_batches", "streaming"])
def test_two_processes_match_one(tmp_path, streaming):
  """Streaming: every host takes the same admission and stop decisions, so the metrics match too."""
  base = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", STREAMING=str(int(streaming)))
  one = subprocess.run([sys.executable, WORKER, str(tmp_path / "one"), str(tmp_path / "one.npz")], cwd=ROOT,
                       env=dict(base, XLA_FLAGS="--xla_force_host_platform_device_count=2"),
                       capture_output=True, text=True, timeout=900)
  assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
  port = free_port()
  procs = [subprocess.Popen([sys.executable, WORKER, str(tmp_path / "two"), str(tmp_path / "two.npz"),
                             str(rank), "2", str(port)], cwd=ROOT, env=dict(base, XLA_FLAGS=""),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
  outs = [p.communicate(timeout=900)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
  a, b = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
  np.testing.assert_allclose(a["losses"], b["losses"], rtol=1e-5, atol=1e-6)
  assert list(a["metric_names"]) == list(b["metric_names"])
  for name, x, y in zip(a["metric_names"], a["metrics"].T, b["metrics"].T):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=name)
  if streaming:
    assert "rollout/prompts_returned" in list(a["metric_names"])
  assert set(a.files) == set(b.files)
  for k in set(a.files) - {"metric_names", "metrics", "losses"}:
    np.testing.assert_allclose(a[k], b[k], atol=1e-5, err_msg=k)
  assert os.path.isdir(tmp_path / "two" / "checkpoints" / "2")  # A multi-host orbax checkpoint.
