"""Train a reward model on preference pairs (TRL's schema), starting from an SFT model.

  python -m launch.rm --config=configs/rm_arith.py
  python -m launch.rm --config=configs/rm_arith.py --config.rm.train_files=pairs.jsonl --config.rm.init_dir=DIR
Writes WORKDIR/rm_model, a ...ForSequenceClassification directory (num_labels=1) that transformers
loads, `launch.serve_rm --model_dir` serves and `reward.fn=rm:DIR` scores with. Reruns resume.
"""
import os

from absl import flags

from . import common

_CONFIG = common.define_config()
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default ./runs/<config>).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace WORKDIR/rm_model even if it holds files this "
                               "command does not write.")


def main(argv):
  del argv
  common.init_distributed()
  import jax  # (after launch.common has set XLA_FLAGS)

  from dapo_jax import builders, sharding
  from dapo_jax.builders import record
  from dapo_jax.data import tokenizer
  from dapo_jax.hf import convert as hf
  from dapo_jax.pipelines import rm
  cfg = _CONFIG.value
  workdir = _WORKDIR.value or common.default_workdir()
  record.lock(workdir, jax.process_index())  # A second run on this workdir stops here, naming the first.
  out = os.path.join(workdir, "rm_model")
  record.check_model_dir(out, "launch.rm", _OVERWRITE.value)  # Before any work: refused by name.
  builders.validate_pairs(cfg, "rm")
  builders.save_pipeline_config(cfg, workdir, "rm")  # A resume that changes its start or loss fails here.
  train, held = builders.preference_data(cfg, "rm")
  tok = tokenizer.load(cfg.tokenizer.path or cfg.rm.init_dir)
  model_cfg, lm_params = hf.load(cfg.rm.init_dir, **builders.runtime_overrides(cfg))
  params, ev = rm.train(builders.rm_config(cfg), model_cfg, rm.from_lm(lm_params), tok, train, held,
                        sharding.make_mesh(cfg.mesh), workdir, lora=builders.lora_config(cfg))
  if jax.process_index() == 0:
    params = jax.device_get(params)
    record.write_model_dir(out, lambda d: hf.save_scalar(d, model_cfg, params, tokenizer=tok))
  print(f"reward model written to {out}; held-out pairwise accuracy "
        f"{ev.get('val/rm/accuracy', float('nan')):.3f}, margin {ev.get('val/rm/margin', float('nan')):.3f}")


if __name__ == "__main__":
  common.run(main)
