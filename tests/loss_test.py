"""Policy loss against a float64 NumPy reference written from verl's compute_policy_loss and agg_loss
(docs/losses.md)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax import loss

EPS_LOW, EPS_HIGH, C = 0.2, 0.28, 3.0


def np_reference(logp, old, adv, mask, agg, clip_c, norm_len=None):
  """Returns (loss, d loss / d logp, metrics), all from the formulas, token by token."""
  B, T = logp.shape
  r = np.exp(logp - old)
  A = adv[:, None] * np.ones((1, T))
  L = np.zeros((B, T))
  g = np.zeros((B, T))   # d L_tok / d logp = d L_tok / d r * r
  hi = np.zeros((B, T), bool)
  lo = np.zeros((B, T), bool)
  du = np.zeros((B, T), bool)
  for i in range(B):
    for t in range(T):
      a, x = A[i, t], r[i, t]
      if a >= 0:
        eff = min(x, 1 + EPS_HIGH)          # effective ratio multiplying -A
        L[i, t], g[i, t] = -a * eff, (-a * x if x <= 1 + EPS_HIGH else 0.0)
        hi[i, t] = a > 0 and x > 1 + EPS_HIGH
      else:
        eff = max(x, 1 - EPS_LOW)
        lo[i, t] = x < 1 - EPS_LOW
        L[i, t], g[i, t] = -a * eff, (-a * x if x >= 1 - EPS_LOW else 0.0)
        if clip_c is not None and eff > clip_c:
          L[i, t], g[i, t], du[i, t] = -a * clip_c, 0.0, True
  m = mask.astype(float)
  rows = [i for i in range(B) if m[i].sum() > 0]
  if agg == "token_mean":
    W = m / m.sum()
  elif agg == "seq_mean_token_mean":
    W = np.array([m[i] / max(m[i].sum(), 1) for i in range(B)]) / len(rows)
  elif agg == "seq_mean_token_sum":
    W = m / len(rows)
  elif agg == "token_sum":
    W = m
  elif agg == "seq_mean_token_sum_norm":
    W = m / (norm_len or T) / len(rows)
  else:  # seq_sum_token_sum_norm: verl's agg_loss sums the rows' token sums, then divides by T.
    W = m / (norm_len or T)
  tm = lambda x: (x * m).sum() / m.sum()
  metrics = {"pg_clipfrac_eps_high": tm(hi), "pg_clipfrac_eps_low": tm(lo), "pg_clipfrac": tm(hi | lo),
             "pg_clipfrac_lower": tm(du), "ppo_kl": tm(old - logp)}
  return (L * W).sum(), g * W, metrics


def case(seed=0):
  """4 responses x 6 tokens, ratios from 0.5 to 15, both signs of A, unequal lengths."""
  rng = np.random.default_rng(seed)
  ratios = np.array([[0.5, 0.79, 0.81, 1.0, 1.27, 1.29],
                     [0.5, 0.9, 1.1, 1.3, 4.0, 15.0],
                     [0.7, 0.85, 1.0, 1.2, 2.9, 3.5],
                     [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
  old = rng.normal(-2, 0.5, size=ratios.shape)
  logp = old + np.log(ratios)
  adv = np.array([1.5, -0.7, -2.0, 0.3])
  mask = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]], bool)
  return logp, old, adv, mask


@pytest.mark.parametrize("agg", loss.AGG_MODES)
@pytest.mark.parametrize("clip_c", [None, C])
def test_matches_numpy_reference(agg, clip_c):
  logp, old, adv, mask = case()
  ref_loss, ref_grad, ref_metrics = np_reference(logp, old, adv, mask, agg, clip_c)
  with jax.enable_x64(True):
    f = lambda lp: loss.policy_loss(lp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                                    eps_low=EPS_LOW, eps_high=EPS_HIGH, clip_ratio_c=clip_c, agg=agg)
    (val, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp))
    val, grad = float(val), np.asarray(grad)
    metrics = {k: float(v) for k, v in metrics.items()}
  assert sorted(metrics) == sorted([*ref_metrics, "pg_loss"])
  assert val == pytest.approx(ref_loss, abs=1e-10)
  np.testing.assert_allclose(grad, ref_grad, atol=1e-10)
  for k, v in ref_metrics.items():
    assert metrics[k] == pytest.approx(v, abs=1e-7), k  # Metrics are fp32 by design.
  assert metrics["pg_loss"] == pytest.approx(ref_loss, abs=1e-10)


def test_zero_gradient_where_clip_binds():
  logp, old, adv, mask = case()
  with jax.enable_x64(True):
    grad = np.asarray(jax.grad(lambda lp: loss.policy_loss(
        lp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), eps_low=EPS_LOW, eps_high=EPS_HIGH,
        clip_ratio_c=C)[0])(jnp.asarray(logp)))
  r = np.exp(logp - old)
  A = adv[:, None]
  binds = ((A > 0) & (r > 1 + EPS_HIGH)) | ((A < 0) & (r < 1 - EPS_LOW)) | ((A < 0) & (r > C))
  assert binds.sum() >= 5
  assert (grad[binds] == 0).all()
  assert (grad[~binds & mask & (A != 0)] != 0).all()
  assert (grad[~mask] == 0).all()  # Masked tokens get no gradient.


def test_a_wild_log_ratio_is_clamped_before_exp():
  """A token whose log-ratio is 100 (exp overflows fp32) gives a finite loss and finite gradients: the
  log-ratio is clamped to ±20 before exp, as verl does."""
  logp = jnp.asarray([[-1.0, 99.0, -2.0]])
  old = jnp.asarray([[-1.2, -1.0, -2.1]])
  mask = jnp.ones((1, 3), bool)
  for adv in (1.0, -1.0):
    f = lambda lp: loss.policy_loss(lp, old, jnp.asarray([adv]), mask, eps_low=0.2, eps_high=0.28,
                                    clip_ratio_c=None)[0]
    value, grad = jax.value_and_grad(f)(logp)
    assert np.isfinite(float(value)) and np.isfinite(np.asarray(grad)).all()
    if adv < 0:  # Unclipped for A < 0 without the dual clip: -A·e^20 / 3 tokens.
      np.testing.assert_allclose(float(value), (-adv * (np.exp(-1.0 + 1.2) + np.exp(20.0) + np.exp(0.1))) / 3,
                                 rtol=1e-5)


def test_token_mean_and_seq_mean_differ_with_unequal_lengths():
  logp, old, adv, mask = case()
  kw = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH)
  a = loss.policy_loss(logp, old, adv, mask, agg="token_mean", **kw)[0]
  b = loss.policy_loss(logp, old, adv, mask, agg="seq_mean_token_mean", **kw)[0]
  assert abs(float(a) - float(b)) > 1e-3


def two_micro_batches():
  """Token-level loss (paper Eq. 12) example: ratio 1, A=-3.75 on 4 tokens and A=-1.25 on 8 tokens."""
  mask = np.zeros((2, 8), bool)
  mask[0, :4] = True
  mask[1, :] = True
  logp = np.full((2, 8), -1.0)
  return logp, logp.copy(), np.array([-3.75, -1.25]), mask


def test_global_token_mean_vs_verl_micro_batch_weighting():
  logp, old, adv, mask = two_micro_batches()
  kw = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH)
  n_tok = mask.sum()
  # Global token mean: each micro-batch divides by the whole mini-batch's token count.
  global_mean = sum(float(loss.policy_loss(logp[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1],
                                           num_tokens=n_tok, **kw)[0]) for i in range(2))
  # verl: per-micro-batch token mean weighted by its share of sequences.
  verl = sum(float(loss.policy_loss(logp[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1], **kw)[0]) * 1 / 2
             for i in range(2))
  assert global_mean == pytest.approx(2.0833333, abs=1e-6)
  assert verl == pytest.approx(2.5, abs=1e-6)


def test_kl_estimators():
  logp = np.array([[-1.0, -2.0]])
  ref = np.array([[-1.5, -1.0]])
  k1 = np.asarray(loss.kl_penalty(logp, ref, "k1"))
  k3 = np.asarray(loss.kl_penalty(logp, ref, "k3"))
  d = ref - logp
  np.testing.assert_allclose(k1, logp - ref, rtol=1e-6)
  np.testing.assert_allclose(k3, np.exp(d) - d - 1, rtol=1e-6)
  out, metrics = loss.policy_loss(jnp.asarray(logp), jnp.asarray(logp), jnp.asarray([0.0]),
                                  jnp.ones((1, 2), bool), eps_low=0.2, eps_high=0.2, ref_logp_BC=ref,
                                  kl_coef=0.1, kl_estimator="k3")
  assert float(out) == pytest.approx(0.1 * k3.mean(), rel=1e-6)


def test_entropy_and_token_logprobs():
  z = np.array([[[1.0, 2.0, 0.5], [0.0, 0.0, 0.0]]])
  p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(loss.entropy(z)), -(p * np.log(p)).sum(-1), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(loss.token_logprobs(z, np.array([[1, 2]]))),
                             np.log([[p[0, 0, 1], p[0, 1, 2]]]), rtol=1e-6)


def verl_agg_loss(loss_mat, loss_mask, mode, loss_scale_factor=None):
  """verl's core_algos.agg_loss on one micro-batch with its defaults (dp_size=1, local counts)."""
  m = loss_mask.astype(float)
  if mode == "token-mean":
    return (loss_mat * m).sum() / m.sum()
  seq_sum = (loss_mat * m).sum(-1)
  has = m.sum(-1) > 0
  if mode == "seq-mean-token-sum":
    return seq_sum[has].sum() / has.sum()
  if mode == "seq-mean-token-mean":
    return (seq_sum / (m.sum(-1) + 1e-8))[has].sum() / has.sum()
  # seq-mean-token-sum-norm: a mean over rows since verl's change of 2026-02-26 (a sum before).
  return seq_sum[has].sum() / has.sum() / (loss_scale_factor or loss_mat.shape[-1])


