"""dapo_jax: DAPO reinforcement learning for language models, in JAX.

    import dapo_jax
    run = dapo_jax.Run("configs/default.py", workdir="runs/nb")   # see dapo_jax.builders.api
"""
__version__ = "0.1.0"


def __getattr__(name: str):
  # The API pulls in jax; reward workers import this package and must stay light.
  if name in ("Run", "load_config"):
    from dapo_jax.builders import api
    return getattr(api, name)
  raise AttributeError(f"module 'dapo_jax' has no attribute {name!r}")
