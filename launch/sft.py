"""Supervised warm start on the task's reference solutions (the default job runs it by itself).

  python -m launch.sft --workdir=runs/default --config.sft.steps=600
Writes WORKDIR/sft_model (an HF directory) that `launch.train` then starts from.
"""
import os

import jax
from absl import flags

from launch import common

_CONFIG = common.define_config()
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default ./runs/<config>).")


def main(argv):
  del argv
  common.init_distributed()
  from dapo_jax import from_config, hf, sft, sharding
  cfg = _CONFIG.value
  workdir = _WORKDIR.value or common.default_workdir()
  train, _ = from_config.datasets(cfg)
  tok = from_config.tokenizer(cfg, workdir, train)
  model_cfg = from_config.model_config(cfg, ((len(tok) + 63) // 64) * 64)
  params = sft.run(from_config.sft_config(cfg), model_cfg, tok, train, sharding.make_mesh(cfg.mesh))
  out = os.path.join(workdir, "sft_model")
  hf.save(out, model_cfg, jax.device_get(params), tokenizer=tok)
  print(f"SFT model written to {out}")


if __name__ == "__main__":
  common.run(main)