@pytest.mark.parametrize("ours,verl", [("token_mean", "token-mean"), ("seq_mean_token_sum", "seq-mean-token-sum"),
                                       ("seq_mean_token_mean", "seq-mean-token-mean"),
                                       ("seq_mean_token_sum_norm", "seq-mean-token-sum-norm")])
def test_aggregations_match_verl_agg_loss(ours, verl):
  rng = np.random.default_rng(1)
  L = rng.normal(size=(5, 7))
  mask = np.array([[1] * 7, [1] * 3 + [0] * 4, [0] * 7, [1] * 6 + [0], [1] + [0] * 6], bool)  # One empty row.
  with jax.enable_x64(True):
    got = float(loss.aggregate(jnp.asarray(L), jnp.asarray(mask), ours))
    got20 = float(loss.aggregate(jnp.asarray(L), jnp.asarray(mask), ours, norm_len=20))
  assert got == pytest.approx(verl_agg_loss(L, mask, verl), rel=1e-7)   # verl adds 1e-8 to token counts.
  assert got20 == pytest.approx(verl_agg_loss(L, mask, verl, loss_scale_factor=20), rel=1e-7)


def test_dr_grpo_norm_is_the_old_verl_sum_over_rows_with_tokens():
  """Ours (TRL's dr_grpo, verl's today) averages the rows that verl's variant before 2026-02-26 summed:
  a factor of the row count."""
  logp, old, adv, mask = case()
  kw = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH)
  mean = float(loss.policy_loss(logp, old, adv, mask, agg="seq_mean_token_sum_norm", **kw)[0])
  total = float(loss.policy_loss(logp, old, adv, mask, agg="seq_sum_token_sum_norm", **kw)[0])
  assert total == pytest.approx(4 * mean, rel=1e-6)
  # Split into two micro-batches with the whole mini-batch's counts, the parts add up to the whole.
  parts = [float(loss.policy_loss(logp[s], old[s], adv[s], mask[s], agg=agg, num_tokens=mask.sum(),
                                  num_seqs=4.0, **kw)[0])
           for agg in ("seq_mean_token_sum_norm", "seq_sum_token_sum_norm") for s in (slice(0, 2), slice(2, 4))]
  assert parts[0] + parts[1] == pytest.approx(mean, rel=1e-6)
  assert parts[2] + parts[3] == pytest.approx(total, rel=1e-6)


