"""RLHF estimators and losses against hand-computed values and naive NumPy loops."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax import advantages, loss


def naive_gae(r, v, m, gamma, lam):
  """verl's compute_gae_advantage_return, written as its Python loop (float64, before whitening)."""
  B, C = r.shape
  adv = np.zeros((B, C))
  next_v, last = np.zeros(B), np.zeros(B)
  for t in reversed(range(C)):
    delta = r[:, t] + gamma * next_v - v[:, t]
    new = delta + gamma * lam * last
    next_v = v[:, t] * m[:, t] + (1 - m[:, t]) * next_v
    last = new * m[:, t] + (1 - m[:, t]) * last
    adv[:, t] = last
  return adv, adv + v


def whiten(x, m):
  mean = (x * m).sum() / m.sum()
  var = (((x - mean) ** 2) * m).sum() / (m.sum() - 1)
  return (x - mean) / np.sqrt(var + 1e-8)


def test_gae_hand_computed():
  # gamma 0.9, lam 0.8. Row 0: reward 1 at the end, V = 0.5 everywhere:
  #   A2 = 1 - 0.5 = 0.5; A1 = (0.45 - 0.5) + 0.72*0.5 = 0.31; A0 = -0.05 + 0.72*0.31 = 0.1732.
  # Row 1: one padding token (V there must not leak): A1 = 2 - 1 = 1; A0 = (0.9 - 1) + 0.72 = 0.62.
  r = np.array([[0., 0., 1.], [0., 2., 0.]])
  v = np.array([[.5, .5, .5], [1., 1., 9.]])
  m = np.array([[1., 1., 1.], [1., 1., 0.]])
  raw = np.array([[0.1732, 0.31, 0.5], [0.62, 1.0, 0.0]])
  adv, ret = advantages.gae(r, v, m, gamma=0.9, lam=0.8)
  np.testing.assert_allclose(ret[m > 0], (raw + v)[m > 0], atol=1e-6)
  np.testing.assert_allclose(ret[0], [0.6732, 0.81, 1.0], atol=1e-6)
  np.testing.assert_allclose(adv, whiten(raw, m) * m, atol=1e-5)
  a = np.asarray(adv)[m > 0]
  assert abs(a.mean()) < 1e-6 and abs(a.var(ddof=1) - 1) < 1e-4
  assert adv[1, 2] == 0


def test_gae_matches_naive_loop_with_gaps_and_jit():
  rng = np.random.default_rng(0)
  r, v = rng.normal(size=(4, 7)), rng.normal(size=(4, 7))
  m = (rng.random((4, 7)) > 0.3).astype(float)   # Gaps too: observation tokens inside a row.
  m[:, 0] = 1
  raw, ret_ref = naive_gae(r, v, m, 0.95, 0.9)
  adv, ret = jax.jit(advantages.gae, static_argnums=(3, 4))(r, v, m, 0.95, 0.9)
  np.testing.assert_allclose(ret, ret_ref, atol=1e-5)
  np.testing.assert_allclose(adv, whiten(raw, m) * m, atol=1e-4)


def test_masked_whiten_ignores_unmasked_values():
  x = np.array([[1., 2., 3., 100.]])
  m = np.array([[1., 1., 1., 0.]])
  out = np.asarray(advantages.masked_whiten(x, m))
  np.testing.assert_allclose(out[0, :3], [-1, 0, 1], atol=1e-6)   # mean 2, unbiased var 1
  np.testing.assert_allclose(advantages.masked_whiten(x, m, shift_mean=False)[0, :3], [1, 2, 3], atol=1e-6)


def test_rloo_is_leave_one_out_mean():
  rng = np.random.default_rng(1)
  r = rng.normal(size=(3, 5))
  ref = np.array([[r[q, i] - np.mean(np.delete(r[q], i)) for i in range(5)] for q in range(3)])
  np.testing.assert_allclose(advantages.rloo(r), ref, atol=1e-6)
  np.testing.assert_allclose(advantages.rloo([[1.0], [-2.0]]), [[1.0], [-2.0]])
  np.testing.assert_allclose(advantages.rloo([[1.0, 0.0]]), [[1.0, -1.0]])


