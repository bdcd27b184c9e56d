"""Test setup: 8 host CPU devices (set before jax is imported), strict rank promotion."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
  from dapo_jax import testing
  path = str(tmp_path_factory.mktemp("tokenizer"))
  testing.build_tokenizer(path)
  return path
