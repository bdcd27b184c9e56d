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


def keep_groups(acc_QG: np.ndarray) -> np.ndarray:
  """Dynamic sampling: keep a prompt iff its correctness varies (population std > 0), or G == 1."""
  acc = np.asarray(acc_QG, np.float64)
  if acc.shape[1] == 1:
    return np.ones(acc.shape[0], bool)
  return acc.std(axis=1) > 0
