"""Rollout correction: the sampler's log-probs against the trainer's (verl's rollout_corr_helper).

`rollout_correction` gives per-token importance weights (TIS / IcePop, per token or per response)
and a keep mask (rejection on k1/k2/k3 statistics at token, seq_sum, seq_mean or seq_max level);
`mismatch_metrics` measures the gap. Semantics, option strings and metric names are verl's
(docs/losses.md says where ours differ). `loss` re-exports the public names.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

ROLLOUT_IS = ("token", "sequence")
ROLLOUT_RS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
SAFETY_BOUND = 20.0  # log-ratios are clamped to ±20 before exp, as verl does


def threshold_bounds(spec, field: str, *, k1: bool = True) -> tuple[float, float | None]:
  """(upper, lower or None) of a threshold: a number, or "lower_upper"; one line naming the field if bad."""
  if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
    raise ValueError(f"{field}={spec!r}: expected a number or a 'lower_upper' string")
  text = str(spec).strip()
  if "_" in text and not k1:
    raise ValueError(f"{field}={spec!r}: a k2 / k3 option takes one upper bound")
  try:
    lower, upper = (float(v) for v in text.split("_", 1)) if "_" in text else (None, float(text))
  except ValueError:
    raise ValueError(f"{field}={spec!r}: expected a number or a 'lower_upper' string") from None
  if upper <= 0 or (lower is not None and not 0 < lower <= upper):
    raise ValueError(f"{field}={spec!r}: expected 0 < lower <= upper")
  return upper, lower


def _rs_options(rollout_rs: str, rollout_rs_threshold) -> dict[str, tuple[float, float | None]]:
  """{option: (upper, lower)} of a comma-separated rollout_rs and its thresholds (one, or one each)."""
  options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
  bad = [o for o in options if o not in ROLLOUT_RS]
  if not options or bad:
    raise ValueError(f"rollout_rs={rollout_rs!r}: expected comma-separated options from {ROLLOUT_RS}")
  if rollout_rs_threshold is None:
    raise ValueError("rollout_rs_threshold=None: rejection sampling (rollout_rs) needs a threshold")
  specs = [s.strip() for s in str(rollout_rs_threshold).split(",") if s.strip()]
  if len(specs) not in (1, len(options)):
    raise ValueError(f"rollout_rs_threshold={rollout_rs_threshold!r}: expected one threshold or {len(options)}")
  specs = specs * len(options) if len(specs) == 1 else specs
  out = {}
  for o, s in zip(options, specs):
    upper, lower = threshold_bounds(s, "rollout_rs_threshold", k1=o.endswith("k1"))
    out[o] = (upper, 1.0 / upper if lower is None and o.endswith("k1") else lower)
  return out


def check_rollout_correction(rollout_is=None, rollout_is_threshold=2.0, rollout_rs=None, rollout_rs_threshold=None,
                             **unused) -> None:
  """Refuses bad rollout-correction options (host Python, no array work), naming the option."""
  del unused
  if rollout_is is not None and rollout_is not in ROLLOUT_IS:
    raise ValueError(f"rollout_is={rollout_is!r}: expected None or one of {ROLLOUT_IS}")
  if rollout_is is not None and rollout_is_threshold is not None:
    threshold_bounds(rollout_is_threshold, "rollout_is_threshold")
  if rollout_rs is not None:
    _rs_options(rollout_rs, rollout_rs_threshold)


class _Rows(NamedTuple):
  """Reductions over the masked tokens and over the rows with tokens (padding rows never count)."""
  m: jax.Array       # float mask [B, C]
  rows: jax.Array    # float [B]: the row has a token

  def tok_mean(self, x_BC):
    return jnp.sum(x_BC * self.m) / (jnp.sum(self.m) + 1e-8)

  # Extremes of nothing (a micro-batch of padding rows) are 0, not ±inf.
  def tok_max(self, x_BC):
    return jnp.where(jnp.any(self.m > 0), jnp.max(jnp.where(self.m > 0, x_BC, -jnp.inf)), 0.0)

  def tok_min(self, x_BC):
    return jnp.where(jnp.any(self.m > 0), jnp.min(jnp.where(self.m > 0, x_BC, jnp.inf)), 0.0)

  def per_row_mean(self, x_BC):
    return jnp.sum(x_BC * self.m, -1) / (jnp.sum(self.m, -1) + 1e-8)

  def row_mean(self, x_B):
    return jnp.sum(x_B * self.rows) / jnp.maximum(jnp.sum(self.rows), 1.0)

  def row_max(self, x_B):
    return jnp.where(jnp.any(self.rows > 0), jnp.max(jnp.where(self.rows > 0, x_B, -jnp.inf)), 0.0)

  def row_min(self, x_B):
    return jnp.where(jnp.any(self.rows > 0), jnp.min(jnp.where(self.rows > 0, x_B, jnp.inf)), 0.0)

  def row_std(self, x_B):  # unbiased, 0 for one row (torch's std)
    n = jnp.sum(self.rows)
    var = jnp.sum(jnp.square(x_B - self.row_mean(x_B)) * self.rows) / jnp.maximum(n - 1.0, 1.0)
    return jnp.where(n > 1, jnp.sqrt(var), 0.0)

  def clamped_std(self, x_BC, lo, hi):  # verl's std of a statistic clamped to its bounds
    c = jnp.clip(x_BC, lo, hi)
    var = self.tok_mean(jnp.square(c)) - jnp.square(self.tok_mean(c))
    return jnp.where(jnp.sum(self.m) > 1, jnp.sqrt(jnp.maximum(var, 0.0)), 0.0)


def _is_weights(log_ratio_BC, r: _Rows, level: str, threshold, batch_normalize: bool):
  """Truncated (TIS: min(w, upper)) or masked (IcePop: 0 outside [lower, upper]) importance weights
  π_train / π_rollout per token or per sequence (the product over its tokens), and verl's metrics."""
  upper, lower = threshold_bounds(threshold, "rollout_is_threshold")
  if level == "token":
    stat_for_metrics = log_ratio_BC
    raw = jnp.exp(jnp.clip(log_ratio_BC, -SAFETY_BOUND, SAFETY_BOUND)) * r.m
  else:
    stat_for_metrics = jnp.sum(log_ratio_BC * r.m, -1)  # log of the sequence's weight
    raw = jnp.exp(jnp.clip(stat_for_metrics, -SAFETY_BOUND, SAFETY_BOUND))[:, None] * r.m
  w = jnp.minimum(raw, upper) if lower is None else jnp.where((raw >= lower) & (raw <= upper), raw, 0.0)
  low = 1.0 / upper if lower is None else lower
  f = lambda x: x.astype(r.m.dtype)
  m = {"rollout_is_mean": r.tok_mean(w)}
  if level == "sequence":
    m["rollout_is_max"] = jnp.exp(jnp.minimum(r.row_max(stat_for_metrics), SAFETY_BOUND))
    m["rollout_is_min"] = jnp.exp(r.row_min(stat_for_metrics))
    m["rollout_is_ratio_fraction_high"] = r.row_mean(f(stat_for_metrics > math.log(upper)))
    m["rollout_is_ratio_fraction_low"] = r.row_mean(f(stat_for_metrics < math.log(low)))
  else:
    m["rollout_is_ratio_fraction_high"] = r.tok_mean(f(raw > upper))
    m["rollout_is_ratio_fraction_low"] = r.tok_mean(f(raw < low))
    m["rollout_is_max"], m["rollout_is_min"] = r.tok_max(w), r.tok_min(w)
  m["rollout_is_std"] = r.clamped_std(w, 0.0, upper)
  wc = jnp.clip(w, 0.0, upper)
  second = r.tok_mean(jnp.square(wc / (r.tok_mean(wc) + 1e-8)))
  m["rollout_is_eff_sample_size"] = jnp.where(second > 0, 1.0 / jnp.where(second > 0, second, 1.0), 0.0)
  seq_B, raw_seq_B = r.per_row_mean(w), r.per_row_mean(raw)
  m.update({"rollout_is_seq_mean": r.row_mean(seq_B), "rollout_is_seq_std": r.row_std(seq_B),
            "rollout_is_seq_max": r.row_max(seq_B), "rollout_is_seq_min": r.row_min(seq_B),
            "rollout_is_seq_max_deviation": r.row_max(jnp.abs(seq_B - 1.0)),
            "rollout_is_seq_fraction_high": r.row_mean(f(raw_seq_B > upper)),
            "rollout_is_seq_fraction_low": r.row_mean(f(raw_seq_B < low))})
  if lower is not None:
    m["rollout_is_oob_ratio"] = r.tok_mean(f((raw < lower) | (raw > upper)))
  w = jax.lax.stop_gradient(w)
  if batch_normalize:  # Mean 1 over this batch's tokens (token) or sequences (sequence).
    mean = r.tok_mean(w) if level == "token" else r.row_mean(seq_B)
    ok = mean > 1e-8
    w = jnp.where(ok, w / jnp.where(ok, mean, 1.0), w)
    m["rollout_is_batch_norm_factor"] = jnp.where(ok, mean, 1.0)
  return w, m


