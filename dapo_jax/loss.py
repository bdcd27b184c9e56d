"""Policy-gradient losses: DAPO's decoupled clip with token-level aggregation, and the baselines.

DAPO has no KL term and needs no reference model. The KL penalty here exists only for the
GRPO-style baseline configs; when it is off no reference forward pass runs at all.

Every aggregate takes optional global denominators (`num_tokens`, `num_seqs`): the train step
passes the counts of the whole mini-batch, summed over micro-batches and data-parallel shards, so
that summing micro-batch losses gives exactly the loss of the whole mini-batch (DAPO_SPEC §1.5b).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm",
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
  seq_mean_token_mean:      mean_i (Σ_t L·m / Σ_t m)        (GRPO, sample level)
  seq_mean_token_sum:       mean_i Σ_t L·m
  seq_mean_token_sum_norm:  mean_i Σ_t L·m / C              (Dr.GRPO, as TRL's `dr_grpo`)
  seq_sum_token_sum_norm:   Σ_i Σ_t L·m / C                 (verl's agg_loss "seq-mean-token-sum-norm")
  C defaults to the padded completion length (max_new_tokens). Sequence means count the rows with
  at least one loss token. verl's "seq-mean-token-sum-norm" sums over rows instead of averaging
  them, so its loss, and its gradient before clipping, is larger by a factor of the row count
  (which changes how often grad clipping binds); `seq_sum_token_sum_norm` is that formula over the
  whole mini-batch. verl applies it per micro-batch and averages micro-batches and data-parallel
  ranks, so its effective scale is 1 / (micro-batches x ranks) of this sum; with
  `verl_microbatch_weighting` the train step applies the micro-batch part of that average.
  """
  mask = mask_BC.astype(jnp.float32)
  if agg == "token_mean":
    return masked_mean(loss_BC, mask_BC, num_tokens)
  if agg not in AGG_MODES:
    raise ValueError(f"loss aggregation {agg!r}; expected one of {AGG_MODES}")
  seqs = num_seqs_with_tokens(mask_BC) if num_seqs is None else num_seqs
  seq_sum_B = jnp.sum(loss_BC * mask, axis=-1)
  if agg == "seq_mean_token_mean":
    seq_B = seq_sum_B / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
  elif agg == "seq_mean_token_sum":
    seq_B = seq_sum_B
  else:
    seq_B = seq_sum_B / float(norm_len or loss_BC.shape[-1])
    if agg == "seq_sum_token_sum_norm":  # A sum needs no global denominator: micro-batches add up.
      return jnp.sum(seq_B)
  return jnp.sum(seq_B) / jnp.maximum(seqs, 1.0)


def clipped_surrogate(ratio_BC, adv_B1, eps_low: float, eps_high: float, clip_ratio_c: float | None):
  """Per-token decoupled-clip PPO loss (paper Eq. 10, as a loss), with optional dual clip.

  L = max(-A·r, -A·clip(r, 1-ε_low, 1+ε_high)); for A < 0 also min(L, -A·c) (dual clip).
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


def policy_loss(logp_BC, old_logp_BC, adv_B, mask_BC, *, eps_low: float, eps_high: float,
                clip_ratio_c: float | None = None, agg: str = "token_mean", num_tokens=None,
                num_seqs=None, norm_len: int | None = None, ref_logp_BC=None, kl_coef: float = 0.0,
                kl_estimator: str = "k3"):
  """The DAPO policy loss (what is minimised) and its metrics.

  logp_BC: log π_θ of the sampled tokens (differentiated); old_logp_BC: log π_old (constant);
  adv_B: one advantage per response; mask_BC: tokens that count in the loss.
  Metrics are token means with the same denominators, so micro-batch metrics sum to the total.
  verl's names mean verl's quantities: pg_clipfrac (either PPO clip binds), ppo_kl (mean of
  log π_old - log π_θ) and pg_clipfrac_lower (the dual clip binds, A < 0 and ratio > c). The PPO
  clip per side is ours: pg_clipfrac_eps_high (A > 0, ratio > 1+ε_high) and pg_clipfrac_eps_low
  (A < 0, ratio < 1-ε_low).
  """
  old_logp_BC = jax.lax.stop_gradient(old_logp_BC)
  adv_B1 = jax.lax.stop_gradient(adv_B)[:, None].astype(logp_BC.dtype)
  ratio_BC = jnp.exp(logp_BC - old_logp_BC)
  loss_BC, high, low, dual = clipped_surrogate(ratio_BC, adv_B1, eps_low, eps_high, clip_ratio_c)
  pg_loss = aggregate(loss_BC, mask_BC, agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
  tok_mean = lambda x: masked_mean(x.astype(jnp.float32), mask_BC, num_tokens)
  metrics = {
      "pg_loss": pg_loss,
      "pg_clipfrac": tok_mean(high | low),
      "pg_clipfrac_lower": tok_mean(dual),   # verl's name for the dual-clip fraction
      "pg_clipfrac_eps_high": tok_mean(high),
      "pg_clipfrac_eps_low": tok_mean(low),
      "ppo_kl": tok_mean(jax.lax.stop_gradient(old_logp_BC - logp_BC)),
  }
  loss = pg_loss
  if kl_coef:
    kl = aggregate(kl_penalty(logp_BC, jax.lax.stop_gradient(ref_logp_BC), kl_estimator), mask_BC, agg,
                   num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    metrics["kl_loss"] = kl
    loss = loss + kl_coef * kl
  return loss, metrics