def test_metric_names_follow_verl():
  """pg_clipfrac_lower is verl's dual-clip fraction: A < 0 and the ratio above clip_ratio_c."""
  logp = np.log(np.array([[5.0, 1.0, 0.5, 1.0], [1.5, 1.0, 1.0, 1.0]]))
  old = np.zeros((2, 4))
  mask = np.ones((2, 4), bool)
  _, m = loss.policy_loss(logp, old, np.array([-1.0, 1.0]), mask, eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0)
  # Row 0 (A<0): ratio 5 > c (dual clip), 0.5 < 0.8 (PPO low clip). Row 1 (A>0): 1.5 > 1.28.
  assert float(m["pg_clipfrac_lower"]) == pytest.approx(1 / 8)
  assert float(m["pg_clipfrac_eps_low"]) == pytest.approx(1 / 8)
  assert float(m["pg_clipfrac_eps_high"]) == pytest.approx(1 / 8)
  assert float(m["pg_clipfrac"]) == pytest.approx(2 / 8)   # verl: pg_losses2 > pg_losses1, both sides


# --- the registry's other modes, each against a float64 loop written from its paper --------------

def np_mode_reference(mode, logp, old, adv, mask, eps_low, eps_high):
  """(token-mean loss, d loss / d logp) of gspo / cispo / gpg, token by token."""
  B, T = logp.shape
  m = mask.astype(float)
  L, g = np.zeros((B, T)), np.zeros((B, T))
  for i in range(B):
    n = m[i].sum()
    s = np.exp(((logp[i] - old[i]) * m[i]).sum() / max(n, 1))  # GSPO: the response's geometric-mean ratio
    for t in range(T):
      a, r = adv[i], np.exp(logp[i, t] - old[i, t])
      if mode == "gspo":  # max(-A·s, -A·clip(s)); the token's gradient is d(-A·s·π/sg[π]) = -A·s.
        clipped = (a > 0 and s > 1 + eps_high) or (a < 0 and s < 1 - eps_low)
        L[i, t] = -a * (min(max(s, 1 - eps_low), 1 + eps_high) if clipped else s)
        g[i, t] = 0.0 if clipped else -a * s
      elif mode == "cispo":  # -sg(clip(r))·A·log π: every token keeps a gradient.
        w = min(max(r, 1 - eps_low), 1 + eps_high)
        L[i, t], g[i, t] = -w * a * logp[i, t], -w * a
      else:  # gpg
        L[i, t], g[i, t] = -a * logp[i, t], -a
  if mode == "gspo":  # verl's GSPO is a sequence mean of token means, whatever the aggregation.
    W = np.array([m[i] / max(m[i].sum(), 1) for i in range(B)]) / (m.sum(1) > 0).sum()
  else:
    W = m / m.sum()
  return (L * W).sum(), g * W


