"""Held-out accuracy of a policy: mean@k, best@k (pass@k), maj@k of sampled answers, and greedy.

    evaluator = evaluate.Evaluator(rollout, examples, k=32, sampler_cfg=..., greedy=True, seed=0)
    metrics = evaluator.run(params)        # {"val/acc/mean@32": ..., "val/acc/greedy": ...}

Used by the training loop, `launch.eval` and the notebook alike.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Sequence

import jax
import numpy as np

from dapo_jax import data as data_lib
from dapo_jax import sampling
from dapo_jax.rollout import Rollout


def majority_correct(acc_k: Sequence[bool], preds_k: Sequence[str]) -> bool:
  """maj@k: whether the most frequent prediction (first seen among ties) is correct."""
  top = Counter(preds_k).most_common(1)[0][0]
  return bool(acc_k[list(preds_k).index(top)])


class Evaluator:
  """Samples k answers per held-out prompt (in chunks of `rows` prompts, padded to that static
  shape so few sampler shapes compile) and scores them with the rollout's reward."""

  def __init__(self, rollout: Rollout, examples: Sequence[data_lib.Example], *, k: int,
               sampler_cfg: sampling.SamplerConfig, greedy: bool = False, seed: int = 0, rows: int = 1):
    self.rollout, self.examples, self.k = rollout, list(examples), k
    self.sampler_cfg, self.greedy, self.seed, self.rows = sampler_cfg, greedy, seed, max(rows, 1)

  def run(self, params, key=None) -> dict:
    if not self.examples:
      return {}
    k = self.k
    key = jax.random.key(self.seed + 1) if key is None else key
    acc, preds = self.samples(params, k, key, self.sampler_cfg)
    out = {f"val/acc/mean@{k}": float(acc.mean()), f"val/acc/best@{k}": float(acc.any(1).mean()),
           f"val/acc/maj@{k}": float(np.mean([majority_correct(a, p) for a, p in zip(acc, preds)]))}
    if self.greedy:
      greedy_cfg = dataclasses.replace(self.sampler_cfg, temperature=0.0, top_p=1.0)
      acc_g, _ = self.samples(params, 1, key, greedy_cfg)
      out["val/acc/greedy"] = float(acc_g.mean())
    return out

  def samples(self, params, k: int, key, sampler_cfg) -> tuple[np.ndarray, list[list[str]]]:
    """(acc [num_examples, k], predictions [num_examples][k])."""
    r = self.rollout
    accs, preds = [], []
    for i in range(0, len(self.examples), self.rows):
      chunk = self.examples[i:i + self.rows]
      n = len(chunk)
      chunk += [chunk[-1]] * (self.rows - n)  # Pad the last chunk to the static shape.
      samples = r.generate(params, chunk, k, jax.random.fold_in(key, i), sampler_cfg)
      res = r.reward(r.decode(samples), [ex.ground_truth for ex in chunk for _ in range(k)])
      accs.append(np.array([x["acc"] for x in res]).reshape(self.rows, k)[:n])
      preds += [[res[q * k + j]["pred"] for j in range(k)] for q in range(n)]
    return np.concatenate(accs), preds
