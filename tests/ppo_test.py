"""PPO in the loop: per-token advantages through the policy objective (against NumPy), the token
estimators' rewards and returns against a naive loop, the start-up checks of the `ppo` / `critic`
sections, and the loop with a value model: it learns, and its checkpoint resumes the same run."""
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import ppo_arith
from dapo_jax import (
  advantages,
  builders,
  checkpoint,
  loss,
  metrics,
  objectives,
  optim,
  sharding,
  testing,
  train_step,
)
from dapo_jax.datatypes import RLBatch
from dapo_jax.model import transformer as model

CFG = testing.tiny_model_config(vocab_size=64)
OPT = optim.OptimConfig(lr=1e-3, warmup_steps=0, weight_decay=0.0, grad_clip=0.0)
ADV_BC = np.array([[1.0, -0.5, 2.0, 0.3, -1.0, 0.8],
                   [-0.7, 0.2, 1.5, 9.0, 9.0, 9.0],      # tokens past a row's end: masked, any value
                   [0.4, 9.0, 9.0, 9.0, 9.0, 9.0],
                   [-1.3, 1.1, -0.2, 0.6, -2.0, 9.0]], np.float32)


def make_batch(B=4, Pl=5, C=6, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(4, CFG.vocab_size, size=(B, Pl + C)).astype(np.int32)
  cmask = np.arange(C)[None] < np.array([C, 3, 1, 5])[:, None]
  return RLBatch(tokens_BT=tokens, mask_BT=np.concatenate([np.ones((B, Pl), bool), cmask], 1),
                 loss_mask_BC=cmask, old_logp_BC=rng.normal(-4.2, 0.3, size=(B, C)).astype(np.float32),
                 adv_B=np.array([1.0, -0.5, 0.7, -1.2], np.float32), ref_logp_BC=np.zeros((B, C), np.float32))


def mesh1():
  return sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])


def surrogate_np(logp, old, a, eps_low=0.2, eps_high=0.28, c=10.0):
  """One token's clipped surrogate (Eq. 10 with the dual clip) and its derivative in logp, float64."""
  ratio = np.exp(logp - old)
  unclipped, clipped = -a * ratio, -a * np.clip(ratio, 1 - eps_low, 1 + eps_high)
  loss_ = max(unclipped, clipped)
  if a < 0 and loss_ > -a * c:
    return -a * c, 0.0
  return loss_, (-a * ratio if unclipped >= clipped else 0.0)


def test_policy_loss_with_token_advantages_matches_numpy():
  rng = np.random.default_rng(1)
  b = make_batch()
  logp = rng.normal(-4.0, 0.4, size=b.old_logp_BC.shape).astype(np.float32)  # ratios on both sides of the clip
  value, grad = jax.value_and_grad(lambda lp: loss.policy_loss(
      lp, b.old_logp_BC, b.adv_B, b.loss_mask_BC, eps_low=0.2, eps_high=0.28, clip_ratio_c=10.0,
      adv_BC=ADV_BC)[0])(jnp.asarray(logp))
  # A NumPy loop over tokens: each token's own advantage, the clip and the dual clip per token.
  m = b.loss_mask_BC.astype(np.float64)
  want_loss, want_grad = 0.0, np.zeros_like(m)
  for i in range(m.shape[0]):
    for t in range(m.shape[1]):
      if m[i, t]:
        lt, want_grad[i, t] = surrogate_np(float(logp[i, t]), float(b.old_logp_BC[i, t]), float(ADV_BC[i, t]))
        want_loss += lt
  np.testing.assert_allclose(value, want_loss / m.sum(), rtol=1e-5)
  np.testing.assert_allclose(grad, want_grad / m.sum(), rtol=1e-5, atol=1e-7)


