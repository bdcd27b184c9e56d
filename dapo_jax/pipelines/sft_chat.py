"""SFT on conversation data: packed rows with per-document attention, assistant-only loss, a held-out loss.

    params, ev = sft_chat.train(sft_chat.ChatSFTConfig(steps=300), model_cfg, params, tok, convs, held, mesh, workdir)

Rows are read by `conversations` (messages or prompt/completion schema), encoded with the loss on
the assistant turns (or every token), and packed into rows of `seq_len` tokens
(`rlhf_objectives.packed_language_model`: a packed row computes what its conversations would one by
one). The arithmetic task's conversations can be written to a file with `arith_conversation_rows`,
so the pipeline reads them like any user data.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from dapo_jax import optim, rlhf_objectives, train_step
from dapo_jax.data import conversations
from dapo_jax.data import prompts as data_lib
from dapo_jax.datatypes import PackedLMBatch
from dapo_jax.model import lora as lora_lib
from dapo_jax.model import transformer as model_lib
from dapo_jax.pipelines import fit


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
  ckpt_every: int = 100          # updates between checkpoints (0 = at the end only)
  keep_ckpts: int = 2
  microbatch_tokens: int = train_step.MICROBATCH_TOKENS  # automatic micro-batches of at most this many tokens
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
  trainer = train_step.Trainer(model_cfg, opt, mesh, rlhf_objectives.packed_language_model(model_cfg),
                               num_microbatches=0, microbatch_tokens=c.microbatch_tokens, lora=lora, seed=c.seed)
  nll = trainer.forward(rlhf_objectives.packed_nll(model_cfg))
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

  state = trainer.init(params=params)
  choose = fit.seeded_choice(c.seed, n_rows, c.batch_size)
  fit_cfg = fit.FitConfig(steps=c.steps, eval_every=c.eval_every, ckpt_every=c.ckpt_every,
                          keep_ckpts=c.keep_ckpts, seed=c.seed)
  return fit.fit(fit_cfg, trainer, state, lambda step: jax.tree.map(lambda x: x[choose(step)], data), workdir,
                 evaluate=evaluate, label="SFT", prefix="sft", console_keys={"lm_loss": "loss", "token_acc": "token acc"},
                 eval_line=lambda ev: f"held-out loss {ev['val/sft/loss']:.4f}")
