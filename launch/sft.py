"""Supervised fine-tuning: the task's warm start, or SFT on conversation files.

  python -m launch.sft --workdir=runs/default --config.sft.steps=600
  python -m launch.sft --config=configs/sft_chat_arith.py
  python -m launch.sft --config=configs/sft_chat_arith.py --config.data.train_files=data/chats.jsonl
With data.task="arith" it trains on the built-in task's reference solutions; with data.task="file" on
`data.train_files` (conversations: messages or prompt/completion rows), packed, with a held-out loss.
Writes WORKDIR/sft_model (an HF directory) that `launch.train`, `launch.rm` and `launch.dpo` start from.
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
  mesh = sharding.make_mesh(cfg.mesh)
  out = os.path.join(workdir, "sft_model")
  if cfg.data.task == "file":
    from dapo_jax import model, sft_chat
    train, held = from_config.conversation_data(cfg)
    tok = from_config.chat_tokenizer(cfg, workdir, train)
    if cfg.model.init == "hf":
      model_cfg, params = hf.load(cfg.model.hf_dir, **from_config.runtime_overrides(cfg))
    else:
      model_cfg = from_config.model_config(cfg, ((len(tok) + 63) // 64) * 64)
      params = model.init_params(model_cfg, jax.random.key(cfg.seed))
    params, ev = sft_chat.train(from_config.chat_sft_config(cfg), model_cfg, params, tok, train, held, mesh,
                                workdir, source=",".join(f for f in cfg.data.train_files if f),
                                lora=from_config.lora_config(cfg))
  else:
    train, _ = from_config.datasets(cfg)
    tok = from_config.tokenizer(cfg, workdir, train)
    model_cfg = from_config.model_config(cfg, ((len(tok) + 63) // 64) * 64)
    params = sft.run(from_config.sft_config(cfg), model_cfg, tok, train, mesh, lora=from_config.lora_config(cfg))
  hf.save(out, model_cfg, jax.device_get(params), tokenizer=tok)
  print(f"SFT model written to {out}")


if __name__ == "__main__":
  common.run(main)
