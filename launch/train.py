"""Train a policy with DAPO.

  python -m launch.train                                   # configs/default.py, ./runs/default
  python -m launch.train --config=configs/dapo_qwen2_5_32b.py --workdir=DIR --config.dapo.eps_high=0.3
"""

from absl import flags

from . import common

_CONFIG = common.define_config()
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, logs, samples (default ./runs/<config>).")


def main(argv):
  del argv
  common.init_distributed()
  from dapo_jax import builders  # After distributed init.
  workdir = _WORKDIR.value or common.default_workdir()
  common.say_workdir(workdir, "writes to")
  builders.run(_CONFIG.value, workdir)  # Validates the config before it builds the mesh.
  common.say_workdir(workdir, "wrote")


if __name__ == "__main__":
  common.run(main)