@pytest.mark.parametrize("mode", ["gspo", "cispo", "gpg"])
def test_policy_loss_modes_match_their_formulas(mode):
  logp, old, adv, mask = case()
  eps_low, eps_high = (3e-4, 4e-4) if mode == "gspo" else (EPS_LOW, EPS_HIGH)
  if mode == "gspo":  # Sequence ratios around GSPO's narrow band: rows 0 (A > 0) and 2 (A < 0) clipped.
    old = logp - np.array([[2e-3], [1e-4], [-2e-3], [-2e-3]]) * np.ones((1, logp.shape[1]))
  want, want_grad = np_mode_reference(mode, logp, old, adv, mask, eps_low, eps_high)
  with jax.enable_x64(True):
    f = lambda lp: loss.policy_loss(lp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), eps_low=eps_low,
                                    eps_high=eps_high, mode=mode)[0]
    got, grad = jax.value_and_grad(f)(jnp.asarray(logp))
  np.testing.assert_allclose(float(got), want, rtol=1e-10)
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-9, atol=1e-12)
  if mode == "gspo":  # A clipped response's tokens get no gradient; the others' all get one.
    g = np.asarray(grad)
    assert (g[[0, 2]] == 0).all() and (g[1][mask[1]] != 0).all() and (g[3][mask[3]] != 0).all()
  if mode == "cispo":  # Where PPO would zero the gradient (ratio 15, A < 0), CISPO keeps it.
    assert np.asarray(grad)[1, 5] != 0


def test_an_unknown_policy_loss_is_named():
  logp, old, adv, mask = case()
  with pytest.raises(ValueError, match="policy loss 'ppo2'"):
    loss.policy_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), eps_low=0.2,
                     eps_high=0.2, mode="ppo2")


# --- the objective's mismatch metrics and rollout correction ----------------------------------------