def test_one_update_with_token_advantages_equals_numpy_adam_step():
  """Through the jitted step (2 micro-batches, global token mean): the loss equals a hand-written
  per-token objective, and the first AdamW update equals the NumPy one, p - lr·g/(|g| + eps)."""
  b = make_batch().replace(adv_BC=ADV_BC)
  trainer = train_step.Trainer(CFG, OPT, mesh1(), objectives.policy_gradient(CFG, objectives.PGConfig()),
                               num_microbatches=2)
  params = jax.device_get(trainer.init(jax.random.key(0)).params)
  state = trainer.init(params=params).replace(
      rollout_step=jax.device_put(jnp.int32(1), trainer.state_sharding.rollout_step))  # lr > 0
  new_state, m = jax.device_get(trainer.step(state, trainer.put_batch(b)))
  P = b.tokens_BT.shape[1] - b.loss_mask_BC.shape[1]
  mask = jnp.asarray(b.loss_mask_BC, jnp.float32)

  def objective(p):
    logits = model.logits(CFG, p, b.tokens_BT[:, :-1], b.mask_BT[:, :-1])[:, P - 1:]
    ratio = jnp.exp(loss.token_logprobs(logits, b.tokens_BT[:, P:]) - b.old_logp_BC)
    a = jnp.asarray(ADV_BC)
    tok = jnp.maximum(-a * ratio, -a * jnp.clip(ratio, 0.8, 1.28))
    tok = jnp.where(a < 0, jnp.minimum(tok, -a * 10.0), tok)
    return jnp.sum(tok * mask) / mask.sum()

  ref_loss, grads = jax.value_and_grad(objective)(params)
  np.testing.assert_allclose(m["pg_loss"], ref_loss, rtol=1e-5)
  g, p0, p1 = (np.asarray(x, np.float64) for x in (grads["layers"]["wq_DNH"], params["layers"]["wq_DNH"],
                                                   new_state.params["layers"]["wq_DNH"]))
  want = p0 - 1e-3 * g / (np.abs(g) + 1e-8)  # Adam's first step: m̂ = g, v̂ = g².
  big = np.abs(g) > 1e-5  # Where |g| is near eps the step's fp32 rounding dominates.
  np.testing.assert_allclose(p1[big], want[big], rtol=0, atol=2e-6)
  assert big.mean() > 0.5


def test_advantages_broadcast_per_token_are_the_grpo_update():
  """adv_BC = adv_B on every token is bitwise the GRPO step (adv_BC=None): same metrics, same params."""
  b = make_batch()
  trainer = train_step.Trainer(CFG, OPT, mesh1(), objectives.policy_gradient(CFG, objectives.PGConfig()),
                               num_microbatches=2)
  params = jax.device_get(trainer.init(jax.random.key(0)).params)
  start = lambda: trainer.init(params=params).replace(
      rollout_step=jax.device_put(jnp.int32(1), trainer.state_sharding.rollout_step))
  s0, m0 = jax.device_get(trainer.step(start(), trainer.put_batch(b)))
  wide = b.replace(adv_BC=np.repeat(b.adv_B[:, None], b.loss_mask_BC.shape[1], 1))
  s1, m1 = jax.device_get(trainer.step(start(), trainer.put_batch(wide)))
  for k in m0:
    assert m0[k] == m1[k], k
  jax.tree.map(np.testing.assert_array_equal, s0.params, s1.params)


def test_token_advantages_match_a_naive_loop():
  """KL-shaped rewards then GAE (and REINFORCE++), against a loop over tokens by hand."""
  score = np.array([1.0, -0.5], np.float32)
  logp = np.array([[-1.0, -2.0, -0.5, -3.0], [-0.2, -1.5, -9.0, -9.0]], np.float32)
  ref = np.array([[-1.2, -1.5, -0.5, -2.0], [-0.4, -1.0, -9.0, -9.0]], np.float32)
  values = np.array([[0.3, 0.1, -0.2, 0.5], [0.0, 0.4, 7.0, 7.0]], np.float32)
  mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], bool)
  beta, gamma, lam = 0.1, 0.9, 0.8
  r_want = np.zeros((2, 4))
  ret_want, adv_raw, pp_ret = np.zeros((2, 4)), np.zeros((2, 4)), np.zeros((2, 4))
  for i, n in enumerate(mask.sum(1)):
    for t in range(n):
      r_want[i, t] = -beta * (logp[i, t] - ref[i, t]) + (score[i] if t == n - 1 else 0.0)
    a, g = 0.0, 0.0
    for t in reversed(range(n)):
      v_next = values[i, t + 1] if t + 1 < n else 0.0
      a = r_want[i, t] + gamma * v_next - values[i, t] + gamma * lam * a
      adv_raw[i, t], ret_want[i, t] = a, a + values[i, t]
      g = r_want[i, t] + gamma * g
      pp_ret[i, t] = g

  def whiten(x):
    v = x[mask]
    return np.where(mask, (x - v.mean()) / np.sqrt(v.var(ddof=1) + 1e-8), 0.0)

  r, adv, ret = jax.device_get(advantages.token_advantages("gae", score, logp, ref, mask, values, beta=np.float32(beta),
                                                            gamma=gamma, lam=lam))
  np.testing.assert_allclose(r, r_want, atol=1e-6)
  np.testing.assert_allclose(ret * mask, ret_want, atol=1e-5)
  np.testing.assert_allclose(adv, whiten(adv_raw), atol=1e-5)
  _, adv, ret = jax.device_get(advantages.token_advantages("reinforce_pp", score, logp, ref, mask,
                                                            beta=np.float32(beta), gamma=gamma))
  np.testing.assert_allclose(ret * mask, pp_ret, atol=1e-5)
  np.testing.assert_allclose(adv, whiten(pp_ret), atol=1e-5)
  # The KL the controller reads: per-row token means of log π - log π_ref, then their mean.
  kl = advantages.sequence_kl(logp, ref, mask)
  assert kl == pytest.approx(np.mean([np.mean((logp - ref)[0]), np.mean((logp - ref)[1, :2])]))
  # As verl's `apply_kl_penalty`: a row without tokens counts 0 (its masked_mean), and rows after the batch's
  # own (repeats filling a short step) do not count.
  empty, repeat = np.zeros((1, 4), bool), mask[:1]
  kl3 = advantages.sequence_kl(np.concatenate([logp, logp[:1]]), np.concatenate([ref, ref[:1] - 5.0]),
                               np.concatenate([mask, empty]), num_rows=3)
  assert kl3 == pytest.approx(2 * kl / 3)
  kl_rep = advantages.sequence_kl(np.concatenate([logp, logp[:1]]), np.concatenate([ref, ref[:1] - 5.0]),
                                  np.concatenate([mask, repeat]), num_rows=2)
  assert kl_rep == pytest.approx(kl)


