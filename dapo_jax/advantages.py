"""Advantages and the train batch of a rollout step.

Group-relative advantages (paper Eq. 9), the dynamic-sampling keep mask (Eq. 11) and the pure host
functions that turn scored groups into a train batch (`fill_batch`, `to_train_batch`) are NumPy.
The RLHF estimators at the end (GAE, RLOO, REINFORCE++, the KL-shaped reward) are jnp, so they also
run jitted.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dapo_jax.datatypes import Groups, RLBatch

EPS = 1e-6


def group_advantages(rewards_QG: np.ndarray, norm_by_std: bool = True, valid_QG=None) -> np.ndarray:
  """Â_i = (R_i - mean_group) / (std_group + 1e-6), std unbiased (N-1); mean-only if not norm_by_std.

  A group of one response gets mean 0 and std 1, as in the reference implementation. `valid_QG`:
  the rows that count; each group's statistics are those of its valid rows alone (its other rows get 0).
  """
  if _masked(valid_QG):
    return _per_group(lambda r: group_advantages(r, norm_by_std), rewards_QG, valid_QG)
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


def _masked(valid_QG) -> bool:
  return valid_QG is not None and not np.all(valid_QG)


def _per_group(fn, rewards_QG, valid_QG, lengths_QG=None) -> np.ndarray:
  """`fn` (a group-local estimator) on each group's valid rows alone, as if the others were absent;
  0 for the others."""
  r, valid = np.asarray(rewards_QG, np.float64), np.asarray(valid_QG, bool)
  out = np.zeros(r.shape, np.float32)
  for q in range(r.shape[0]):
    v = valid[q]
    if v.any():
      args = (r[q:q + 1, v],) if lengths_QG is None else (r[q:q + 1, v], np.asarray(lengths_QG)[q:q + 1, v])
      out[q, v] = fn(*args)[0]
  return out


# `dapo.adv_estimator`: group-relative (Eq. 9), RLOO, REINFORCE++ with a group baseline, OPO, GPG,
# pass@k's and MaxRL's give one advantage per response; REINFORCE++ and GAE (PPO, with a value model)
# one per token, from the KL-shaped token rewards. verl's names, where ours are not shorter ("reinforce_plus_plus").
ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline", "opo", "gpg", "grpo_passk", "maxrl", "gdpo", "reinforce_pp",
              "gae", "distill", "optimal_token_baseline")
TOKEN_ESTIMATORS = ("reinforce_pp", "gae", "distill", "optimal_token_baseline")
KL_SHAPED_ESTIMATORS = ("reinforce_pp", "gae")  # Token rewards -β·KL to a reference; not distill's.


def _group_mean(r_QG: np.ndarray, valid_QG=None) -> np.ndarray:
  """Each group's mean, 0 for a group of one (verl's baselines); over its `valid_QG` rows when given."""
  if valid_QG is None:
    return r_QG.mean(axis=1, keepdims=True) if r_QG.shape[1] > 1 else np.zeros_like(r_QG)
  n = valid_QG.sum(axis=1, keepdims=True)
  return np.where(n > 1, np.where(valid_QG, r_QG, 0.0).sum(axis=1, keepdims=True) / np.maximum(n, 1), 0.0)


def reinforce_pp_baseline(rewards_QG, lengths_QG, valid_QG=None) -> np.ndarray:
  """REINFORCE++ with a group baseline (Hu 2025, verl's reinforce_plus_plus_baseline): R - group mean,
  then whitened over the batch's tokens (each response counts once per token: `lengths_QG`).
  `valid_QG`: only those rows count, in the group means and the whitening (the others get 0)."""
  x = np.asarray(rewards_QG, np.float64)
  n = np.asarray(lengths_QG, np.float64)
  if _masked(valid_QG):
    valid = np.asarray(valid_QG, bool)
    x = np.where(valid, x - _group_mean(x, valid), 0.0)
    n = np.where(valid, n, 0.0)
    N = n.sum()
    mean = (n * x).sum() / max(N, 1.0)
    var = (n * (x - mean) ** 2).sum() / max(N - 1.0, 1.0)
    return np.where(valid, (x - mean) / np.sqrt(var + 1e-8), 0.0).astype(np.float32)
  x = x - _group_mean(x)
  N = n.sum()
  mean = (n * x).sum() / max(N, 1.0)
  var = (n * (x - mean) ** 2).sum() / max(N - 1.0, 1.0)  # unbiased over tokens, as masked_whiten
  return ((x - mean) / np.sqrt(var + 1e-8)).astype(np.float32)


def opo(rewards_QG, lengths_QG) -> np.ndarray:
  """OPO (Hao et al. 2025, arXiv 2505.23585): R minus the length-weighted group mean Σ|y|·R / Σ|y|,
  the optimal baseline for sequence-level rewards; 0 for a group of one, as in verl."""
  r = np.asarray(rewards_QG, np.float64)
  n = np.asarray(lengths_QG, np.float64)
  if r.shape[1] == 1:
    return r.astype(np.float32)
  baseline = (n * r).sum(1, keepdims=True) / np.maximum(n.sum(1, keepdims=True), 1.0)
  return (r - baseline).astype(np.float32)


def gpg_advantages(rewards_QG, valid_QG=None) -> np.ndarray:
  """GPG (Chu et al. 2025, arXiv 2504.02546): α·(R - group mean) with α = responses / responses with a
  non-zero reward in the batch, which scales up batches where few responses score (F_norm = 1).
  `valid_QG`: only those rows count (the others get 0)."""
  r = np.asarray(rewards_QG, np.float64)
  if _masked(valid_QG):
    valid = np.asarray(valid_QG, bool)
    alpha = valid.sum() / max(np.count_nonzero(r[valid]), 1)
    return np.where(valid, alpha * (r - _group_mean(r, valid)), 0.0).astype(np.float32)
  alpha = r.size / max(np.count_nonzero(r), 1)
  return (alpha * (r - _group_mean(r))).astype(np.float32)


def passk_advantages(rewards_QG, norm_by_std: bool = True) -> np.ndarray:
  """verl's grpo_passk (Chen et al. 2025, arXiv 2503.19595, pass@k training): only each group's best
  response gets an advantage, r_max - r_second_max, divided by the group's std (unbiased) + 1e-6 with
  `norm_by_std`; the others get 0. A tie for the best gives 0."""
  r = np.asarray(rewards_QG, np.float64)
  Q, G = r.shape
  if G < 2:
    raise ValueError(f"dapo.adv_estimator='grpo_passk' needs 2 responses per group or more; got {G}")
  top_Q2 = np.sort(r, axis=1)[:, -2:]
  adv_Q = top_Q2[:, 1] - top_Q2[:, 0]
  if norm_by_std:
    adv_Q = adv_Q / (r.std(axis=1, ddof=1) + EPS)
  out = np.zeros_like(r)
  out[np.arange(Q), r.argmax(axis=1)] = adv_Q
  return out.astype(np.float32)


def maxrl_advantages(success_QG) -> np.ndarray:
  """MaxRL (Tajwar et al. 2026, arXiv 2602.02710, maximum likelihood RL): (s - p) / (p + 1e-6), with s
  the response's success (0 or 1) and p its group's success rate: a right answer gets (G - K) / K for K
  right of G, a wrong one -1, so hard prompts weigh more (1/p, the likelihood's gradient); a group
  without a success gets 0. The authors' formula on the reward, here on the correctness (`acc`): the
  paper's binary success, which a shaped score (the overlong penalty, ±1) is not."""
  s = np.asarray(success_QG, np.float64)
  p = s.mean(axis=1, keepdims=True)
  return ((s - p) / (p + EPS)).astype(np.float32)


def gdpo_advantages(parts_QGK: np.ndarray, weights_K, lengths_QG: np.ndarray, norm_by_std: bool = True,
                    valid_QG=None) -> np.ndarray:
  """verl's gdpo (Group reward-Decoupled normalisation, arXiv 2601.05242): each reward component k is
  normalised in its group as GRPO does (`group_advantages`), the results summed with weights w_k, and
  the sum whitened over the batch's response tokens (verl's masked_whiten: a response weighs as its
  `lengths_QG` tokens, variance unbiased). One component dominating the others no longer drowns them.
  Rows that are not `valid_QG` leave every statistic and get 0."""
  parts = np.asarray(parts_QGK, np.float64)
  valid = np.ones(parts.shape[:2], bool) if valid_QG is None else np.asarray(valid_QG, bool)
  adv_QG = sum(w * group_advantages(parts[..., k], norm_by_std, valid).astype(np.float64)
               for k, w in enumerate(weights_K))
  n_QG = np.asarray(lengths_QG, np.float64) * valid
  n = n_QG.sum()
  mean = (n_QG * adv_QG).sum() / n
  var = (n_QG * (adv_QG - mean) ** 2).sum() / max(n - 1, 1.0)
  return np.where(valid, (adv_QG - mean) / np.sqrt(var + 1e-8), 0.0).astype(np.float32)


def sequence_advantages(estimator: str, rewards_QG: np.ndarray, norm_by_std: bool = True, *,
                        lengths_QG: np.ndarray | None = None, valid_QG: np.ndarray | None = None,
                        acc_QG: np.ndarray | None = None, parts_QGK: np.ndarray | None = None,
                        part_weights: tuple[float, ...] = ()) -> np.ndarray:
  """One advantage per response [Q, G]; zeros for the token-level estimators (the loop computes
  those). `lengths_QG`: loss tokens per response, which reinforce_pp_baseline, opo and gdpo weigh by.
  `valid_QG` (`Groups.valid_QG`): the rows that count; the others get 0 and leave every statistic,
  so each advantage is what it would be without them. `acc_QG`: correctness, which maxrl reads.
  gdpo: the reward's components `parts_QGK` weighed by `part_weights` (() = ones; no components: the
  reward itself is the one component)."""
  if estimator == "gdpo":
    if lengths_QG is None:
      raise ValueError("dapo.adv_estimator='gdpo' whitens over response tokens: pass lengths_QG")
    parts = rewards_QG[..., None] if parts_QGK is None or not np.shape(parts_QGK)[-1] else parts_QGK
    weights = part_weights or (1.0,) * np.shape(parts)[-1]
    if len(weights) != np.shape(parts)[-1]:
      raise ValueError(f"dapo.gdpo_reward_weights has {len(weights)} weights for {np.shape(parts)[-1]} components")
    return gdpo_advantages(parts, weights, lengths_QG, norm_by_std, valid_QG)
  if estimator == "maxrl":
    if acc_QG is None:
      raise ValueError("dapo.adv_estimator='maxrl' reads each response's success: pass acc_QG")
    return _per_group(maxrl_advantages, acc_QG, valid_QG) if _masked(valid_QG) else maxrl_advantages(acc_QG)
  if estimator == "grpo":
    return group_advantages(rewards_QG, norm_by_std, valid_QG)
  if estimator == "rloo":
    return _per_group(rloo, rewards_QG, valid_QG) if _masked(valid_QG) else rloo(rewards_QG)
  if estimator == "gpg":
    return gpg_advantages(rewards_QG, valid_QG)
  if estimator == "grpo_passk":  # A group left with one valid row has no second best: 0.
    if _masked(valid_QG):
      return _per_group(lambda r: passk_advantages(r, norm_by_std) if r.shape[1] > 1 else np.zeros_like(r, np.float32),
                        rewards_QG, valid_QG)
    return passk_advantages(rewards_QG, norm_by_std)
  if estimator in ("reinforce_pp_baseline", "opo"):
    if lengths_QG is None:
      raise ValueError(f"dapo.adv_estimator={estimator!r} weighs responses by their length: pass lengths_QG")
    if estimator == "opo":
      return _per_group(opo, rewards_QG, valid_QG, lengths_QG) if _masked(valid_QG) else opo(rewards_QG, lengths_QG)
    return reinforce_pp_baseline(rewards_QG, lengths_QG, valid_QG)
  if estimator in TOKEN_ESTIMATORS:
    return np.zeros(np.shape(rewards_QG), np.float32)
  raise ValueError(f"dapo.adv_estimator={estimator!r}; expected one of {ESTIMATORS}")


# --- The train batch of a rollout step (host, pure) ---------------------------------------------


def to_train_batch(groups: Groups, Q: int, prompt_len: int, *, norm_adv_by_std: bool,
                   overlong_filter: bool, estimator: str = "grpo",
                   part_weights: tuple[float, ...] = ()) -> tuple[RLBatch, np.ndarray]:
  """Host arrays of the train batch, [Q*G rows, P+C]: each group's prompt (its last `prompt_len`
  positions, left-padded) then each completion; advantages per response (`sequence_advantages`:
  Eq. 9 for GRPO).

  Static shapes: fewer than Q groups are completed with repeats whose loss mask is all zero. With
  `overlong_filter`, truncated samples leave the loss and its denominator (§3.3); so do the rows that
  are not `valid_QG` (failed environments), which also leave their group's advantage statistics. Rows of carried
  groups get their sampling policy's log-probs as π_old (`behaviour_B`); the other rows' π_old is
  left to the update (zeros here), and with no carried group `behaviour_B` is None. Every row keeps
  the sampler's log-probs (`rollout_logp_BC`) for the mismatch metrics and the rollout correction.
  Returns the batch and the advantages of the real groups [n, G].
  """
  n, G, C = groups.tokens_QGC.shape
  adv_QG = sequence_advantages(estimator, groups.score_QG, norm_adv_by_std, lengths_QG=groups.policy_QGC.sum(-1),
                               valid_QG=groups.valid_QG, acc_QG=groups.acc_QG, parts_QGK=groups.parts_QGK,
                               part_weights=part_weights)
  real_Q = np.arange(Q) < n
  if n < Q:
    groups, adv_QG = groups.take(np.arange(Q) % n), adv_QG[np.arange(Q) % n]
  P = prompt_len
  prompt_BP = np.repeat(groups.prompt_QP[:, -P:], G, axis=0)
  pmask_BP = np.repeat(groups.prompt_mask_QP[:, -P:], G, axis=0)
  cmask_BC = groups.mask_QGC.reshape(-1, C)
  loss_mask_BC = groups.policy_QGC.reshape(-1, C) & np.repeat(real_Q, G)[:, None]  # Episodes: not observations.
  loss_mask_BC &= groups.valid_QG.reshape(-1, 1)  # Nor the rows of failed environments (`rollout.env_error`).
  if overlong_filter:
    loss_mask_BC &= ~groups.truncated_QG.reshape(-1, 1)
  old_logp_BC, behaviour_B = np.zeros(cmask_BC.shape, np.float32), None
  if groups.carried_Q.any():
    behaviour_B = np.repeat(groups.carried_Q, G)
    old_logp_BC = np.where(behaviour_B[:, None], groups.logp_QGC.reshape(-1, C), old_logp_BC).astype(np.float32)
  batch = RLBatch(tokens_BT=np.concatenate([prompt_BP, groups.tokens_QGC.reshape(-1, C)], 1).astype(np.int32),
                  mask_BT=np.concatenate([pmask_BP, cmask_BC], 1),
                  loss_mask_BC=loss_mask_BC,
                  old_logp_BC=old_logp_BC,
                  adv_B=adv_QG.reshape(-1).astype(np.float32),
                  ref_logp_BC=np.zeros(cmask_BC.shape, np.float32),
                  behaviour_B=behaviour_B,
                  rollout_logp_BC=groups.logp_QGC.reshape(-1, C).astype(np.float32),
                  images_BMD=np.repeat(groups.images_QMD, G, axis=0) if groups.images_QMD.shape[1] else None,
                  pixels_BICSS=np.repeat(groups.pixels_QICSS, G, axis=0) if groups.pixels_QICSS.shape[1] else None,
                  grids_BI2=np.repeat(groups.grids_QI2, G, axis=0) if groups.grids_QI2.shape[1] else None,
                  routes_BCLk=groups.experts_QGCLk.reshape(-1, C, *groups.experts_QGCLk.shape[3:])
                  if groups.experts_QGCLk.shape[-1] else None)
  return batch, adv_QG[real_Q]


# --- RLHF estimators (verl's semantics: verl/trainer/ppo/core_algos.py) ---------------------------

def masked_whiten(x_BC, mask_BC, shift_mean: bool = True) -> jax.Array:
  """(x - mean) / sqrt(var + 1e-8) over the masked entries; var unbiased (n-1), as verl and TRL.

  Entries outside the mask are transformed too (callers multiply by the mask when it matters).
  """
  x = jnp.asarray(x_BC, jnp.float32)
  m = jnp.asarray(mask_BC, jnp.float32)
  n = jnp.sum(m)
  mean = jnp.sum(x * m) / jnp.maximum(n, 1.0)
  # verl raises on n <= 1; under jit a single token gets the biased variance instead of a crash.
  var = jnp.sum(jnp.square(x - mean) * m) / jnp.maximum(n - 1.0, 1.0)
  out = (x - mean) * jax.lax.rsqrt(var + 1e-8)
  return out if shift_mean else out + mean


def gae(token_rewards_BC, values_BC, mask_BC, gamma: float, lam: float) -> tuple[jax.Array, jax.Array]:
  """Generalised Advantage Estimation (Schulman et al. 2016), as verl's compute_gae_advantage_return.

  δ_t = r_t + γ·V_{t+1} - V_t,  A_t = δ_t + γλ·A_{t+1},  returns = A + V (before whitening);
  masked positions carry V_{t+1} and A_{t+1} through unchanged, so a row's last real token
  bootstraps from 0. Advantages are whitened over the mask and zero outside it.
  """
  r_CB = jnp.asarray(token_rewards_BC, jnp.float32).T
  v_CB = jnp.asarray(values_BC, jnp.float32).T
  m_CB = jnp.asarray(mask_BC, jnp.float32).T

  def step(carry, xs):
    next_v_B, next_a_B = carry
    r_B, v_B, m_B = xs
    a_B = r_B + gamma * next_v_B - v_B + gamma * lam * next_a_B
    next_v_B = v_B * m_B + (1.0 - m_B) * next_v_B
    next_a_B = a_B * m_B + (1.0 - m_B) * next_a_B
    return (next_v_B, next_a_B), next_a_B

  zeros_B = jnp.zeros(r_CB.shape[1], jnp.float32)
  _, adv_CB = jax.lax.scan(step, (zeros_B, zeros_B), (r_CB, v_CB, m_CB), reverse=True)
  adv_BC = adv_CB.T
  returns_BC = adv_BC + v_CB.T
  mask = jnp.asarray(mask_BC, jnp.float32)
  return masked_whiten(adv_BC, mask) * mask, returns_BC


def rloo(rewards_QG) -> np.ndarray:
  """RLOO (Ahmadian et al. 2024): R_i minus the mean of the other G-1 responses to the same prompt.

  Equals (R_i - mean_group)·G/(G-1); a group of one keeps its reward, as in verl.
  """
  r = np.asarray(rewards_QG, np.float64)
  G = r.shape[1]
  if G == 1:
    return r.astype(np.float32)
  return ((r - r.mean(axis=1, keepdims=True)) * G / (G - 1)).astype(np.float32)


def reinforce_pp(token_rewards_BC, mask_BC, gamma: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """REINFORCE++ (Hu 2025), verl's outcome variant: discounted return-to-go per token, whitened
  over the whole batch's masked tokens (no critic, no group baseline). Returns (advantages, returns),
  both zero outside the mask.

  G_t = r_t + γ·G_{t+1} on loss tokens; a masked position (an observation inside an episode)
  passes G through unchanged, so the final score reaches the turns before a tool's reply (verl #7278).
  """
  r_CB = jnp.asarray(token_rewards_BC, jnp.float32).T
  m_CB = jnp.asarray(mask_BC, jnp.float32).T

  def step(running_B, xs):
    r_B, m_B = xs
    ret_B = (r_B + gamma * running_B) * m_B
    return ret_B + running_B * (1.0 - m_B), ret_B

  _, ret_CB = jax.lax.scan(step, jnp.zeros(r_CB.shape[1], jnp.float32), (r_CB, m_CB), reverse=True)
  returns_BC = ret_CB.T
  mask = jnp.asarray(mask_BC, jnp.float32)
  return masked_whiten(returns_BC, mask) * mask, returns_BC


def kl_shaped_rewards(score_B, logp_BC, ref_logp_BC, mask_BC, beta: float) -> jax.Array:
  """Per-token reward of PPO-RLHF (Ziegler et al. 2019; StackLLaMA / TRL): R(x, y) = r(x, y) - β·KL.

  r_t = -β·(log π(y_t) - log π_ref(y_t)) on every real token, plus the task score on the row's
  last real token; zero outside the mask. A row without tokens gets no score.
  """
  mask = jnp.asarray(mask_BC, jnp.float32)
  kl_BC = jnp.asarray(logp_BC, jnp.float32) - jnp.asarray(ref_logp_BC, jnp.float32)
  C = mask.shape[1]
  # Index of the last real token: the largest masked position (masks need not be contiguous).
  last_B = jnp.max(jnp.where(mask > 0, jnp.arange(C)[None, :], -1), axis=1)
  at_last_BC = (jnp.arange(C)[None, :] == last_B[:, None]).astype(jnp.float32)
  score_B1 = jnp.asarray(score_B, jnp.float32)[:, None]
  return (-beta * kl_BC) * mask + score_B1 * at_last_BC


@functools.partial(jax.jit, static_argnames=("estimator", "gamma", "lam", "group_size"))
def token_advantages(estimator: str, score_B, logp_BC, ref_logp_BC, mask_BC, values_BC=None, *, beta,
                     gamma: float, lam: float = 1.0, teacher_logp_BC=None, sum_pi_sq_BC=None,
                     group_size: int = 1, is_weights_BC=None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-token advantages of the token-level estimators from the rollout's score, log-probs of the
  policy that sampled and of the reference, and (GAE) the value model's values:
  (token_rewards_BC, advantages_BC, returns_BC).

  token rewards = `kl_shaped_rewards` (β may be 0: no KL); "gae": `gae(rewards, values, γ, λ)`;
  "reinforce_pp": `reinforce_pp(rewards, γ)`. Both whiten the advantages over the mask. "distill":
  the token reward and advantage are `distill_advantages` (the teacher's log-probs), returns alike.
  "optimal_token_baseline": `optimal_token_baseline` on the rows' groups of `group_size` (Σπ² of the
  sampling policy `sum_pi_sq_BC`; rollout importance weights `is_weights_BC`, or None).
  """
  if estimator == "distill":
    adv_BC = distill_advantages(logp_BC, teacher_logp_BC, mask_BC)
    return adv_BC, adv_BC, adv_BC
  token_rewards_BC = kl_shaped_rewards(score_B, logp_BC, ref_logp_BC, mask_BC, beta)
  if estimator == "gae":
    adv_BC, returns_BC = gae(token_rewards_BC, values_BC, mask_BC, gamma, lam)
  elif estimator == "reinforce_pp":
    adv_BC, returns_BC = reinforce_pp(token_rewards_BC, mask_BC, gamma)
  elif estimator == "optimal_token_baseline":
    adv_BC, returns_BC = optimal_token_baseline(token_rewards_BC, mask_BC, logp_BC, sum_pi_sq_BC, group_size,
                                                is_weights_BC=is_weights_BC)
  else:
    raise ValueError(f"token_advantages: estimator {estimator!r}; expected one of {TOKEN_ESTIMATORS}")
  return token_rewards_BC, adv_BC, returns_BC


def optimal_token_baseline(token_rewards_BC, mask_BC, logp_BC, sum_pi_sq_BC, group_size: int,
                           handle_zero_tail: bool = True, eps: float = 1e-8,
                           is_weights_BC=None) -> tuple[jax.Array, jax.Array]:
  """verl's optimal_token_baseline: a baseline per token and group, B_t = Σ_g G_t·W_t / Σ_g W_t over the
  group's G rows (consecutive in the batch), with G_t the return-to-go and W_t = Σ_{j<=t} (1 - 2π_j +
  Σ_v π_v²) the path's accumulated variance proxy (π_j the sampled token's probability under the
  sampling policy). A group of one has no baseline. `handle_zero_tail`: the one longest row of a group
  has no baseline past the second-longest's length (nothing to compare with there). `is_weights_BC`:
  rollout importance weights ρ̄ (`correction.rollout_correction`), which scale each step's w_j by ρ̄_j²
  (verl's rollout_is_weights). Returns (advantages G_t - B_t, returns G_t), 0 outside the mask."""
  mask = jnp.asarray(mask_BC, jnp.float32)
  B, C = mask.shape
  G = group_size
  returns_BC = jnp.flip(jnp.cumsum(jnp.flip(jnp.asarray(token_rewards_BC, jnp.float32) * mask, -1), -1), -1)
  w_BC = 1.0 - 2.0 * jnp.exp(jnp.asarray(logp_BC, jnp.float32)) + jnp.asarray(sum_pi_sq_BC, jnp.float32)
  if is_weights_BC is not None:
    w_BC = w_BC * jnp.square(jnp.asarray(is_weights_BC, jnp.float32))
  W_BC = jnp.cumsum(w_BC * mask, -1)
  if G == 1:
    return returns_BC * mask, returns_BC
  per_group = lambda x_BC: x_BC.reshape(B // G, G, C)
  num_QC = jnp.sum(per_group(returns_BC * W_BC * mask), 1)
  den_QC = jnp.sum(per_group(W_BC * mask), 1) + eps
  base_QGC = jnp.broadcast_to((num_QC / den_QC)[:, None, :], (B // G, G, C))
  if handle_zero_tail:
    len_QG = per_group(mask).sum(-1)
    top_Q2 = jnp.sort(len_QG, -1)[:, -2:]
    longest_QG = (len_QG == top_Q2[:, 1:]) & (jnp.sum(len_QG == top_Q2[:, 1:], -1, keepdims=True) == 1) & (
        top_Q2[:, 1:] > top_Q2[:, :1])
    tail_QGC = longest_QG[:, :, None] & (jnp.arange(C)[None, None, :] >= top_Q2[:, :1, None])
    base_QGC = jnp.where(tail_QGC, 0.0, base_QGC)
  return (returns_BC - base_QGC.reshape(B, C)) * mask, returns_BC


def distill_advantages(logp_BC, teacher_logp_BC, mask_BC) -> jax.Array:
  """On-policy distillation (GKD, Agarwal et al. 2024; verl / TRL / slime): on the policy's own samples,
  A_t = -(log π(y_t) - log π_teacher(y_t)), the per-token reverse KL as a negative reward, no
  discount and no baseline; zero outside the mask (`dapo.adv_estimator="distill"`, the teacher
  `dapo.teacher_dir`)."""
  mask = jnp.asarray(mask_BC, jnp.float32)
  return (jnp.asarray(teacher_logp_BC, jnp.float32) - jnp.asarray(logp_BC, jnp.float32)) * mask


def check_teacher_vocab(student_vocab: int, teacher_vocab: int, *, student: str, teacher: str) -> None:
  """A teacher scores the student's token ids, so both need one tokenizer; refused at start, naming both."""
  if student_vocab != teacher_vocab:
    raise ValueError(f"dapo.teacher_dir={teacher!r} has a vocabulary of {teacher_vocab} tokens, the policy "
                     f"{student!r} {student_vocab}: distillation needs one tokenizer")


def sequence_kl(logp_BC, ref_logp_BC, mask_BC, num_rows: int | None = None) -> float:
  """The batch's KL to the reference as verl's KL controller reads it (`apply_kl_penalty`): the k1
  estimate log π - log π_ref averaged over each row's tokens (0 for a row without tokens), then over
  the batch's own rows, the first `num_rows` (default all; the rest repeat groups to fill a short step)."""
  m = np.asarray(mask_BC, np.float64)[:num_rows]
  kl_B = ((np.asarray(logp_BC, np.float64) - np.asarray(ref_logp_BC, np.float64))[:num_rows] * m).sum(1)
  return float(np.mean(kl_B / np.maximum(m.sum(1), 1.0))) if len(m) else 0.0


class FixedKLController:
  """A constant KL coefficient β (the same interface as the adaptive one)."""

  def __init__(self, kl_coef: float):
    self.value = float(kl_coef)

  def update(self, current_kl: float, n_steps: int) -> None:
    del current_kl, n_steps


class AdaptiveKLController:
  """Adaptive KL coefficient (Ziegler et al. 2019, §2.2; TRL and verl):

  e = clip(KL / target - 1, -0.2, 0.2);  β ← β·(1 + e·n_steps / horizon).
  """

  def __init__(self, init_kl_coef: float, target: float, horizon: float):
    if target <= 0 or horizon <= 0:
      raise ValueError(f"adaptive KL controller: target={target} and horizon={horizon} must be > 0")
    self.value, self.target, self.horizon = float(init_kl_coef), float(target), float(horizon)

  def update(self, current_kl: float, n_steps: int) -> None:
    error = float(np.clip(current_kl / self.target - 1.0, -0.2, 0.2))
    self.value *= 1.0 + error * n_steps / self.horizon

