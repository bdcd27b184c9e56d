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
# Policy losses by verl's registry names (`policy_loss(mode=...)`).
POLICY_LOSSES = ("vanilla", "gspo", "cispo", "gpg")


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


def policy_loss(logp_BC, old_logp_BC, adv_B, mask_BC, *, eps_low: float, eps_high: float,
                clip_ratio_c: float | None = None, agg: str = "token_mean", num_tokens=None,
                num_seqs=None, norm_len: int | None = None, ref_logp_BC=None, kl_coef: float = 0.0,
                kl_estimator: str = "k3", adv_BC=None, mode: str = "vanilla"):
  """The policy loss (what is minimised) and its metrics; `mode` is one of POLICY_LOSSES, with
  verl's meaning:

  vanilla: the decoupled clip of DAPO (Eq. 10), per token, with the dual clip `clip_ratio_c`.
  gspo:    GSPO (arXiv 2507.18071): one ratio per response, s_i = exp(mean_t log r_i,t), clipped to
           [1-ε_low, 1+ε_high] (the paper's ranges are 3e-4 / 4e-4) and applied to every token with
           the token's own gradient (log s_i,t = sg[log s_i] + log π - sg[log π]; capped at 10 as
           verl does). Pair it with agg="seq_mean_token_mean", the paper's sequence mean.
  cispo:   CISPO (MiniMax-M1, arXiv 2506.13585): -sg(clip(r, 1-ε_low, 1+ε_high))·A·log π: the
           importance weight is clipped, never the gradient, so every token keeps its gradient.
  gpg:     GPG (arXiv 2504.02546): -A·log π, no ratio at all.

  logp_BC: log π_θ of the sampled tokens (differentiated); old_logp_BC: log π_old (constant);
  adv_B: one advantage per response, or adv_BC: one per token (PPO's GAE), which replaces it;
  mask_BC: tokens that count in the loss.
  Metrics are token means with the same denominators, so micro-batch metrics sum to the total.
  verl's names mean verl's quantities: pg_clipfrac (either PPO clip binds; cispo: the weight is
  clipped), ppo_kl (mean of log π_old - log π_θ) and pg_clipfrac_lower (the dual clip binds, A < 0
  and ratio > c). The PPO clip per side is ours: pg_clipfrac_eps_high (A > 0, ratio > 1+ε_high) and
  pg_clipfrac_eps_low (A < 0, ratio < 1-ε_low).
  """
  if mode not in POLICY_LOSSES:
    raise ValueError(f"policy loss {mode!r}; expected one of {POLICY_LOSSES}")
  old_logp_BC = jax.lax.stop_gradient(old_logp_BC)
  adv = adv_B[:, None] if adv_BC is None else adv_BC  # [B, 1] broadcasts over the tokens
  adv = jax.lax.stop_gradient(adv).astype(logp_BC.dtype)
  # As verl: the log-ratio is clamped before exp, so one wild token cannot make the loss inf / NaN.
  log_ratio_BC = jnp.clip(logp_BC - old_logp_BC, -20.0, 20.0)
  ratio_BC = jnp.exp(log_ratio_BC)
  none = jnp.zeros(logp_BC.shape, bool)
  high = low = dual = none
  if mode == "vanilla":
    loss_BC, high, low, dual = clipped_surrogate(ratio_BC, adv, eps_low, eps_high, clip_ratio_c)
  elif mode == "gspo":
    m = mask_BC.astype(logp_BC.dtype)
    log_seq_B1 = jnp.sum((logp_BC - old_logp_BC) * m, -1, keepdims=True) / jnp.maximum(jnp.sum(m, -1, keepdims=True), 1)
    log_s_BC = jnp.minimum(logp_BC - jax.lax.stop_gradient(logp_BC) + jax.lax.stop_gradient(log_seq_B1), 10.0)
    loss_BC, high, low, _ = clipped_surrogate(jnp.exp(log_s_BC), adv, eps_low, eps_high, None)
  elif mode == "cispo":
    weight_BC = jax.lax.stop_gradient(jnp.clip(ratio_BC, 1.0 - eps_low, 1.0 + eps_high))
    loss_BC = -weight_BC * adv * logp_BC
    high, low = ratio_BC > 1.0 + eps_high, ratio_BC < 1.0 - eps_low
  else:  # gpg
    loss_BC = -adv * logp_BC
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
  at its largest and smallest."""
  counts_LE, probs_LE = routing["counts_LE"], routing["probs_LE"]
  E = counts_LE.shape[-1]
  n = jnp.maximum(jnp.sum(routing["tokens_L"]), 1.0)
  aux = E * jnp.sum(jnp.sum(counts_LE, 0) / n * (jnp.sum(probs_LE, 0) / n))
  load_LE = E * counts_LE / jnp.maximum(jnp.sum(counts_LE, -1, keepdims=True), 1.0)
  return aux, {"router/aux_loss": jax.lax.stop_gradient(aux), "router/load_max": jnp.max(load_LE),
               "router/load_min": jnp.min(load_LE)}
