"""Supervised warm start: packed language modelling on reference solutions, with the RL train step."""
from __future__ import annotations

import logging
import time

import jax
import numpy as np

from dapo_jax import data as data_lib
from dapo_jax import model as model_lib
from dapo_jax import optim, train_step
from dapo_jax import tokenizer as tokenizer_lib
from dapo_jax.datatypes import LMBatch


def pack(token_lists, seq_len: int, eos_id: int) -> np.ndarray:
  """Joins texts with EOS and cuts the stream into [N, seq_len] chunks (no padding; the tail is dropped)."""
  stream = np.concatenate([np.append(np.asarray(t, np.int32), eos_id) for t in token_lists])
  n = len(stream) // seq_len
  return stream[: n * seq_len].reshape(n, seq_len)


def sft_texts(tok, examples, chat_template: bool, style: str = "steps") -> list[str]:
  return [tokenizer_lib.render(tok, ex.messages, chat_template) + data_lib.arith_solution(ex, style)
          for ex in examples]


def run(cfg, model_cfg: model_lib.ModelConfig, tok, examples, mesh, workdir: str | None = None, params=None):
  """Returns SFT-trained params (random init unless `params` is given)."""
  s = cfg.sft
  if cfg.data.task != "arith":
    raise ValueError("the SFT warm start needs reference solutions, which only data.task='arith' has; "
                     "use model.init='hf' for other tasks")
  texts = sft_texts(tok, examples[: s.num_examples], cfg.data.chat_template, cfg.data.solution_style)
  ids = tok(texts, add_special_tokens=False)["input_ids"]
  # Each example ends with the chat's end-of-turn token, which is what stops generation.
  chunks = pack(ids, s.seq_len, tok.eos_token_id)
  opt = optim.OptimConfig(lr=s.lr, warmup_steps=s.warmup_steps, weight_decay=0.0, grad_clip=1.0)
  trainer = train_step.Trainer(model_cfg, opt, mesh, objective="lm")
  state = trainer.init(jax.random.key(cfg.seed), params=params)
  rng = np.random.default_rng(cfg.seed)
  t0 = time.time()
  logging.info("SFT: %d steps of %d x %d tokens from %d chunks", s.steps, s.batch_size, s.seq_len, len(chunks))
  for step in range(s.steps):
    rows = chunks[rng.integers(0, len(chunks), size=s.batch_size)]
    ones = np.ones_like(rows, bool)
    batch = trainer.put_batch(LMBatch(tokens_BT=rows, mask_BT=ones, loss_mask_BT=ones))
    state, metrics = trainer.step(state.replace(rollout_step=step), batch)
    if step % 25 == 0 or step == s.steps - 1:
      m = jax.device_get(metrics)
      print(f"SFT step {step + 1}/{s.steps}  loss {m['lm_loss']:.3f}  token acc {m['token_acc']:.3f}  "
            f"({time.time() - t0:.0f}s)", flush=True)
  return state.params