def _rejection(log_ratio_BC, r: _Rows, options: dict):
  """The keep mask of every rejection option (all must pass) and verl's per-option metrics."""
  lr = jnp.clip(log_ratio_BC, -SAFETY_BOUND, SAFETY_BOUND)
  token_stats = {"k1": -lr, "k2": 0.5 * jnp.square(lr), "k3": jnp.expm1(lr) - lr}  # expm1: exact near 0
  f = lambda x: x.astype(r.m.dtype)
  on = r.m > 0
  keep_all = jnp.ones_like(r.m)
  m = {}
  for option, (upper, lower) in options.items():
    level, k = option.rsplit("_", 1)
    stat = token_stats[k]
    hi, lo = (math.log(upper), math.log(lower)) if k == "k1" else (upper, 0.0)
    if level != "token":
      if level == "seq_sum":
        seq_B = jnp.sum(stat * r.m, -1)
      elif level == "seq_mean":
        seq_B = r.per_row_mean(stat)
      else:  # seq_max
        seq_B = jnp.where(r.rows > 0, jnp.max(jnp.where(on, stat, -jnp.inf), -1), 0.0)
      stat = jnp.broadcast_to(seq_B[:, None], r.m.shape)
    else:
      seq_B = r.per_row_mean(stat)
    keep = (stat <= hi) & ((stat >= lo) if k == "k1" else True)
    p = f"rollout_rs_{option}"
    m[f"{p}_mean"] = r.tok_mean(stat)
    if level == "token":
      m[f"{p}_max"], m[f"{p}_min"] = r.tok_max(stat), r.tok_min(stat)
      m[f"{p}_fraction_high"] = r.tok_mean(f(stat > hi))
      m[f"{p}_fraction_low"] = r.tok_mean(f(stat < lo)) if k == "k1" else jnp.zeros(())
    else:
      m[f"{p}_max"], m[f"{p}_min"] = r.row_max(seq_B), r.row_min(seq_B)
      m[f"{p}_fraction_high"] = r.row_mean(f(seq_B > hi))
      m[f"{p}_fraction_low"] = r.row_mean(f(seq_B < lo)) if k == "k1" else jnp.zeros(())
    m[f"{p}_std"] = r.clamped_std(stat, lo, hi)
    m.update({f"{p}_seq_mean": r.row_mean(seq_B), f"{p}_seq_std": r.row_std(seq_B),
              f"{p}_seq_max": r.row_max(seq_B), f"{p}_seq_min": r.row_min(seq_B),
              f"{p}_seq_max_deviation": r.row_max(jnp.abs(seq_B)),
              f"{p}_seq_fraction_high": r.row_mean(f(seq_B > hi))})
    if k == "k1":
      m[f"{p}_seq_fraction_low"] = r.row_mean(f(seq_B < lo))
    m[f"{p}_masked_fraction"] = r.tok_mean(1.0 - f(keep))
    m[f"{p}_seq_masked_fraction"] = r.row_mean(f(jnp.any(~keep & on, -1)))
    keep_all = keep_all * f(keep)
  m["rollout_rs_masked_fraction"] = r.tok_mean(1.0 - keep_all)
  m["rollout_rs_seq_masked_fraction"] = r.row_mean(f(jnp.any((keep_all < 0.5) & on, -1)))
  return keep_all > 0.5, m


