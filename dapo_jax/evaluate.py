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

from dapo_jax import console
from dapo_jax.data import prompts as data_lib
from dapo_jax.rollout import sampling
from dapo_jax.rollout.rollout import Rollout


def majority_correct(acc_k: Sequence[bool], preds_k: Sequence[str]) -> bool:
  """maj@k: whether the most frequent prediction (first seen among ties) is correct."""
  top = Counter(preds_k).most_common(1)[0][0]
  return bool(acc_k[list(preds_k).index(top)])


class Evaluator:
  """Samples k answers per held-out row and scores them with the rollout's reward (or its own).

  Identical rows (the same prompt and ground truth, e.g. AIME's 30 problems repeated 32 times) are
  one problem with k x (its copies) samples: avg@n, best@n and maj@n per problem come from one pass
  over the file's rows, n = k x copies. With the continuous engine no row is padded; the static
  sampler runs chunks of `rows` prompts padded to that static shape.
  """

  def __init__(self, rollout: Rollout, examples: Sequence[data_lib.Example], *, k: int,
               sampler_cfg: sampling.SamplerConfig, greedy: bool = False, seed: int = 0, rows: int = 1,
               progress: bool = False, reward=None):
    """`reward` scores the answers instead of the rollout's (e.g. the rule check of a run trained on
    a reward model's score); the evaluator closes it."""
    self.rollout, self.examples, self.k, self.progress = rollout, list(examples), k, progress
    self.reward = reward
    self.sampler_cfg, self.greedy, self.seed, self.rows = sampler_cfg, greedy, seed, max(rows, 1)
    problems: dict = {}
    for ex in self.examples:
      problems.setdefault((repr(ex.messages), ex.ground_truth, getattr(ex, "images", ())), []).append(ex)
    self.problems = [exs[0] for exs in problems.values()]
    self.copies = [len(exs) for exs in problems.values()]
    self.sampled_rows = 0  # rows the sampler decoded (the last run)

  def close(self) -> None:
    if self.reward is not None and hasattr(self.reward, "close"):
      self.reward.close()

  def run(self, params, key=None) -> dict:
    if not self.examples:
      return {}
    key = jax.random.key(self.seed + 1) if key is None else key
    if getattr(self.rollout, "owns_copy", None) and self.rollout.owns_copy(params):  # Trained on other devices.
      params = self.rollout.sampling_params(params)
    self.sampled_rows = 0
    episodes = getattr(self.rollout, "episodes", None)
    if episodes is not None:  # val/env/*: this evaluation's episodes, apart from training's env/*.
      episodes.reset_metrics()
    acc, preds = self.samples(params, self.k, key, self.sampler_cfg)
    n = self.k * max(set(self.copies), key=self.copies.count)  # samples per problem (the most common)
    all_acc = np.concatenate(acc)
    out = {f"val/acc/mean@{n}": float(all_acc.mean()), f"val/acc/best@{n}": float(np.mean([a.any() for a in acc])),
           f"val/acc/maj@{n}": float(np.mean([majority_correct(a, p) for a, p in zip(acc, preds)]))}
    if self.greedy:
      greedy_cfg = dataclasses.replace(self.sampler_cfg, temperature=0.0, top_p=1.0)
      acc_g, _ = self.samples(params, 1, key, greedy_cfg, per_copy=False)
      out["val/acc/greedy"] = float(np.mean([a[0] for a in acc_g]))
    return out | (episodes.metrics("val/env/") if episodes is not None else {})

  def samples(self, params, k: int, key, sampler_cfg, per_copy: bool = True):
    """(acc, predictions) per problem: k x copies samples each (k each without `per_copy`)."""
    r = self.rollout
    counts = [k * c if per_copy else k for c in self.copies]
    if r.cfg.engine == "continuous":
      texts, samples = self._continuous(params, counts, key, sampler_cfg)
    else:
      texts, samples = self._static(params, counts, key, sampler_cfg)
    if getattr(r, "episodes", None) is not None:  # Episodes: their environments' rewards.
      res = self.episode_rewards
    else:
      res = r.call_reward(texts, [ex for ex, n in zip(self.problems, counts) for _ in range(n)], self.reward)
    first = np.cumsum([0] + counts)
    acc = [np.array([x["acc"] for x in res[first[q]:first[q + 1]]], bool) for q in range(len(counts))]
    preds = [[x["pred"] for x in res[first[q]:first[q + 1]]] for q in range(len(counts))]
    return acc, preds

  def _continuous(self, params, counts, key, sampler_cfg):
    r = self.rollout
    prompt_QP, mask_QP = r.encode(self.problems)
    eng = r.engine(sampler_cfg, max(self.rows * self.k, 1))
    bar = console.Progress(sum(counts), "eval", unit="sample", enabled=self.progress)
    episodes = getattr(r, "episodes", None)
    if episodes is not None:
      for q, ex in enumerate(self.problems):
        episodes.register(q, ex)
    samples, stats = eng.generate(params, prompt_QP, mask_QP, counts, key, on_samples=bar.update, episodes=episodes,
                                  images_QMD=r.image_vectors(params, self.problems))
    self.episode_rewards = stats.get("episode_rewards")
    bar.close()
    self.sampled_rows += stats["samples"]
    return r.decode(samples), samples

  def _static(self, params, counts, key, sampler_cfg):
    """Chunks of `rows` problems, the last padded to the static shape (a count per chunk: the largest)."""
    r, texts = self.rollout, []
    bar = console.Progress(len(self.problems), "eval", unit="problem", enabled=self.progress)
    for i in range(0, len(self.problems), self.rows):
      chunk, n = self.problems[i:i + self.rows], counts[i:i + self.rows]
      G = max(n)
      padded = chunk + [chunk[-1]] * (self.rows - len(chunk))
      samples = r.generate(params, padded, G, jax.random.fold_in(key, i), sampler_cfg)
      self.sampled_rows += len(padded) * G
      all_texts = r.decode(samples)
      texts += [all_texts[q * G + j] for q in range(len(chunk)) for j in range(n[q])]
      bar.update(len(chunk))
    bar.close()
    return texts, None