def ppo_cfg(**train):
  cfg = ppo_arith.get_config("runlocal")
  cfg.reward.fn = "dapo_jax.testing:length_reward"   # mixed rewards for the random tiny policy
  cfg.ppo.update(kl_ctrl="adaptive", kl_coef=0.05, target_kl=0.01, horizon=10)
  cfg.critic.update(lr=1e-2, warmup_steps=0)
  cfg.optim.update(lr=1e-2, warmup_steps=0)
  cfg.train.update(eval_every=0, log_samples_every=0, **train)
  cfg.data.num_eval = 0  # No held-out evaluation (its sampler would compile too).
  return cfg


@pytest.mark.parametrize("field,value,message", [
    ("dapo.adv_estimator", "ppo",
     r"dapo.adv_estimator='ppo': expected one of " + re.escape(str(advantages.ESTIMATORS))),
    ("critic.init", "value", r"critic.init='value': expected 'policy'"),
    ("critic.lr", 0.0, r"critic.lr=0.0: expected > 0"),
    ("critic.clip_range", -1.0, r"critic.clip_range=-1.0"),
    ("ppo.lam", 1.5, r"ppo.lam=1.5: expected >= 0 and <= 1"),
    ("ppo.kl_ctrl", "pid", r"ppo.kl_ctrl='pid': expected 'fixed' or 'adaptive'"),
    ("ppo.target_kl", 0.0, r"ppo.target_kl=0.0"),
    ("eval.reward_fn", "math", r"eval.reward_fn='math'"),
])
def test_ppo_settings_are_checked_at_start(field, value, message):
  cfg = ppo_cfg()
  group, name = field.split(".")
  cfg[group][name] = value
  with pytest.raises(builders.ConfigError, match=message):
    builders.validate(cfg)


def test_critic_from_a_reward_model_needs_its_directory():
  cfg = ppo_cfg()
  cfg.critic.init = "rm"  # reward.fn is a rule, so there is no rm:DIR to default to
  with pytest.raises(builders.ConfigError, match=r"critic.model_dir='': expected a reward model's HF directory"):
    builders.validate(cfg)