def test_reinforce_pp_matches_naive_loop():
  rng = np.random.default_rng(2)
  r = rng.normal(size=(3, 6))
  m = np.array([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4], float)
  gamma = 0.9
  ret = np.zeros_like(r)
  m[0, 2:4] = 0.0  # A masked span inside a row (a tool's reply): the return passes through it (verl #7278).
  for b in range(3):
    running = 0.0
    for t in reversed(range(6)):
      if m[b, t]:
        running = r[b, t] + gamma * running
        ret[b, t] = running
  adv, returns = advantages.reinforce_pp(r, m, gamma)
  np.testing.assert_allclose(returns, ret, atol=1e-5)
  np.testing.assert_allclose(adv, whiten(ret, m) * m, atol=1e-5)


def test_kl_shaped_rewards():
  logp = np.array([[-1., -2., -3.], [-1., -1., -5.]])
  ref = np.array([[-1.5, -2., -2.], [-2., -1., -1.]])
  m = np.array([[1, 1, 1], [1, 1, 0]], float)
  out = np.asarray(advantages.kl_shaped_rewards(np.array([2.0, -1.0]), logp, ref, m, beta=0.1))
  # Row 0: -0.1*(0.5, 0, -1) and the score 2 on the last token. Row 1: last real token is t=1.
  np.testing.assert_allclose(out, [[-0.05, 0.0, 0.1 + 2.0], [-0.1, -1.0, 0.0]], atol=1e-6)
  # A row without tokens gets nothing.
  np.testing.assert_allclose(advantages.kl_shaped_rewards(np.array([3.0]), logp[:1], ref[:1], 0 * m[:1], 0.1), 0)


def test_kl_controllers_hand_computed():
  c = advantages.AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10_000)
  c.update(current_kl=9.0, n_steps=256)          # error clip(0.5) = 0.2 -> 0.2 * (1 + 0.2*256/1e4)
  assert c.value == pytest.approx(0.2 * 1.00512)
  c.update(current_kl=5.4, n_steps=1000)         # error -0.1 -> *(1 - 0.01)
  assert c.value == pytest.approx(0.2 * 1.00512 * 0.99)
  c.update(current_kl=0.0, n_steps=100)          # error clipped to -0.2 -> *(1 - 0.002)
  assert c.value == pytest.approx(0.2 * 1.00512 * 0.99 * 0.998)
  f = advantages.FixedKLController(0.05)
  f.update(100.0, 10)
  assert f.value == 0.05
  with pytest.raises(ValueError, match="target"):
    advantages.AdaptiveKLController(0.1, target=0, horizon=10)


def test_value_loss_and_clipping_against_numpy():
  v = np.array([[1.0, 0.0, 2.0, 5.0], [0.3, -1.0, 0.0, 0.0]], np.float32)
  old = np.array([[0.5, 0.0, 1.0, 0.0], [0.0, -0.5, 0.0, 0.0]], np.float32)
  ret = np.array([[2.0, 1.0, 0.0, 9.0], [0.0, 0.0, 0.0, 0.0]], np.float32)
  m = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)
  c = 0.2
  vc = np.clip(v, old - c, old + c)
  l1, l2 = (v - ret) ** 2, (vc - ret) ** 2
  ref = 0.5 * (np.maximum(l1, l2) * m).sum() / m.sum()
  out, metrics = loss.value_loss(v, old, ret, m, clip_range=c)
  np.testing.assert_allclose(out, ref, rtol=1e-6)
  # Token (0,0): V 1 > old+c = 0.7 with return 2: the clipped error (1.69) is larger -> counted.
  # Token (0,2): V 2, clipped 1.2, return 0: the unclipped error (4) is larger -> not counted; so are the rest.
  np.testing.assert_allclose(metrics["vf_clipfrac"], ((l2 > l1) * m).sum() / m.sum(), rtol=1e-6)
  assert float(metrics["vf_clipfrac"]) == pytest.approx(1 / 5)
  # Gradient flows only through max(): where the clipped term wins and V is outside the band, none.
  g = np.asarray(jax.grad(lambda x: loss.value_loss(x, old, ret, m, clip_range=c)[0])(v))
  assert g[0, 0] == 0 and g[0, 3] == 0 and g[0, 2] != 0 and g[1, 1] != 0


