"""The pod recipes' sharding is consistent: lower the 32B and the 30B-A3B (expert-parallel) steps and
samplers on a 128-device mesh, compile a 2-layer cut."""
import os
import subprocess
import sys

import pytest

from dapo_jax import testing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pod_lowering_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("config,mesh", [("dapo_qwen2_5_32b", "gpu16x8"), ("dapo_qwen2_5_32b", "v5p256"),
                                         ("dapo_qwen3_30b_a3b", "gpu16x8")])
def test_recipe_lowers_on_pod_mesh(config, mesh):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count=128 {testing.FAST_COMPILE_XLA_FLAGS}")
  out = subprocess.run([sys.executable, WORKER, config, mesh], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1500)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
  assert f"lowered full {config}" in out.stdout and "compiled 2-layer cut" in out.stdout
