"""The paper recipe's sharding is consistent: lower the 32B step on a 128-device mesh, compile a cut."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pod_lowering_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["gpu16x8", "v5p256"])
def test_qwen2_5_32b_lowers_on_pod_mesh(mesh):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=128")
  out = subprocess.run([sys.executable, WORKER, mesh], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1500)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
  assert "lowered full 32B" in out.stdout and "compiled 2-layer cut" in out.stdout