@pytest.mark.slow  # Two runs of the loop with compiles: ~40 s on 2 free cores.
def test_ppo_loop_trains_the_value_model_and_resumes_it_exactly(tmp_path):
  """3 PPO steps; the same run killed after step 2 and resumed from its checkpoint gives step 3's
  metrics and the final policy and value-model params exactly (the critic and β round-trip)."""
  ref_dir, dir_ = str(tmp_path / "ref"), str(tmp_path / "resumed")
  with builders.dapo(ppo_cfg(num_steps=3, ckpt_every=1), ref_dir) as run:
    critic0 = jax.device_get(run.critic.state.params)
    beta0 = run.kl_ctrl.value
    run.run()
    ref_state, ref_critic = jax.device_get((run.state.params, run.critic.state.params))
    ref_beta = run.kl_ctrl.value
  assert os.path.isdir(os.path.join(ref_dir, "checkpoints", "2", "critic"))
  assert np.abs(ref_critic["score_D"] - critic0["score_D"]).max() > 1e-3  # score_D starts at zero
  assert np.abs(ref_critic["layers"]["wq_DNH"] - critic0["layers"]["wq_DNH"]).max() > 1e-4
  assert ref_beta != beta0  # The adaptive controller moved β.
  ref = metrics.read_jsonl(os.path.join(ref_dir, "metrics.jsonl"))
  for k in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vf_explained_var", "critic/values/mean",
            "critic/returns/mean", "critic/advantages/mean", "critic/rewards/mean", "critic/score/mean",
            "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff", "actor/pg_loss", "critic/lr"):
    assert np.isfinite(ref[3][k]), k
  assert ref[1]["actor/reward_kl_penalty_coeff"] == 0.05 and ref[3]["critic/lr"] == pytest.approx(1e-2)
  # Kill after step 2: the workdir as it was then (checkpoints 1, 2 and the metrics of steps 0-2).
  shutil.copytree(ref_dir, dir_)
  shutil.rmtree(os.path.join(dir_, "checkpoints", "3"))
  lines = open(os.path.join(dir_, "metrics.jsonl")).readlines()
  open(os.path.join(dir_, "metrics.jsonl"), "w").writelines(lines[:-1])
  with builders.dapo(ppo_cfg(num_steps=3, ckpt_every=1), dir_) as run:
    run.run()
    got_state, got_critic = jax.device_get((run.state.params, run.critic.state.params))
    assert run.kl_ctrl.value == ref_beta
  got = metrics.read_jsonl(os.path.join(dir_, "metrics.jsonl"))
  for k, v in ref[3].items():
    if not k.startswith(("timing_s/", "perf/")):
      assert got[3][k] == v, k
  jax.tree.map(np.testing.assert_array_equal, got_state, ref_state)
  jax.tree.map(np.testing.assert_array_equal, got_critic, ref_critic)


def test_a_checkpoint_without_a_value_model_is_named(tmp_path):
  """A PPO run cannot resume a workdir whose checkpoints hold no critic (e.g. a GRPO run's)."""
  ckpt = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), async_save=False)
  state = {"w": jnp.ones(3)}
  ckpt.save(1, state, {"x": 1})
  abstract = jax.eval_shape(lambda: state)
  step, restored, extra = ckpt.restore_latest(abstract)
  assert step == 1 and extra == {"x": 1}
  with pytest.raises(checkpoint.CheckpointMismatchError, match=r"checkpoints/1 has no value model \(critic\)"):
    ckpt.restore_latest(abstract, abstract)
  ckpt.save(2, state, {"x": 2}, critic={"v": jnp.arange(2.0)})
  ckpt.wait()
  step, _, _, critic = ckpt.restore_latest(abstract, jax.eval_shape(lambda: {"v": jnp.arange(2.0)}))
  assert step == 2 and np.asarray(critic["v"]).tolist() == [0.0, 1.0]
  ckpt.close()


@pytest.mark.slow  # Two 2-step runs of the loop.
def test_a_packed_ppo_run_is_the_padded_run(tmp_path):
  """`train.packing=True`: the policy's, the reference's and the value model's passes before GAE, the
  value model's update and the policy's run on packed rows; every logged value of two steps (critic/*
  included), and both models' params, are the padded run's (1e-5)."""
  runs = {}
  for packing in (False, True):
    with builders.dapo(ppo_cfg(num_steps=2, packing=packing, num_microbatches=0), str(tmp_path / str(packing))) as run:
      run.run()
      runs[packing] = metrics.read_jsonl(os.path.join(tmp_path, str(packing), "metrics.jsonl")), \
          jax.device_get((run.state.params, run.critic.state.params))
  for step in (1, 2):
    padded, packed = runs[False][0][step], runs[True][0][step]
    assert "critic/vf_loss" in padded
    for k, v in padded.items():
      if not k.startswith(("timing_s/", "perf/", "time")):
        assert packed[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (step, k)
  # Packed rows share their group's prompt and sum in another order: AdamW's normalised steps carry
  # that rounding into a few params, by up to ~1e-5 after two updates of both models.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=3e-5), runs[True][1], runs[False][1])
