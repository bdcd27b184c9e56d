"""SFT on conversation data: packed rows with per-document attention, assistant-only loss, a held-out loss.

    params, ev = sft_chat.train(sft_chat.ChatSFTConfig(steps=300), model_cfg, params, tok, convs, held, mesh, workdir)

Rows are read by `conversations` (messages or prompt/completion schema), encoded with the loss on
the assistant turns (or every token), and packed into rows of `seq_len` tokens
(`objectives.packed_language_model`: a packed row computes what its conversations would one by
one). The arithmetic task's conversations can be written to a file with `arith_conversation_rows`,
so the pipeline reads them like any user data.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Sequence

import jax
import numpy as np

from dapo_jax import conversations, metrics, objectives, optim, train_step
from dapo_jax import data as data_lib
from dapo_jax import lora as lora_lib
from dapo_jax import model as model_lib
from dapo_jax.datatypes import PackedLMBatch


@dataclasses.dataclass(frozen=True)
class ChatSFTConfig:
  steps: int = 300
  batch_size: int = 16           # packed rows per update
  seq_len: int = 256             # tokens per packed row
  lr: float = 1e-3
  warmup_steps: int = 20
  weight_decay: float = 0.0
  assistant_only: bool = True    # loss on assistant turns only (False: every token)
  packing: bool = True           # several conversations per row (False: one per row)
  chat_template: bool = True
  eval_every: int = 100          # updates between held-out losses (0 = at the end only)
  microbatch_tokens: int = 2048  # automatic micro-batches of at most this many tokens
  seed: int = 0


def arith_conversation_rows(n: int, *, split: str = "train", seed: int = 0, digits: int = 2, ops: str = "+",
                            style: str = "steps") -> list[dict]:
  """`n` SFT rows in the messages schema: the arithmetic task's prompt and its worked solution."""
  return [{"messages": [dict(m) for m in ex.messages]
           + [{"role": "assistant", "content": data_lib.arith_solution(ex, style)}]}
          for ex in data_lib.arith_examples(n, split=split, seed=seed, digits=digits, ops=ops)]


def corpus(convs: Sequence[conversations.Conversation]) -> list[str]:
  """The text of conversations, for training a tokenizer on them."""
  return ["\n".join(m["content"] for m in c.messages) for c in convs]


def rows(tok, convs: Sequence[conversations.Conversation], c: ChatSFTConfig, source: str = "",
         num_rows: int | None = None) -> PackedLMBatch:
  """Host batch of every conversation, packed (or one per row), padded to `num_rows` rows if given."""
  docs = [conversations.encode(tok, conv, c.chat_template, c.assistant_only, source) for conv in convs]
  if c.packing:
    packed = conversations.pack(docs, c.seq_len, tok.pad_token_id, num_rows)
  else:
    parts = [conversations.pack([d], c.seq_len, tok.pad_token_id) for d in docs]
    packed = conversations.PackedBatch(*(np.concatenate([getattr(p, f.name) for p in parts])
                                         for f in dataclasses.fields(conversations.PackedBatch)))
    if num_rows is not None:
      extra = num_rows - len(packed.tokens_BT)
      packed = conversations.PackedBatch(*(np.concatenate([x, np.zeros((extra,) + x.shape[1:], x.dtype)])
                                           for x in dataclasses.astuple(packed)))
  return PackedLMBatch(tokens_BT=packed.tokens_BT, positions_BT=packed.positions_BT,
                       segment_ids_BT=packed.segment_ids_BT, loss_mask_BT=packed.loss_mask_BT)


def train(c: ChatSFTConfig, model_cfg: model_lib.ModelConfig, params, tok, train_convs, held_convs, mesh,
          workdir: str, source: str = "", lora: lora_lib.LoraConfig | None = None) -> tuple[object, dict]:
  """SFT from `params`; returns (params, the last held-out metrics `val/sft/loss`). With `lora`,
  adapters train on the frozen `params`."""
  opt = optim.OptimConfig(lr=c.lr, warmup_steps=c.warmup_steps, weight_decay=c.weight_decay, grad_clip=1.0)
  trainer = train_step.Trainer(model_cfg, opt, mesh, objectives.packed_language_model(model_cfg),
                               num_microbatches=0, microbatch_tokens=c.microbatch_tokens, lora=lora, seed=c.seed)
  nll = trainer.forward(objectives.packed_nll(model_cfg))
  data = rows(tok, train_convs, c, source)
  n_rows = len(data.tokens_BT)
  docs_per_row = len(train_convs) / max(n_rows, 1)
  held = None
  if held_convs:
    held = rows(tok, held_convs, c, source)
    held = rows(tok, held_convs, c, source, num_rows=-(-len(held.tokens_BT) // c.batch_size) * c.batch_size)
  print(f"SFT: {len(train_convs)} conversations in {n_rows} rows of {c.seq_len} tokens "
        f"({docs_per_row:.1f} per row, {data.loss_mask_BT.mean():.0%} of tokens are targets); "
        f"{len(held_convs or [])} held out", flush=True)
  if n_rows < c.batch_size:
    raise ValueError(f"{n_rows} packed rows, fewer than sft.batch_size={c.batch_size}")

  def evaluate(p) -> dict:
    if held is None:
      return {}
    out = []
    for i in range(0, len(held.tokens_BT), c.batch_size):
      part = jax.tree.map(lambda x: x[i:i + c.batch_size], held)
      out.append(np.asarray(jax.device_get(nll(p, trainer.put_batch(part)))))
    s = np.concatenate(out).sum(0)
    return {"val/sft/loss": float(s[0] / max(s[1], 1))}

  writer = metrics.MetricWriter(workdir, enabled=jax.process_index() == 0)
  try:
    state = trainer.init(params=params)
    ev = evaluate(state.params)
    t0 = time.time()
    for step in range(c.steps):
      idx = np.random.default_rng([c.seed, step]).choice(n_rows, c.batch_size, replace=False)
      batch = trainer.put_batch(jax.tree.map(lambda x: x[idx], data))
      state, m = trainer.step(state.replace(rollout_step=step), batch)
      done = step + 1
      if done % 10 == 0 or done == c.steps:
        m = {f"sft/{k}": float(v) for k, v in jax.device_get(m).items()}
        writer.scalars(done, m)
        metrics.console(done, c.steps, m | {"time_s": time.time() - t0},
                        {"sft/lm_loss": "loss", "sft/token_acc": "token acc", "time_s": "s"})
      if (c.eval_every and done % c.eval_every == 0) or done == c.steps:
        ev = evaluate(state.params)
        writer.scalars(done, ev)
        if ev:
          print(f"SFT update {done}: held-out loss {ev['val/sft/loss']:.4f}", flush=True)
    logging.info("SFT done in %.0fs", time.time() - t0)
    return state.params, ev
  finally:
    writer.close()
