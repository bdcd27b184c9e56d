"""DPO on preference pairs (TRL's schema) from an SFT model, which is also the frozen reference.

  python -m launch.dpo --config=configs/dpo_arith.py
Prints the held-out rule-checked greedy accuracy before and after (pairs with a `ground_truth`) and
writes WORKDIR/dpo_model (an HF directory). Reruns resume.
"""
import os

from absl import flags

from . import common

_CONFIG = common.define_config()
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default ./runs/<config>).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace WORKDIR/dpo_model even if it holds files this "
                               "command does not write.")


def main(argv):
  del argv
  common.init_distributed()
  import jax  # (after launch.common has set XLA_FLAGS)

  from dapo_jax import builders, sharding
  from dapo_jax.builders import record
  from dapo_jax.data import tokenizer
  from dapo_jax.hf import convert as hf
  from dapo_jax.pipelines import dpo
  cfg = _CONFIG.value
  workdir = _WORKDIR.value or common.default_workdir()
  record.lock(workdir, jax.process_index())  # A second run on this workdir stops here, naming the first.
  out = os.path.join(workdir, "dpo_model")
  record.check_model_dir(out, "launch.dpo", _OVERWRITE.value)  # Before any work: refused by name.
  builders.validate_pairs(cfg, "dpo")
  builders.save_pipeline_config(cfg, workdir, "dpo")  # A resume that changes its start or loss fails here.
  mesh = sharding.make_mesh(cfg.mesh)
  train, held = builders.preference_data(cfg, "dpo")
  tok = tokenizer.load(cfg.tokenizer.path or cfg.dpo.init_dir)
  model_cfg, params = hf.load(cfg.dpo.init_dir, **builders.runtime_overrides(cfg))
  evaluator = builders.dpo_evaluator(cfg, tok, model_cfg, mesh, held)
  params, ev = dpo.train(builders.dpo_config(cfg), model_cfg, params, tok, train, held, mesh, workdir,
                         evaluator=evaluator, lora=builders.lora_config(cfg))
  if jax.process_index() == 0:
    params = jax.device_get(params)
    record.write_model_dir(out, lambda d: hf.save(d, model_cfg, params, tokenizer=tok))
  print(f"DPO model written to {out}")


if __name__ == "__main__":
  common.run(main)
