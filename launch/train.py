"""Train a policy with DAPO.

  python -m launch.train                                   # configs/default.py, ./runs/default
  python -m launch.train --config=configs/dapo_qwen2_5_32b.py --workdir=DIR --config.dapo.eps_high=0.3
  python -m launch.train --workdir=DIR --warm_start_only   # only the SFT warm start, into DIR/sft_model
"""

from absl import flags

from . import common

_CONFIG = common.define_config()
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, logs, samples (default ./runs/<config>).")
_WARM_START_ONLY = flags.DEFINE_bool(
    "warm_start_only", False, "Train the SFT warm start (model.init='sft') into WORKDIR/sft_model and stop: a "
    "start that several runs share (--config.model.init=hf --config.model.hf_dir=WORKDIR/sft_model).")


def main(argv):
  del argv
  common.init_distributed()
  from dapo_jax import builders  # After distributed init.
  workdir = _WORKDIR.value or common.default_workdir()
  if _WARM_START_ONLY.value:
    import jax

    from dapo_jax import sharding
    from dapo_jax.builders import record
    cfg = _CONFIG.value
    builders.validate(cfg)
    record.lock(workdir, jax.process_index())
    print(f"warm start: {builders.warm_start(cfg, workdir, sharding.make_mesh(cfg.mesh.to_dict()))}", flush=True)
    return
  common.say_workdir(workdir, "writes to")
  builders.run(_CONFIG.value, workdir)  # Validates the config before it builds the mesh.
  common.say_workdir(workdir, "wrote")


if __name__ == "__main__":
  common.run(main)
