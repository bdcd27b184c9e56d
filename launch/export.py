"""Write the latest checkpoint of a run as a Hugging Face model directory (with its tokenizer).

  python -m launch.export --workdir=runs/default --out=exported/
"""
from absl import flags

from launch import common

_CONFIG = common.define_config()
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory.", required=True)
_OUT = flags.DEFINE_string("out", None, "Output directory.", required=True)


def main(argv):
  del argv
  import jax

  from dapo_jax import hf, loop, sharding
  cfg = _CONFIG.value
  dapo = loop.DAPO(cfg, _WORKDIR.value, sharding.make_mesh(cfg.mesh))
  step = dapo.restore()
  dapo.reward_pool.close()
  hf.save(_OUT.value, dapo.model_cfg, jax.device_get(dapo.state.params), tokenizer=dapo.tok)
  print(f"wrote rollout step {step} of {_WORKDIR.value} to {_OUT.value}")


if __name__ == "__main__":
  common.run(main)
