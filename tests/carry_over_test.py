"""Carried-over groups are trained against the policy that sampled them: through `DAPO.update`, a
group sampled with params A and trained with params B has the ratio exp(log π_B - log π_A), with
log π_A the sampler's; fresh groups keep π_old = π_B exactly as without carry-over."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax import advantages, loop, metrics, objectives, optim, sharding, testing, train_step
from dapo_jax.datatypes import Groups
from dapo_jax.model import transformer as model
from dapo_jax.rollout import dynamic_sampling, sampling

CFG = testing.tiny_model_config(vocab_size=64)
T = 0.7            # rollout temperature: the sampler and the train step both scale the logits by 1/T
G, P, C = 2, 5, 6
EOS = (5, 6, 7, 8)
PG = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=10.0)


def mesh1():
  return sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])


def sample_groups(params, seed: int, Q: int = 2) -> tuple[Groups, np.ndarray]:
  """Q groups sampled by `params` (scores mixed within each group); also the sampler's log-probs."""
  rng = np.random.default_rng(seed)
  prompt_QP = rng.integers(10, CFG.vocab_size, size=(Q, P)).astype(np.int32)
  mask_QP = np.ones((Q, P), bool)
  s = jax.device_get(sampling.generate(CFG, sampling.SamplerConfig(max_new_tokens=C, temperature=T, eos_ids=EOS),
                                       params, prompt_QP, mask_QP, jax.random.key(seed), num_samples=G))
  acc_QG = np.tile([True, False], (Q, 1))
  groups = Groups(prompt_QP=prompt_QP, prompt_mask_QP=mask_QP, tokens_QGC=s.tokens_BC.reshape(Q, G, C),
                  mask_QGC=s.mask_BC.reshape(Q, G, C), length_QG=s.length_B.reshape(Q, G),
                  truncated_QG=s.truncated_B.reshape(Q, G), score_QG=np.where(acc_QG, 1.0, -1.0), acc_QG=acc_QG,
                  filter_QG=acc_QG.astype(np.float64), logp_QGC=s.logp_BC.reshape(Q, G, C),
                  carried_Q=np.zeros(Q, bool))
  return groups, s.logp_BC


def make_trainer(minibatches: int) -> train_step.Trainer:
  """The trainer `builders.dapo` builds: with one update per rollout step π_old = π_θ."""
  pg = objectives.PGConfig(**PG, temperature=T, old_is_current=minibatches == 1, group_size=G)
  return train_step.Trainer(CFG, optim.OptimConfig(lr=1e-3, warmup_steps=1), mesh1(),
                            objectives.policy_gradient(CFG, pg))


def update(trainer, params, batch, workdir, minibatches: int) -> dict:
  """`DAPO.update` (no rollout, data or evaluator: the update does not use them)."""
  cfg = loop.LoopConfig(num_steps=1, prompts_per_step=2, group_size=G, gen_prompts=2, dynamic_sampling=True,
                        max_gen_batches=1, on_cap="raise", carry_over=True, norm_adv_by_std=True,
                        overlong_filter=False, minibatches=minibatches, ppo_epochs=1, reference=False,
                        length_buckets=(), shared_prefix=0, seed=0, ckpt_every=0, eval_every=0, log_samples_every=0)
  logprobs = trainer.forward(objectives.completion_logprobs(CFG, T, G))
  dapo = loop.DAPO(cfg, trainer=trainer, logprobs=logprobs, rollout=None, evaluator=None, data_iter=None,
                   params=params, workdir=str(workdir), writer_cfg=metrics.WriterConfig(writers=()))
  try:
    assert int(dapo.state.rollout_step) == 0  # lr 0: every mini-batch is scored at the same params.
    return dapo.update(batch)[0]
  finally:
    dapo.writer.close()
    dapo.ckpt.close()


logits = jax.jit(lambda params, tokens_BT, mask_BT: model.logits(CFG, params, tokens_BT, mask_BT))


def reference_metrics(params, batch, old_logp_BC) -> dict:
  """The token-mean surrogate, clip fractions, ppo_kl and entropy in float64 from the model's logits / T."""
  z = np.asarray(logits(params, batch.tokens_BT[:, :-1], batch.mask_BT[:, :-1]), np.float64)[:, P - 1:] / T
  logp_BV = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
  logp = np.take_along_axis(logp_BV, batch.tokens_BT[:, P:, None], -1)[..., 0]
  old = np.where(np.isnan(old_logp_BC), logp, old_logp_BC)  # NaN: π_old is the current policy
  r, a, m = np.exp(logp - old), batch.adv_B.astype(np.float64)[:, None], batch.loss_mask_BC
  l1, l2 = -a * r, -a * np.clip(r, 0.8, 1.28)
  loss = np.maximum(l1, l2)
  loss = np.where((a < 0) & (loss > -a * 10.0), -a * 10.0, loss)
  high, low = (a > 0) & (r > 1.28), (a < 0) & (r < 0.8)
  mean = lambda x: float((x * m).sum() / m.sum())
  ent = -(np.exp(logp_BV) * logp_BV).sum(-1)
  return {"pg_loss": mean(loss), "pg_clipfrac": mean(high | low), "pg_clipfrac_eps_high": mean(high),
          "ppo_kl": mean(old - logp), "entropy": mean(ent), "ratio": r}


