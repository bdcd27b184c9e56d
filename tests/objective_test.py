"""The policy objective's optional paths against NumPy: the KL penalty to a reference policy
(k1, k3 and their gradients, through the train step) and π_old = π_θ (`old_is_current`)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dapo_jax import loss, objectives, optim, sharding, testing, train_step
from dapo_jax.datatypes import RLBatch
from dapo_jax.model import transformer as model

CFG = testing.tiny_model_config(vocab_size=64)
OPT = optim.OptimConfig(lr=1e-3, warmup_steps=0, weight_decay=0.0, grad_clip=0.0)


def make_batch(B=4, Pl=5, C=6, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(4, CFG.vocab_size, size=(B, Pl + C)).astype(np.int32)
  lengths = np.array([C, 3, 1, 5])[:B]
  cmask = np.arange(C)[None] < lengths[:, None]
  return RLBatch(tokens_BT=tokens, mask_BT=np.concatenate([np.ones((B, Pl), bool), cmask], 1),
                 loss_mask_BC=cmask, old_logp_BC=rng.normal(-4.2, 0.3, size=(B, C)).astype(np.float32),
                 adv_B=np.array([1.0, -0.5, 0.7, -1.2], np.float32)[:B],
                 ref_logp_BC=rng.normal(-4.1, 0.4, size=(B, C)).astype(np.float32))


def mesh1():
  return sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])


def kl_np(logp, ref, estimator):
  """Per-token estimate of KL(π_θ || π_ref) and its derivative in logp (Schulman's k1, k3)."""
  d = ref - logp
  if estimator == "k1":
    return -d, np.ones_like(d)
  return np.exp(d) - d - 1, 1 - np.exp(d)


def surrogate_np(logp, old, adv, eps_low=0.2, eps_high=0.28, c=10.0):
  ratio = np.exp(logp - old)
  a = adv[:, None]
  unclipped, clipped = -a * ratio, -a * np.clip(ratio, 1 - eps_low, 1 + eps_high)
  loss_ = np.maximum(unclipped, clipped)
  dual = (a < 0) & (loss_ > -a * c)
  loss_ = np.where(dual, -a * c, loss_)
  # d/dlogp: -A·r where the unclipped branch is active, 0 where a clip is.
  grad = np.where(~dual & (unclipped >= clipped), -a * ratio, 0.0)
  return loss_, grad


def clipped_objective_terms(params, b, P):
  """By hand: the completion logits, their log-probs and the per-token decoupled-clip surrogate (eps
  0.2 / 0.28, dual clip 10) of batch `b` whose prompts are P long."""
  logits = model.logits(CFG, params, b.tokens_BT[:, :-1], b.mask_BT[:, :-1])[:, P - 1:]
  logp = loss.token_logprobs(logits, b.tokens_BT[:, P:])
  ratio = jnp.exp(logp - b.old_logp_BC)
  a = b.adv_B[:, None]
  pg_tok = jnp.maximum(-a * ratio, -a * jnp.clip(ratio, 0.8, 1.28))
  return logits, logp, jnp.where(a < 0, jnp.minimum(pg_tok, -a * 10.0), pg_tok)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_penalty_loss_and_gradient_against_numpy(estimator):
  b = make_batch()
  rng = np.random.default_rng(1)
  logp = rng.normal(-4.0, 0.3, size=b.old_logp_BC.shape)
  coef = 0.05
  f = lambda lp: loss.policy_loss(lp, b.old_logp_BC, b.adv_B, b.loss_mask_BC, eps_low=0.2, eps_high=0.28,
                                  clip_ratio_c=10.0, ref_logp_BC=b.ref_logp_BC, kl_coef=coef,
                                  kl_estimator=estimator)
  (value, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp, jnp.float32))
  m = b.loss_mask_BC
  n = m.sum()
  kl, dkl = kl_np(logp, b.ref_logp_BC.astype(np.float64), estimator)
  pg, dpg = surrogate_np(logp, b.old_logp_BC.astype(np.float64), b.adv_B.astype(np.float64))
  np.testing.assert_allclose(metrics["kl_loss"], (kl * m).sum() / n, rtol=1e-5)
  np.testing.assert_allclose(value, (pg * m).sum() / n + coef * (kl * m).sum() / n, rtol=1e-5)
  np.testing.assert_allclose(grad, (dpg + coef * dkl) * m / n, rtol=1e-4, atol=1e-7)
  if estimator == "k3":
    assert (kl >= 0).all() and metrics["kl_loss"] > 0  # k3 is non-negative per token.


def test_kl_off_ignores_the_reference():
  b = make_batch()
  logp = jnp.asarray(np.random.default_rng(1).normal(-4.0, 0.3, size=b.old_logp_BC.shape), jnp.float32)
  args = (logp, b.old_logp_BC, b.adv_B, b.loss_mask_BC)
  kw = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=10.0)
  a, ma = loss.policy_loss(*args, ref_logp_BC=b.ref_logp_BC, kl_coef=0.0, **kw)
  c, _ = loss.policy_loss(*args, ref_logp_BC=b.ref_logp_BC + 3.0, kl_coef=0.0, **kw)
  assert float(a) == float(c) and "kl_loss" not in ma