def mismatch_metrics(train_logp_BC, rollout_logp_BC, mask_BC) -> dict:
  """verl's off-policy diagnostics (compute_offpolicy_metrics) between the trainer's log-probs and
  the sampler's: KL(π_rollout || π_train) as k1 (`kl`) and k3 (`k3_kl`), perplexities, χ²."""
  dtype = jnp.promote_types(jnp.asarray(train_logp_BC).dtype, jnp.float32)  # fp32, or fp64 under x64
  r = _Rows(mask_BC.astype(dtype), jnp.any(mask_BC, -1).astype(dtype))
  train, rollout = (jnp.asarray(x, dtype) for x in (train_logp_BC, rollout_logp_BC))
  lr = jnp.clip(train - rollout, -SAFETY_BOUND, SAFETY_BOUND)
  mean_train_B, mean_rollout_B = r.per_row_mean(train), r.per_row_mean(rollout)
  diff_B = mean_rollout_B - mean_train_B
  return {"training_ppl": r.row_mean(jnp.exp(-mean_train_B)), "training_log_ppl": r.row_mean(-mean_train_B),
          "kl": r.tok_mean(rollout - train), "k3_kl": r.tok_mean(jnp.expm1(lr) - lr),
          "rollout_ppl": r.row_mean(jnp.exp(-mean_rollout_B)), "rollout_log_ppl": r.row_mean(-mean_rollout_B),
          "log_ppl_diff": r.row_mean(diff_B), "log_ppl_abs_diff": r.row_mean(jnp.abs(diff_B)),
          "log_ppl_diff_max": r.row_max(diff_B), "log_ppl_diff_min": r.row_min(diff_B),
          "ppl_ratio": r.row_mean(jnp.exp(diff_B)), "chi2_token": r.tok_mean(jnp.exp(2.0 * lr)) - 1.0,
          "chi2_seq": r.row_mean(jnp.exp(2.0 * jnp.clip(jnp.sum((train - rollout) * r.m, -1), -SAFETY_BOUND,
                                                       SAFETY_BOUND))) - 1.0}