@pytest.fixture(scope="module")
def setup():
  """Params A, which sampled two groups, and B = A moved (the policy being trained); a trainer per
  number of updates per rollout step."""
  trainers = {m: make_trainer(m) for m in (1, 2)}
  params_a = jax.device_get(trainers[1].init(jax.random.key(0)).params)
  rng = np.random.default_rng(0)
  params_b = jax.tree.map(lambda x: (x + 2 * x.std() * rng.standard_normal(x.shape)).astype(x.dtype), params_a)
  groups, logp_a_BC = sample_groups(params_a, seed=0)
  return params_a, params_b, groups, logp_a_BC, trainers


@pytest.mark.parametrize("minibatches", [1, 2])
def test_carried_group_ratio_is_against_its_sampling_policy(setup, tmp_path, minibatches):
  """One update (π_old = π_θ in the objective) and two (π_old recomputed by the loop): either way a
  carried row's ratio is exp(log π_B - log π_A(sampler)) and a fresh row's is 1."""
  _, params_b, sampled, logp_a_BC, trainers = setup
  _, carry, _ = dynamic_sampling.fill_batch(None, lambda i: sampled, 1, filter_groups=True, max_gen_batches=1,
                                      on_cap="raise", carry_over=True)
  # The next step: the carried group, then a fresh one (whose tokens do not matter to its π_old).
  fresh = sampled.take(slice(0, 1))
  groups, _, _ = dynamic_sampling.fill_batch(carry, lambda i: fresh, 2, filter_groups=True, max_gen_batches=1,
                                       on_cap="raise", carry_over=True)
  assert groups.carried_Q.tolist() == [True, False]
  batch, _ = advantages.to_train_batch(groups, 2, P, norm_adv_by_std=True, overlong_filter=False)
  got = update(trainers[minibatches], params_b, batch, tmp_path, minibatches)

  old_BC = np.full(batch.old_logp_BC.shape, np.nan)
  old_BC[:G] = logp_a_BC[G:]  # The carried group is the second one A sampled.
  ref = reference_metrics(params_b, batch, old_BC)
  for k in ("pg_loss", "pg_clipfrac", "pg_clipfrac_eps_high", "ppo_kl", "entropy"):
    np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-7, err_msg=k)
  # The carried rows are off-policy beyond the clip on some tokens; π_old recomputed from params B
  # (ratio 1) would give ppo_kl 0 and no clipping.
  r = ref["ratio"][:G][batch.loss_mask_BC[:G]]
  assert np.abs(np.log(r)).max() > 0.3 and 0 < ref["pg_clipfrac"] < 1 and abs(ref["ppo_kl"]) > 1e-2
  np.testing.assert_allclose(ref["ratio"][G:][batch.loss_mask_BC[G:]], 1.0)


def test_without_carried_groups_the_update_is_unchanged(setup):
  """carry_over off: the batch has no behaviour rows and does not depend on the sampler's
  log-probs; in the objective (π_old = π_θ) an all-False flag gives the same bits as no flag."""
  _, params_b, groups, _, trainers = setup
  batch, _ = advantages.to_train_batch(groups, 2, P, norm_adv_by_std=True, overlong_filter=False)
  garbage = dataclasses.replace(groups, logp_QGC=np.full_like(groups.logp_QGC, -30.0))
  batch_g, _ = advantages.to_train_batch(garbage, 2, P, norm_adv_by_std=True, overlong_filter=False)
  assert batch.behaviour_B is None and batch_g.behaviour_B is None
  # The sampler's log-probs ride along (rollout_logp_BC) only for the mismatch metrics and the
  # rollout correction; everything the loss reads is the same.
  strip = lambda b: b.replace(rollout_logp_BC=None)
  jax.tree.map(np.testing.assert_array_equal, strip(batch), strip(batch_g))
  trainer = trainers[1]
  flagged = batch.replace(behaviour_B=np.zeros(len(batch.adv_B), bool))
  state = lambda: trainer.init(params=params_b).replace(  # Rollout step 1: lr > 0.
      rollout_step=jax.device_put(jnp.int32(1), trainer.state_sharding.rollout_step))
  s0, m0 = jax.device_get(trainer.step(state(), trainer.put_batch(batch)))
  s1, m1 = jax.device_get(trainer.step(state(), trainer.put_batch(flagged)))
  assert m0["pg_clipfrac"] == 0 and m0["ppo_kl"] == 0
  jax.tree.map(np.testing.assert_array_equal, (s0.params, m0), (s1.params, m1))
  assert np.abs(s0.params["layers"]["wq_DNH"] - params_b["layers"]["wq_DNH"]).max() > 0
