"""Policy-gradient losses: DAPO's decoupled clip with token-level aggregation, and the baselines.

`policy_loss(mode=...)` is verl's registry of policy losses (one function per mode, POLICY_LOSS_FNS);
`rollout_correction` is verl's correction for the gap between the sampler's log-probs and the
trainer's; docs/losses.md has both, and where they differ from verl.

DAPO has no KL term and needs no reference model. The KL penalty here exists only for the
GRPO-style baseline configs; when it is off no reference forward pass runs at all.

Every aggregate takes optional global denominators (`num_tokens`, `num_seqs`): the train step
passes the counts of the whole mini-batch, summed over micro-batches and data-parallel shards, so
that summing micro-batch losses gives exactly the loss of the whole mini-batch (docs/losses.md).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dapo_jax.correction import (  # noqa: F401 (public: loss.rollout_correction and its options)
  ROLLOUT_IS,
  ROLLOUT_RS,
  SAFETY_BOUND,
  check_rollout_correction,
  mismatch_metrics,
  rollout_correction,
  threshold_bounds,
)

AGG_MODES = ("token_mean", "token_sum", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm",
             "seq_sum_token_sum_norm")


def token_logprobs(logits_BTV: jax.Array, tokens_BT: jax.Array) -> jax.Array:
  """log softmax(logits)[token] per position, in fp32."""
  logits_BTV = logits_BTV.astype(jnp.float32)
  picked_BT = jnp.take_along_axis(logits_BTV, tokens_BT[..., None], axis=-1)[..., 0]
  return picked_BT - jax.nn.logsumexp(logits_BTV, axis=-1)


def entropy(logits_BTV: jax.Array) -> jax.Array:
  """Per-token entropy H = logsumexp(z) - Σ softmax(z)·z of (already temperature-scaled) logits."""
  z = logits_BTV.astype(jnp.float32)
  return jax.nn.logsumexp(z, axis=-1) - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)


def sum_pi_squared(logits_BTV: jax.Array) -> jax.Array:
  """Per-token Σ_v π_v² of (already temperature-scaled) logits: 1 for a certain choice, 1/V for a uniform one."""
  return jnp.sum(jnp.square(jax.nn.softmax(logits_BTV.astype(jnp.float32), axis=-1)), axis=-1)


def masked_mean(x_BC: jax.Array, mask_BC: jax.Array, num_tokens=None) -> jax.Array:
  mask = mask_BC.astype(jnp.float32)
  denom = jnp.sum(mask) if num_tokens is None else num_tokens
  return jnp.sum(x_BC * mask) / jnp.maximum(denom, 1.0)


def num_seqs_with_tokens(mask_BC: jax.Array) -> jax.Array:
  return jnp.sum(jnp.any(mask_BC, axis=-1).astype(jnp.float32))


def aggregate(loss_BC: jax.Array, mask_BC: jax.Array, agg: str = "token_mean", *, num_tokens=None,
              num_seqs=None, norm_len: int | None = None) -> jax.Array:
  """Reduces per-token losses to a scalar (paper Eq. 12 for token_mean); i = rows, C = norm_len.

  token_mean:               Σ_i Σ_t L·m / Σ_i Σ_t m        (DAPO; over the whole mini-batch)
  token_sum:                Σ_i Σ_t L·m                     (verl's "token-sum")
  seq_mean_token_mean:      mean_i (Σ_t L·m / Σ_t m)        (GRPO, sample level)
  seq_mean_token_sum:       mean_i Σ_t L·m
  seq_mean_token_sum_norm:  mean_i Σ_t L·m / C              (Dr.GRPO; TRL's `dr_grpo`, verl's
                                                             "seq-mean-token-sum-norm" since 2026-02-26)
  seq_sum_token_sum_norm:   Σ_i Σ_t L·m / C                 (verl's "seq-mean-token-sum-norm" before)
  C is the completion budget (rollout.max_new_tokens, which the objective passes), never a length
  bucket's width; without `norm_len` it is the padded length. Sequence means count the rows with at
  least one loss token. The old verl formula sums over rows instead of averaging them, so its loss
  is larger by a factor of the row count (which changes how often grad clipping binds).
  """
  mask = mask_BC.astype(jnp.float32)
  if agg == "token_mean":
    return masked_mean(loss_BC, mask_BC, num_tokens)
  if agg not in AGG_MODES:
    raise ValueError(f"loss aggregation {agg!r}; expected one of {AGG_MODES}")
  seq_sum_B = jnp.sum(loss_BC * mask, axis=-1)
  if agg == "token_sum":  # Sums need no global denominator: micro-batches add up.
    return jnp.sum(seq_sum_B)
  seqs = num_seqs_with_tokens(mask_BC) if num_seqs is None else num_seqs
  if agg == "seq_mean_token_mean":
    seq_B = seq_sum_B / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
  elif agg == "seq_mean_token_sum":
    seq_B = seq_sum_B
  else:
    seq_B = seq_sum_B / float(norm_len or loss_BC.shape[-1])
    if agg == "seq_sum_token_sum_norm":
      return jnp.sum(seq_B)
  return jnp.sum(seq_B) / jnp.maximum(seqs, 1.0)


def clipped_surrogate(ratio_BC, adv_B1, eps_low: float, eps_high: float, clip_ratio_c: float | None):
  """Per-token decoupled-clip PPO loss (paper Eq. 10, as a loss), with optional dual clip.

  L = max(-A·r, -A·clip(r, 1-ε_low, 1+ε_high)); for A < 0 also min(L, -A·c) (dual clip).
  A is [B, 1] (one advantage per response) or [B, C] (one per token).
  Returns (loss_BC, upper-clipped, lower-clipped, dual-clipped) masks.
  """
  l1 = -adv_B1 * ratio_BC
  l2 = -adv_B1 * jnp.clip(ratio_BC, 1.0 - eps_low, 1.0 + eps_high)
  loss = jnp.maximum(l1, l2)
  clipped_high = (adv_B1 > 0) & (ratio_BC > 1.0 + eps_high)
  clipped_low = (adv_B1 < 0) & (ratio_BC < 1.0 - eps_low)
  dual = jnp.zeros_like(clipped_high)
  if clip_ratio_c is not None:
    if clip_ratio_c <= 1.0:
      raise ValueError(f"clip_ratio_c={clip_ratio_c} must be > 1")
    l3 = -adv_B1 * clip_ratio_c
    dual = (adv_B1 < 0) & (loss > l3)
    loss = jnp.where(adv_B1 < 0, jnp.minimum(loss, l3), loss)
  return loss, clipped_high, clipped_low, dual


def kl_penalty(logp_BC, ref_logp_BC, estimator: str = "k3") -> jax.Array:
  """Per-token KL(π_θ || π_ref) estimate: k1 = logp - ref, k3 = e^(ref-logp) - (ref-logp) - 1."""
  if estimator == "k1":
    return logp_BC - ref_logp_BC
  if estimator == "k3":
    d = jnp.clip(ref_logp_BC - logp_BC, -20.0, 20.0)
    return jnp.clip(jnp.exp(d) - d - 1.0, -10.0, 10.0)
  raise ValueError(f"kl estimator {estimator!r}; expected 'k1' or 'k3'")


# --- The policy-loss registry (verl's core_algos names and semantics) -----------------------------

class Terms(NamedTuple):
  """What every policy loss reads; all [B, C], constants except logp."""
  logp: jax.Array        # log π_θ, differentiated
  old: jax.Array         # log π_old
  adv: jax.Array         # advantage per token (a response's advantage on each of its tokens)
  mask: jax.Array        # float loss mask
  log_ratio: jax.Array   # log π_θ - log π_old, clamped to ±20 as verl does before exp
  ratio: jax.Array       # exp(log_ratio)
  w: jax.Array           # is_weights_BC (ones when None), multiplied into the per-token loss


class Knobs(NamedTuple):
  eps_low: float
  eps_high: float
  clip_ratio_c: float | None
  tau_pos: float
  tau_neg: float
  clip_cov_ratio: float
  clip_cov_lb: float
  clip_cov_ub: float
  kl_cov_ratio: float
  ppo_kl_coef: float
  dro_beta: float | None


sg = jax.lax.stop_gradient


def _token_mean(x_BC, t: Terms):
  """Mean over this micro-batch's loss tokens (verl's masked_mean; selections are per micro-batch)."""
  return jnp.sum(x_BC * t.mask) / jnp.maximum(jnp.sum(t.mask), 1.0)


def _largest(score_BC, eligible_BC, k):
  """Marks the k (a traced count) highest scores among the eligible entries."""
  s = jnp.where(eligible_BC, score_BC, -jnp.inf).reshape(-1)
  order = jnp.argsort(-s)
  rank = jnp.zeros(s.shape, jnp.int32).at[order].set(jnp.arange(s.size, dtype=jnp.int32))
  return (rank.reshape(score_BC.shape) < k) & eligible_BC


def vanilla(t: Terms, k: Knobs):
  """PPO's clip with DAPO's decoupled ranges (Eq. 10) and the dual clip c for A < 0."""
  loss, high, low, dual = clipped_surrogate(t.ratio, t.adv, k.eps_low, k.eps_high, k.clip_ratio_c)
  return loss * t.w, {"pg_clipfrac": high | low, "pg_clipfrac_lower": dual, "pg_clipfrac_eps_high": high,
                      "pg_clipfrac_eps_low": low, "ppo_kl": -t.log_ratio}


def _dppo(t: Terms, k: Knobs, valid_BC):
  """DPPO's shared form: -A·sg(min(r, c))·log π on the tokens inside the divergence bound."""
  c = 20.0 if k.clip_ratio_c is None else k.clip_ratio_c  # verl's default truncation
  valid = sg(valid_BC.astype(t.logp.dtype))
  loss = -t.adv * sg(jnp.minimum(t.ratio, c)) * t.logp * valid
  return loss * t.w, {"pg_clipfrac": 1.0 - valid, "pg_clipfrac_lower": (t.ratio > c) * valid,
                      "ppo_kl": -t.log_ratio}


def dppo_tv(t: Terms, k: Knobs):
  """DPPO-Binary-TV (arXiv 2602.04879): a token counts while π - π_old stays within ε_high (A > 0)
  or above -ε_low (A ≤ 0); ε are probability differences here, not ratio ranges."""
  diff = jnp.exp(t.logp) - jnp.exp(t.old)
  return _dppo(t, k, jnp.where(t.adv > 0, diff <= k.eps_high, diff >= -k.eps_low))


def dppo_kl(t: Terms, k: Knobs):
  """DPPO-Binary-KL: the bound is on the KL of the Bernoulli (this token, any other) distributions,
  D = p_old·log(p_old/p) + (1-p_old)·log((1-p_old)/(1-p)) ≤ ε_high (A > 0) or ε_low (A ≤ 0); a token
  whose probability moved against its advantage (A > 0 and p ≤ p_old, or A ≤ 0 and p ≥ p_old) always counts."""
  p, p_old = jnp.exp(t.logp), jnp.exp(t.old)
  d = p_old * (t.old - t.logp) + (1.0 - p_old) * jnp.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
  return _dppo(t, k, jnp.where(t.adv > 0, (d <= k.eps_high) | (p <= p_old), (d <= k.eps_low) | (p >= p_old)))


def gspo(t: Terms, k: Knobs):
  """GSPO (arXiv 2507.18071): one ratio per response, s_i = exp(mean_t log r_i,t), clipped to
  [1-ε_low, 1+ε_high] (the paper: 3e-4 / 4e-4) and applied to every token with the token's own
  gradient (log s_i,t = sg[log s_i] + log π - sg[log π], capped at 10 as verl does)."""
  log_r = t.logp - t.old  # verl: not clamped; the sequence ratio is capped instead
  log_seq_B1 = jnp.sum(log_r * t.mask, -1, keepdims=True) / jnp.maximum(jnp.sum(t.mask, -1, keepdims=True), 1.0)
  s = jnp.exp(jnp.minimum(t.logp - sg(t.logp) + sg(log_seq_B1), 10.0))
  loss, high, low, _ = clipped_surrogate(s, t.adv, k.eps_low, k.eps_high, None)
  return loss * t.w, {"pg_clipfrac": high | low, "pg_clipfrac_lower": jnp.zeros_like(t.logp), "ppo_kl": -log_r}


def sapo(t: Terms, k: Knobs):
  """SAPO (arXiv 2511.20347): a soft gate instead of the clip, f(r) = σ(τ·(r - 1))·4/τ with
  τ = tau_pos for A > 0 and tau_neg otherwise; L = -f(r)·A."""
  tau = jnp.where(t.adv > 0, k.tau_pos, k.tau_neg)
  gate = jax.nn.sigmoid(tau * (t.ratio - 1.0)) * (4.0 / tau)
  zero = jnp.zeros_like(t.logp)
  return -gate * t.adv * t.w, {"pg_clipfrac": zero, "pg_clipfrac_lower": zero, "ppo_kl": -t.log_ratio}


def gpg(t: Terms, k: Knobs):
  """GPG (arXiv 2504.02546): -A·log π, no ratio at all."""
  del k
  return -t.adv * t.logp * t.w, {}


def reinforce(t: Terms, k: Knobs):
  """REINFORCE, verl's bypass-mode loss: -A·log π·w with w the rollout-correction weights (pass
  them as is_weights_BC), old_logp_BC the rollout's log-probs (ppo_kl then reads the mismatch)."""
  del k
  return -t.adv * t.logp * t.w, {"ppo_kl": -t.log_ratio}


def clip_cov(t: Terms, k: Knobs):
  """Clip-Cov (Cui et al. 2025, arXiv 2505.22617): PPO's clip, and the gradient of a few tokens
  PPO left unclipped whose covariance (A - mean A)·(log π - mean log π) lies in (lb, ub) is cut:
  at most max(⌊clip_cov_ratio·tokens⌋, 1) of them, counted per micro-batch as verl does."""
  r = jnp.exp(jnp.clip(t.logp - t.old, -20.0, 20.0))
  l1 = -t.adv * r
  l2 = -t.adv * jnp.clip(r, 1.0 - k.eps_low, 1.0 + k.eps_high)
  on = t.mask > 0
  cov = (t.adv - _token_mean(t.adv, t)) * sg(t.logp - _token_mean(t.logp, t))
  eligible = on & ~(l2 > l1) & (cov > k.clip_cov_lb) & (cov < k.clip_cov_ub)
  cut = _largest(cov, eligible, jnp.maximum(jnp.floor(k.clip_cov_ratio * jnp.sum(t.mask)), 1.0))
  loss = jnp.maximum(l1, l2) * (1.0 - cut)
  return loss * t.w, {"pg_clipfrac": cut, "ppo_kl": -t.log_ratio}


def kl_cov(t: Terms, k: Knobs):
  """KL-Cov (Cui et al. 2025): -A·r, plus ppo_kl_coef·|log r| on the max(⌊kl_cov_ratio·tokens⌋, 1)
  tokens of the largest covariance (A - mean A)·(log π - mean log π). ppo_kl is verl's: the mean |log r|."""
  log_r = t.logp - t.old
  on = t.mask > 0
  cov = (t.adv - _token_mean(t.adv, t)) * sg(t.logp - _token_mean(t.logp, t))
  top = _largest(cov, on, jnp.maximum(jnp.floor(k.kl_cov_ratio * jnp.sum(t.mask)), 1.0))
  loss = -t.adv * jnp.exp(jnp.clip(log_r, -20.0, 20.0)) + jnp.where(top, k.ppo_kl_coef * jnp.abs(log_r), 0.0)
  return loss * t.w, {"ppo_kl": jnp.abs(log_r)}


def geo_mean(t: Terms, k: Knobs):
  """GMPO (arXiv 2507.20673): the response's ratio is the geometric mean of its token ratios, each
  clipped in log space to [-ε_low, ε_high] on the side that limits the update (sign of A); the loss
  -mean_t(A)·exp(mean_t clipped log r) is one value per response, averaged over responses. Weights
  enter as their geometric mean over the response, as in verl."""
  log_r = jnp.clip(t.logp - t.old, -20.0, 20.0)
  sign = jnp.sign(t.adv)
  clamped = jnp.clip(log_r, -k.eps_low, k.eps_high)
  log_min = sign * jnp.minimum(sign * log_r, sign * clamped)
  n_B1 = jnp.sum(t.mask, -1, keepdims=True) + 1e-8
  ratio_B1 = jnp.exp(jnp.sum(log_min * t.mask, -1, keepdims=True) / n_B1)
  adv_B1 = jnp.sum(t.adv * t.mask, -1, keepdims=True) / n_B1
  w_B1 = jnp.exp(jnp.sum(jnp.log(t.w + 1e-10) * t.mask, -1, keepdims=True) / n_B1)
  # One loss per response, on each of its tokens: the sequence mean of token means is their mean.
  loss = jnp.broadcast_to(-adv_B1 * ratio_B1 * w_B1, t.logp.shape)
  clipped = log_r != clamped
  return loss, {"pg_clipfrac": clipped & (t.adv > 0), "pg_clipfrac_lower": clipped & (t.adv < 0),
                "ppo_kl": -log_r}


def dro(t: Terms, k: Knobs):
  """DRO (verl's docs/algo/dro.md): -(A·log π - β/2·(log π - log π_old)²), a quadratic penalty on
  the log-ratio instead of a clip; β = dro_beta > 0."""
  if k.dro_beta is None or k.dro_beta <= 0:
    raise ValueError(f"dro_beta={k.dro_beta}: policy loss 'dro' needs a positive dro_beta")
  log_r = t.logp - t.old
  return -(t.logp * t.adv - 0.5 * k.dro_beta * jnp.square(log_r)) * t.w, {"ppo_kl": -log_r}


def cispo(t: Terms, k: Knobs):
  """CISPO (MiniMax-M1, arXiv 2506.13585): -sg(clip(r, 1-ε_low, 1+ε_high))·A·log π: the importance
  weight is clipped, never the gradient, so every token keeps its gradient."""
  clipped = jnp.clip(t.ratio, 1.0 - k.eps_low, 1.0 + k.eps_high)
  return -sg(clipped) * t.adv * t.logp * t.w, {"pg_clipfrac": t.ratio != clipped,
                                                 "pg_clipfrac_lower": jnp.zeros_like(t.logp),
                                                 "ppo_kl": -t.log_ratio}


# `dapo.policy_loss` / `policy_loss(mode=...)`: verl's registry names, and "reinforce" (bypass mode).
POLICY_LOSS_FNS = {"vanilla": vanilla, "gspo": gspo, "sapo": sapo, "gpg": gpg, "clip_cov": clip_cov,
                   "kl_cov": kl_cov, "geo_mean": geo_mean, "dro": dro, "cispo": cispo, "dppo_tv": dppo_tv,
                   "dppo_kl": dppo_kl, "reinforce": reinforce}
POLICY_LOSSES = tuple(POLICY_LOSS_FNS)
# verl aggregates these at the sequence level whatever loss_agg_mode says (geo_mean: a mean over
# responses, which this aggregation of one value per response gives).
FIXED_AGG = {"gspo": "seq_mean_token_mean", "sapo": "seq_mean_token_mean", "geo_mean": "seq_mean_token_mean"}


def policy_loss(logp_BC, old_logp_BC, adv_B, mask_BC, *, eps_low: float, eps_high: float,
                clip_ratio_c: float | None = None, agg: str = "token_mean", num_tokens=None,
                num_seqs=None, norm_len: int | None = None, ref_logp_BC=None, kl_coef: float = 0.0,
                kl_estimator: str = "k3", adv_BC=None, mode: str = "vanilla", is_weights_BC=None,
                tau_pos: float = 1.0, tau_neg: float = 1.05, clip_cov_ratio: float = 0.0002,
                clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0, kl_cov_ratio: float = 0.0002,
                ppo_kl_coef: float = 0.1, dro_beta: float | None = None):
  """The policy loss (what is minimised) and its metrics; `mode` is one of POLICY_LOSSES with
  verl's meaning (each mode's function above says what it computes; docs/losses.md has the table).

  logp_BC: log π_θ of the sampled tokens (differentiated); old_logp_BC: log π_old (constant);
  adv_B: one advantage per response, or adv_BC: one per token (PPO's GAE), which replaces it;
  mask_BC: tokens that count in the loss; is_weights_BC: rollout-correction weights
  (`rollout_correction`), constants multiplying the per-token loss before aggregation.
  eps_low / eps_high are verl's clip_ratio_low / high (dppo: divergence bounds); clip_ratio_c is
  the dual clip (vanilla) or the truncation of the ratio (dppo, None = 20).
  gspo, sapo and geo_mean aggregate per sequence whatever `agg` says, as verl does.
  Metrics are verl's names without "actor/" (pg_clipfrac, ppo_kl, pg_clipfrac_lower: those the
  mode reports in verl) plus pg_loss; vanilla adds pg_clipfrac_eps_high / _eps_low (each side of
  the clip). Token metrics use the loss's token denominator, so micro-batch metrics sum to the total.
  """
  if mode not in POLICY_LOSS_FNS:
    raise ValueError(f"policy loss {mode!r}; expected one of {POLICY_LOSSES}")
  old_logp_BC = sg(old_logp_BC)
  adv = adv_B[:, None] if adv_BC is None else adv_BC
  adv = jnp.broadcast_to(sg(adv).astype(logp_BC.dtype), logp_BC.shape)
  # As verl: the log-ratio is clamped before exp, so one wild token cannot make the loss inf / NaN.
  log_ratio_BC = jnp.clip(logp_BC - old_logp_BC, -20.0, 20.0)
  w = jnp.ones_like(logp_BC) if is_weights_BC is None else sg(jnp.asarray(is_weights_BC, logp_BC.dtype))
  terms = Terms(logp=logp_BC, old=old_logp_BC, adv=adv, mask=mask_BC.astype(logp_BC.dtype),
                log_ratio=log_ratio_BC, ratio=jnp.exp(log_ratio_BC), w=w)
  knobs = Knobs(eps_low, eps_high, clip_ratio_c, tau_pos, tau_neg, clip_cov_ratio, clip_cov_lb, clip_cov_ub,
                kl_cov_ratio, ppo_kl_coef, dro_beta)
  loss_BC, token_metrics = POLICY_LOSS_FNS[mode](terms, knobs)
  pg_loss = aggregate(loss_BC, mask_BC, FIXED_AGG.get(mode, agg), num_tokens=num_tokens, num_seqs=num_seqs,
                      norm_len=norm_len)
  metrics = {"pg_loss": pg_loss}
  for name, x_BC in token_metrics.items():
    metrics[name] = masked_mean(sg(x_BC).astype(jnp.float32), mask_BC, num_tokens)
  loss = pg_loss
  if kl_coef:
    kl = aggregate(kl_penalty(logp_BC, sg(ref_logp_BC), kl_estimator), mask_BC, agg,
                   num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    metrics["kl_loss"] = kl
    loss = loss + kl_coef * kl
  return loss, metrics


# --- RLHF losses: value (PPO critic), DPO, pairwise reward model -------------------------------

def value_loss(values_BC, old_values_BC, returns_BC, mask_BC, clip_range: float, *, num_tokens=None):
  """Clipped value loss of PPO (verl's compute_value_loss, TRL's PPO):

  V_clip = clip(V, V_old - c, V_old + c);  L = 0.5 · token_mean(max((V - R)², (V_clip - R)²)).
  Metrics: vf_loss, vf_clipfrac (tokens where the clipped error is the larger), vpred_mean, vf_explained_var.
  """
  values_BC = values_BC.astype(jnp.float32)
  old_BC = jax.lax.stop_gradient(old_values_BC).astype(jnp.float32)
  ret_BC = jax.lax.stop_gradient(returns_BC).astype(jnp.float32)
  clipped_BC = jnp.clip(values_BC, old_BC - clip_range, old_BC + clip_range)
  l1_BC = jnp.square(values_BC - ret_BC)
  l2_BC = jnp.square(clipped_BC - ret_BC)
  loss = 0.5 * masked_mean(jnp.maximum(l1_BC, l2_BC), mask_BC, num_tokens)
  tok_mean = lambda x: masked_mean(jax.lax.stop_gradient(x).astype(jnp.float32), mask_BC, num_tokens)
  err_var = tok_mean(jnp.square(ret_BC - values_BC)) - jnp.square(tok_mean(ret_BC - values_BC))
  ret_var = tok_mean(jnp.square(ret_BC)) - jnp.square(tok_mean(ret_BC))
  metrics = {
      "vf_loss": loss,
      "vf_clipfrac": tok_mean(l2_BC > l1_BC),
      "vpred_mean": tok_mean(values_BC),
      "vf_explained_var": 1.0 - err_var / (ret_var + 1e-8),
  }
  return loss, metrics


DPO_LOSS_TYPES = ("sigmoid", "ipo")


def dpo_loss(chosen_logp_B, rejected_logp_B, ref_chosen_logp_B, ref_rejected_logp_B, beta: float,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0):
  """Direct Preference Optimisation (Rafailov et al. 2023; TRL's DPOTrainer formulas).

  h = (log π(y_c) - log π(y_r)) - (log π_ref(y_c) - log π_ref(y_r))
  sigmoid: -(1-ε)·log σ(β·h) - ε·log σ(-β·h)   (ε = label_smoothing, the conservative DPO)
  ipo:     (h - 1/(2β))²   (Azar et al. 2023; pass length-averaged log-probs, as TRL does)
  The log-probs are sums over response tokens. Metrics: the implicit rewards β·(log π - log π_ref).
  """
  if loss_type not in DPO_LOSS_TYPES:
    raise ValueError(f"dpo loss_type {loss_type!r}; expected one of {DPO_LOSS_TYPES}")
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  chosen, rejected = f32(chosen_logp_B), f32(rejected_logp_B)
  ref_chosen, ref_rejected = jax.lax.stop_gradient(f32(ref_chosen_logp_B)), jax.lax.stop_gradient(
      f32(ref_rejected_logp_B))
  h_B = (chosen - rejected) - (ref_chosen - ref_rejected)
  if loss_type == "sigmoid":
    loss_B = (-(1.0 - label_smoothing) * jax.nn.log_sigmoid(beta * h_B)
              - label_smoothing * jax.nn.log_sigmoid(-beta * h_B))
  else:
    loss_B = jnp.square(h_B - 1.0 / (2.0 * beta))
  chosen_r_B = jax.lax.stop_gradient(beta * (chosen - ref_chosen))
  rejected_r_B = jax.lax.stop_gradient(beta * (rejected - ref_rejected))
  metrics = {
      "rewards/chosen": jnp.mean(chosen_r_B),
      "rewards/rejected": jnp.mean(rejected_r_B),
      "rewards/accuracies": jnp.mean((chosen_r_B > rejected_r_B).astype(jnp.float32)),
      "rewards/margins": jnp.mean(chosen_r_B - rejected_r_B),
  }
  return jnp.mean(loss_B), metrics


def pairwise_rm_loss(chosen_r_B, rejected_r_B, margin_B=None):
  """Reward-model loss on preference pairs (Ouyang et al. 2022; TRL's RewardTrainer):

  L = mean(-log σ(r(x, y_c) - r(x, y_r) - m)), with an optional per-pair margin m (Llama 2).
  Metrics: accuracy (r_c > r_r) and the mean reward margin r_c - r_r.
  """
  diff_B = jnp.asarray(chosen_r_B, jnp.float32) - jnp.asarray(rejected_r_B, jnp.float32)
  if margin_B is not None:
    diff_B = diff_B - jnp.asarray(margin_B, jnp.float32)
  raw_B = jax.lax.stop_gradient(jnp.asarray(chosen_r_B, jnp.float32) - jnp.asarray(rejected_r_B, jnp.float32))
  loss = jnp.mean(-jax.nn.log_sigmoid(diff_B))
  return loss, {"rm_loss": loss, "accuracy": jnp.mean((raw_B > 0).astype(jnp.float32)), "margin": jnp.mean(raw_B)}


def router_aux_loss(routing: dict) -> tuple[jax.Array, dict]:
  """The load-balancing loss of a mixture of experts (Switch Transformer, eqs. 4-6), as transformers'
  `load_balancing_loss_func` computes it: E * sum_e f_e P_e, where f_e counts the assignments to
  expert e per token (they sum to k) and P_e is expert e's mean router probability, both over every
  expert layer's real tokens. `routing` is `model.routing`'s. Also returns router metrics: the
  load of each (layer, expert), its share of the layer's assignments times E (1 = balanced),
  at its largest and smallest; with recorded experts (routing replay), "router/replay_agreement": the
  share of the recorded (token, expert) choices (the sampler's, or π_old's) that this router's own
  top-k holds (1 = it would have routed every recorded token so)."""
  counts_LE, probs_LE = routing["counts_LE"], routing["probs_LE"]
  E = counts_LE.shape[-1]
  n = jnp.maximum(jnp.sum(routing["tokens_L"]), 1.0)
  aux = E * jnp.sum(jnp.sum(counts_LE, 0) / n * (jnp.sum(probs_LE, 0) / n))
  load_LE = E * counts_LE / jnp.maximum(jnp.sum(counts_LE, -1, keepdims=True), 1.0)
  metrics = {"router/aux_loss": jax.lax.stop_gradient(aux), "router/load_max": jnp.max(load_LE),
             "router/load_min": jnp.min(load_LE)}
  if "agree_L" in routing:
    recorded = jnp.sum(routing["recorded_L"])
    metrics["router/replay_agreement"] = jnp.sum(routing["agree_L"]) / jnp.maximum(recorded, 1.0)
  return aux, metrics