def test_train_step_with_kl_matches_the_reference_gradient():
  """Through the jitted step (2 micro-batches, global token mean): loss, kl_loss and grad norm equal
  a hand-written objective over the model's log-probs."""
  b = make_batch()
  pg = objectives.PGConfig(kl_coef=0.1, kl_estimator="k3")
  trainer = train_step.Trainer(CFG, OPT, mesh1(), objectives.policy_gradient(CFG, pg), num_microbatches=2)
  params = jax.device_get(trainer.init(jax.random.key(0)).params)
  _, m = trainer.step(trainer.init(params=params), trainer.put_batch(b))
  P = b.tokens_BT.shape[1] - b.loss_mask_BC.shape[1]
  mask = jnp.asarray(b.loss_mask_BC, jnp.float32)

  def objective(p):
    _, logp, pg_tok = clipped_objective_terms(p, b, P)
    d = b.ref_logp_BC - logp
    kl_tok = jnp.exp(d) - d - 1
    kl = jnp.sum(kl_tok * mask) / mask.sum()
    return jnp.sum(pg_tok * mask) / mask.sum() + 0.1 * kl, kl

  (ref_loss, ref_kl), grads = jax.value_and_grad(objective, has_aux=True)(params)
  np.testing.assert_allclose(m["loss"], ref_loss, rtol=1e-5)
  np.testing.assert_allclose(m["kl_loss"], ref_kl, rtol=1e-5)
  np.testing.assert_allclose(m["grad_norm"], optax.global_norm(grads), rtol=1e-4)


def test_old_is_current_equals_old_logp_from_the_current_policy():
  """π_old = π_θ (one update per rollout step) is the step with old_logp set to the current policy's
  log-probs: ratio 1, the same loss, gradient and update."""
  b = make_batch()
  cur = train_step.Trainer(CFG, OPT, mesh1(), objectives.policy_gradient(CFG, objectives.PGConfig(old_is_current=True)))
  plain = train_step.Trainer(CFG, OPT, mesh1(), objectives.policy_gradient(CFG, objectives.PGConfig()))
  params = jax.device_get(cur.init(jax.random.key(0)).params)
  rollout1 = lambda t: t.init(params=params).replace(
      rollout_step=jax.device_put(jnp.int32(1), t.state_sharding.rollout_step))  # lr > 0
  garbage = b.replace(old_logp_BC=np.full_like(b.old_logp_BC, -30.0))  # Ignored when old is current.
  s_cur, m_cur = jax.device_get(cur.step(rollout1(cur), cur.put_batch(garbage)))
  current = np.asarray(plain.forward(objectives.completion_logprobs(CFG, 1.0))(params, plain.put_batch(b)))
  s_ref, m_ref = jax.device_get(plain.step(rollout1(plain), plain.put_batch(b.replace(old_logp_BC=current))))
  for k in ("loss", "pg_loss", "grad_norm", "entropy"):
    np.testing.assert_allclose(m_cur[k], m_ref[k], rtol=1e-5, atol=1e-7, err_msg=k)
  assert m_cur["ppo_kl"] == 0.0 and m_cur["pg_clipfrac"] == 0.0
  # The loss is -mean(A) over tokens (ratio 1), by hand.
  w = b.loss_mask_BC.sum(1)
  np.testing.assert_allclose(m_cur["pg_loss"], -(b.adv_B * w).sum() / w.sum(), rtol=1e-5)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), s_cur.params, s_ref.params)
  assert np.abs(s_cur.params["layers"]["wq_DNH"] - params["layers"]["wq_DNH"]).max() > 1e-4


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_train_step_with_an_entropy_bonus_matches_the_reference_gradient(agg):
  """`entropy_coeff` (verl's): the loss is the policy loss minus the coefficient times the entropy of each
  token's distribution, aggregated as the loss is; through the jitted step (2 micro-batches), the loss,
  the entropy term and the gradient norm equal a hand-written objective over the model's logits."""
  b = make_batch()
  pg = objectives.PGConfig(entropy_coeff=0.05, loss_agg=agg)
  trainer = train_step.Trainer(CFG, OPT, mesh1(), objectives.policy_gradient(CFG, pg), num_microbatches=2)
  params = jax.device_get(trainer.init(jax.random.key(0)).params)
  _, m = trainer.step(trainer.init(params=params), trainer.put_batch(b))
  P = b.tokens_BT.shape[1] - b.loss_mask_BC.shape[1]
  mask = jnp.asarray(b.loss_mask_BC, jnp.float32)
  per_row = lambda x: jnp.sum(x * mask, 1) / jnp.maximum(mask.sum(1), 1)
  reduce = (lambda x: jnp.sum(x * mask) / mask.sum()) if agg == "token_mean" else (lambda x: per_row(x).mean())

  def objective(p):
    logits, logp, pg_tok = clipped_objective_terms(p, b, P)
    probs = jax.nn.softmax(logits, -1)
    entropy = -jnp.sum(probs * jax.nn.log_softmax(logits, -1), -1)
    return reduce(pg_tok) - 0.05 * reduce(entropy), reduce(entropy)

  (ref_loss, ref_entropy), grads = jax.value_and_grad(objective, has_aux=True)(params)
  np.testing.assert_allclose(m["loss"], ref_loss, rtol=1e-5)
  np.testing.assert_allclose(m["entropy_loss"], ref_entropy, rtol=1e-5)
  np.testing.assert_allclose(m["grad_norm"], optax.global_norm(grads), rtol=1e-4)
