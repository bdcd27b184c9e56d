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

  from dapo_jax import console, from_config
  from dapo_jax.hf import convert as hf
  cfg = common.run_config(_CONFIG, _WORKDIR.value)  # The run's recorded config unless --config is given.
  model_cfg, params, tok, step = from_config.restore_policy(cfg, _WORKDIR.value)
  num_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  with console.timed(f"writing {console.size(num_bytes)} of parameters to {_OUT.value}"):
    hf.save(_OUT.value, model_cfg, jax.device_get(params), tokenizer=tok)
  console.say(f"wrote rollout step {step} of {_WORKDIR.value} to {_OUT.value}")


if __name__ == "__main__":
  common.run(main)
