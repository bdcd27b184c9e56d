"""Write the latest checkpoint of a run as a Hugging Face model directory (with its tokenizer).

  python -m launch.export --workdir=runs/default --out=exported/ [--overwrite]
"""
from absl import flags

from . import common

_CONFIG = common.define_config(reads_run_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory.", required=True)
_OUT = flags.DEFINE_string("out", None, "Output directory.", required=True)
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace the files of an --out directory that holds some.")


def main(argv):
  del argv
  import jax

  from dapo_jax import builders, console
  from dapo_jax.hf import convert as hf
  common.check_output_dir(_OUT.value, _OVERWRITE.value)  # Before anything is loaded.
  cfg = common.run_config(_CONFIG, _WORKDIR.value)  # The run's recorded config unless --config is given.
  model_cfg, params, tok, step = builders.restore_policy(cfg, _WORKDIR.value)
  num_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  with console.timed(f"writing {console.size(num_bytes)} of parameters to {_OUT.value}"):
    hf.save(_OUT.value, model_cfg, jax.device_get(params), tokenizer=tok)
  console.say(f"wrote rollout step {step} of {_WORKDIR.value} to {_OUT.value}")


if __name__ == "__main__":
  common.run(main)