def rollout_correction(old_logp_BC, rollout_logp_BC, mask_BC, *, rollout_is: str | None = None,
                       rollout_is_threshold=2.0, rollout_is_batch_normalize: bool = False,
                       rollout_rs: str | None = None, rollout_rs_threshold=None):
  """verl's rollout correction (compute_rollout_correction_and_rejection_mask, docs/algo/rollout_corr.md)
  between the trainer's log-probs (old_logp_BC: π_old; in bypass mode the current policy's) and
  the sampler's: (is_weights_BC or None, keep_mask_BC, metrics named "rollout_corr/<verl's key>").

  rollout_is: None | "token" | "sequence": weights w = π_train/π_rollout per token or per response
  (the product of its tokens'), with rollout_is_threshold a number (TIS: min(w, upper)) or
  "lower_upper" (IcePop: 0 outside the band); rollout_is_batch_normalize: mean 1 over this batch.
  rollout_rs: comma-separated rejections (all must pass), each a level and an estimator of the
  divergence k1 = -log w, k2 = ½(log w)², k3 = w - 1 - log w: token_k*, seq_sum_k* (sum over the
  response), seq_mean_k*, seq_max_k{2,3}; rollout_rs_threshold: one bound or one per option (k1:
  "lower_upper" on the ratio, or an upper u meaning [1/u, u]). Rejected tokens leave keep_mask_BC.
  Sequence statistics are over the rows with tokens (verl also counts empty rows in some of them).
  """
  check_rollout_correction(rollout_is, rollout_is_threshold, rollout_rs, rollout_rs_threshold)
  options = _rs_options(rollout_rs, rollout_rs_threshold) if rollout_rs is not None else {}
  dtype = jnp.promote_types(jnp.asarray(old_logp_BC).dtype, jnp.float32)  # fp32, or fp64 under x64
  r = _Rows(mask_BC.astype(dtype), jnp.any(mask_BC, -1).astype(dtype))
  old = jax.lax.stop_gradient(jnp.asarray(old_logp_BC, dtype))
  log_ratio_BC = old - jnp.asarray(rollout_logp_BC, dtype)
  metrics, weights_BC, keep_BC = {}, None, jnp.asarray(mask_BC, bool)
  if rollout_is is not None and rollout_is_threshold is not None:
    weights_BC, is_metrics = _is_weights(log_ratio_BC, r, rollout_is, rollout_is_threshold,
                                         rollout_is_batch_normalize)
    metrics.update(is_metrics)
  if options:
    keep_rs_BC, rs_metrics = _rejection(log_ratio_BC, r, options)
    keep_BC = keep_BC & keep_rs_BC
    metrics.update(rs_metrics)
  metrics.update(mismatch_metrics(old, rollout_logp_BC, mask_BC))
  return weights_BC, keep_BC, {f"rollout_corr/{k}": v for k, v in metrics.items()}
