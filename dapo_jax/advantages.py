"""Group-relative advantages (paper Eq. 9) and the dynamic-sampling keep mask (Eq. 11). NumPy, host side."""
from __future__ import annotations

import numpy as np

EPS = 1e-6


def group_advantages(rewards_QG: np.ndarray, norm_by_std: bool = True) -> np.ndarray:
  """Â_i = (R_i - mean_group) / (std_group + 1e-6), std unbiased (N-1); mean-only if not norm_by_std.

  A group of one response gets mean 0 and std 1, as in the reference implementation.
  """
  r = np.asarray(rewards_QG, np.float64)
  G = r.shape[1]
  if G == 1:
    mean, std = np.zeros_like(r), np.ones_like(r)
  else:
    mean = r.mean(axis=1, keepdims=True)
    std = r.std(axis=1, ddof=1, keepdims=True)
  adv = r - mean
  if norm_by_std:
    adv = adv / (std + EPS)
  return adv.astype(np.float32)


FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")


def filter_values(metric: str, *, acc_QG: np.ndarray, score_QG: np.ndarray, reward_QG: np.ndarray) -> np.ndarray:
  """The per-sample value dynamic sampling looks at (`dapo.filter_metric`), as verl names them.

  acc: the scorer's correctness; score: the scorer's score alone; seq_reward: the reward that is
  trained on (score + overlong penalty: verl's summed token-level scores); seq_final_reward: that
  minus an in-reward KL penalty, which DAPO has none of, so it equals seq_reward here.
  """
  if metric == "acc":
    return np.asarray(acc_QG)
  if metric == "score":
    return np.asarray(score_QG)
  if metric in ("seq_reward", "seq_final_reward"):
    return np.asarray(reward_QG)
  raise ValueError(f"dapo.filter_metric={metric!r}; expected one of {FILTER_METRICS}")


def keep_groups(values_QG: np.ndarray) -> np.ndarray:
  """Dynamic sampling: keep a prompt iff its values differ (verl: population std > 0), or G == 1."""
  v = np.asarray(values_QG, np.float64)
  if v.shape[1] == 1:
    return np.ones(v.shape[0], bool)
  # max > min is std > 0 in exact arithmetic; np.std of equal floats can come out 1e-17, not 0.
  return v.max(axis=1) > v.min(axis=1)
