"""Supervised fine-tuning: the task's warm start, or SFT on conversation files.

  python -m launch.sft --workdir=runs/default --config.sft.steps=600
  python -m launch.sft --config=configs/sft_chat_arith.py
  python -m launch.sft --config=configs/sft_chat_arith.py --config.data.train_files=data/chats.jsonl
With data.task="arith" it trains on the built-in task's reference solutions; with data.task="file" on
`data.train_files` (conversations: messages or prompt/completion rows), packed, with a held-out loss.
Writes WORKDIR/sft_model (an HF directory) that `launch.train`, `launch.rm` and `launch.dpo` start from;
WORKDIR/sft holds its checkpoints (a rerun resumes) and metrics.
"""
import os

from absl import flags

from . import common

_CONFIG = common.define_config()
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default ./runs/<config>).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace WORKDIR/sft_model even if it holds files this "
                               "command does not write.")


def main(argv):
  del argv
  common.init_distributed()
  import jax  # (after launch.common has set XLA_FLAGS)

  from dapo_jax import builders, hf
  from dapo_jax.builders import record
  workdir = _WORKDIR.value or common.default_workdir()
  out = os.path.join(workdir, "sft_model")
  record.check_model_dir(out, "launch.sft", _OVERWRITE.value)  # Before any work: refused by name.
  model_cfg, params, tok = builders.run_sft(_CONFIG.value, workdir)
  if jax.process_index() == 0:
    params = jax.device_get(params)
    record.write_model_dir(out, lambda d: hf.save(d, model_cfg, params, tokenizer=tok))
  print(f"SFT model written to {out}")


if __name__ == "__main__":
  common.run(main)