def test_mismatch_metrics_by_hand():
  """Ratios π_train/π_rollout of e^0.5, 1, e^-1 and 3 (the threshold 2 clips two) on four loss tokens."""
  from dapo_jax import objectives
  rollout = np.array([[-1.0, -2.0, -0.5], [-3.0, -1.0, -1.0]])
  log_r = np.array([[0.5, 0.0, -1.0], [np.log(3.0), 7.0, 0.0]])
  mask = np.array([[True, True, True], [True, False, False]])
  m = {k: float(v) for k, v in objectives.mismatch(rollout + log_r, rollout, mask, threshold=2.0).items()}
  lr = log_r[mask]
  assert m["mismatch/k1"] == pytest.approx(np.mean(-lr), rel=1e-6)
  assert m["mismatch/k3"] == pytest.approx(np.mean(np.exp(lr) - lr - 1), rel=1e-6)
  assert m["mismatch/ratio_frac_high"] == pytest.approx(1 / 4)   # ratio 3 (the masked e^7 does not count)
  assert m["mismatch/ratio_frac_low"] == pytest.approx(1 / 4)    # ratio e^-1 < 1/2


def test_rollout_correction_config_names_its_field():
  from dapo_jax import objectives
  with pytest.raises(ValueError, match="dapo.rollout_correction: rollout_rs='seq_k9'"):
    objectives.RolloutCorrection(rollout_rs="seq_k9", rollout_rs_threshold="1")
  with pytest.raises(ValueError, match="dapo.rollout_correction.loss_type='ppo'"):
    objectives.RolloutCorrection(loss_type="ppo")
  with pytest.raises(ValueError, match="dapo.dro_beta=0.0"):
    objectives.PGConfig(policy_loss="dro")


@pytest.mark.parametrize("rc", [dict(rollout_is="token", rollout_is_threshold="1.5", rollout_rs="token_k1",
                                     rollout_rs_threshold="1.5"),
                                dict(rollout_is="sequence", rollout_is_threshold="0.2_5", bypass_mode=True,
                                     loss_type="reinforce")])
def test_objective_applies_the_rollout_correction(rc):
  """The objective's loss is policy_loss on the corrected mask with the correction's weights
  (bypass: against the sampler's log-probs, REINFORCE), and it logs the mismatch."""
  from dapo_jax import objectives, testing
  from dapo_jax.datatypes import RLBatch
  from dapo_jax.model import transformer as model
  cfg = testing.tiny_model_config(vocab_size=64)
  params = model.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  B, P, Cn = 4, 5, 6
  tokens = rng.integers(4, 64, size=(B, P + Cn)).astype(np.int32)
  cmask = np.arange(Cn)[None] < np.array([6, 3, 1, 5])[:, None]
  batch = RLBatch(tokens_BT=tokens, mask_BT=np.concatenate([np.ones((B, P), bool), cmask], 1), loss_mask_BC=cmask,
                  old_logp_BC=rng.normal(-4.2, 0.3, size=(B, Cn)).astype(np.float32),
                  adv_B=np.array([1.0, -0.5, 0.7, -1.2], np.float32), ref_logp_BC=np.zeros((B, Cn), np.float32),
                  rollout_logp_BC=rng.normal(-4.2, 0.6, size=(B, Cn)).astype(np.float32))
  pg = objectives.PGConfig(rollout_correction=objectives.RolloutCorrection(**rc))
  obj = objectives.policy_gradient(cfg, pg)
  value, metrics = obj.loss(params, batch, obj.counts(batch))
  logp = objectives.completion_logprobs(cfg, 1.0)(params, batch)
  bypass = rc.get("bypass_mode", False)
  train = logp if bypass else batch.old_logp_BC
  w, keep, _ = loss.rollout_correction(train, batch.rollout_logp_BC, cmask, **pg.rollout_correction.options())
  assert 0 < int(keep.sum()) < int(cmask.sum()) or bypass
  want, _ = loss.policy_loss(logp, batch.rollout_logp_BC if bypass else batch.old_logp_BC, batch.adv_B, keep,
                             eps_low=0.2, eps_high=0.28, clip_ratio_c=10.0, is_weights_BC=w,
                             num_tokens=cmask.sum(), num_seqs=4.0, mode="reinforce" if bypass else "vanilla")
  assert float(value) == pytest.approx(float(want), rel=1e-5)
  assert "mismatch/k3" in metrics and "rollout_corr/rollout_is_mean" in metrics