def test_dpo_loss_against_formula():
  pc, pr = np.array([-5.0, -7.0, -3.0]), np.array([-6.0, -6.5, -3.0])
  rc, rr = np.array([-5.5, -7.0, -4.0]), np.array([-5.5, -6.0, -4.0])
  beta = 0.1
  h = (pc - pr) - (rc - rr)
  logsig = lambda x: -np.log1p(np.exp(-x))
  out, m = loss.dpo_loss(pc, pr, rc, rr, beta)
  np.testing.assert_allclose(out, np.mean(-logsig(beta * h)), rtol=1e-6)
  out_ls, _ = loss.dpo_loss(pc, pr, rc, rr, beta, label_smoothing=0.2)
  np.testing.assert_allclose(out_ls, np.mean(-0.8 * logsig(beta * h) - 0.2 * logsig(-beta * h)), rtol=1e-6)
  out_ipo, _ = loss.dpo_loss(pc, pr, rc, rr, beta, loss_type="ipo")
  np.testing.assert_allclose(out_ipo, np.mean((h - 1 / (2 * beta)) ** 2), rtol=1e-6)
  cr, rj = beta * (pc - rc), beta * (pr - rr)
  np.testing.assert_allclose(m["rewards/chosen"], cr.mean(), rtol=1e-6)
  np.testing.assert_allclose(m["rewards/rejected"], rj.mean(), rtol=1e-6)
  np.testing.assert_allclose(m["rewards/margins"], (cr - rj).mean(), rtol=1e-6)
  np.testing.assert_allclose(m["rewards/accuracies"], 2 / 3, rtol=1e-6)
  # No gradient reaches the reference log-probs; d loss / d chosen = -β σ(-βh) / B.
  g = jax.grad(lambda a, b: loss.dpo_loss(a, pr, b, rr, beta)[0], argnums=(0, 1))(jnp.asarray(pc), jnp.asarray(rc))
  np.testing.assert_allclose(g[0], -beta / (1 + np.exp(beta * h)) / 3, rtol=1e-5)
  assert not np.any(np.asarray(g[1]))
  with pytest.raises(ValueError, match="loss_type"):
    loss.dpo_loss(pc, pr, rc, rr, beta, loss_type="hinge")


def test_pairwise_rm_loss():
  c, r = np.array([1.0, 0.0, 2.0, -1.0]), np.array([0.0, 0.5, 2.0, -3.0])
  out, m = loss.pairwise_rm_loss(c, r)
  np.testing.assert_allclose(out, np.mean(np.log1p(np.exp(-(c - r)))), rtol=1e-6)
  np.testing.assert_allclose(m["accuracy"], 0.5)           # ties are not correct
  np.testing.assert_allclose(m["margin"], np.mean(c - r), rtol=1e-6)
  margin = np.array([1.0, 0.0, 0.5, 0.0])
  out_m, m2 = loss.pairwise_rm_loss(c, r, margin)
  np.testing.assert_allclose(out_m, np.mean(np.log1p(np.exp(-(c - r - margin)))), rtol=1e-6)
  np.testing.assert_allclose(m2["margin"], np.mean(c - r), rtol=1e-6)   # the logged margin is the raw one
  np.testing.assert_allclose(loss.pairwise_rm_loss(np.zeros(2), np.zeros(2))[0], np.log(2), rtol=1e-6)
