"""Preference pairs as training rows, shared by the reward model and DPO: the optimisation both
configure (`PairTrainConfig`), rows 2i chosen / 2i+1 rejected, and fixed-size forward passes over them."""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import numpy as np

from dapo_jax import train_step
from dapo_jax.data import preference
from dapo_jax.datatypes import PreferenceBatch
from dapo_jax.pipelines import fit


@dataclasses.dataclass(frozen=True)
class PairTrainConfig:
  """The optimisation of a preference-pair objective (reward model or DPO)."""
  steps: int = 300
  batch_pairs: int = 32          # pairs per update
  lr: float = 1e-4
  warmup_steps: int = 10         # updates of linear warm-up
  weight_decay: float = 0.0
  grad_clip: float = 1.0
  prompt_len: int = 64           # tokens; longer prompts keep their end
  response_len: int = 64         # tokens including EOS; longer responses keep their start
  chat_template: bool = True
  eval_every: int = 50           # updates between held-out evaluations (0 = at the end only)
  ckpt_every: int = 100          # updates between checkpoints (0 = at the end only)
  keep_ckpts: int = 2
  microbatch_tokens: int = train_step.MICROBATCH_TOKENS  # automatic micro-batches of at most this many tokens
  seed: int = 0

  def fit_config(self) -> fit.FitConfig:
    return fit.FitConfig(steps=self.steps, eval_every=self.eval_every, ckpt_every=self.ckpt_every,
                         keep_ckpts=self.keep_ckpts, seed=self.seed)


def pair_rows(tok, pairs: Sequence[preference.PreferencePair], c: PairTrainConfig) -> PreferenceBatch:
  """Host `PreferenceBatch` of every pair (rows 2i chosen, 2i+1 rejected)."""
  pb = preference.pair_batch(tok, pairs, c.prompt_len, c.response_len, c.chat_template)
  return PreferenceBatch.from_pairs(pb.tokens_BT, pb.mask_BT, pb.response_mask_BC)


def take_pairs(batch: PreferenceBatch, idx: np.ndarray) -> PreferenceBatch:
  rows = np.stack([2 * idx, 2 * idx + 1], axis=1).reshape(-1)
  return jax.tree.map(lambda x: np.asarray(x)[rows], batch)


def pad_pairs(batch: PreferenceBatch, multiple: int) -> tuple[PreferenceBatch, int]:
  """Pads with copies of the last pair to a multiple of `multiple` pairs; returns (batch, real pairs)."""
  n = batch.tokens_BT.shape[0] // 2
  extra = -n % multiple
  idx = np.concatenate([np.arange(n), np.full(extra, n - 1)]).astype(int)
  return take_pairs(batch, idx), n


def chunked(fn: Callable, trainer: train_step.Trainer, params, batch: PreferenceBatch, pairs_per_call: int) -> np.ndarray:
  """`fn(params, batch) -> [B]` (a `Trainer.forward`) over every row of a host batch, in fixed-size calls."""
  padded, n = pad_pairs(batch, pairs_per_call)
  out = []
  for i in range(0, padded.tokens_BT.shape[0] // 2, pairs_per_call):
    part = take_pairs(padded, np.arange(i, i + pairs_per_call))
    out.append(np.asarray(jax.device_get(fn(params, trainer.put_batch(part)))))
  return np.concatenate(out)[: 2 * n]


def batches(data: PreferenceBatch, c: PairTrainConfig) -> Callable[[int], PreferenceBatch]:
  """step -> `c.batch_pairs` random pairs of `data` (the same ones whatever the run did before)."""
  num_pairs = data.tokens_BT.shape[0] // 2
  if num_pairs < c.batch_pairs:
    raise ValueError(f"{num_pairs} training pairs, fewer than batch_pairs={c.batch_pairs}")
  choose = fit.seeded_choice(c.seed, num_pairs, c.batch_pairs)
  return lambda step: take_pairs(data, choose(step))
