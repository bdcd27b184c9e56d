"""Train step: micro-batch accumulation, non-finite skip, LR schedule, and 8-device sharding."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dapo_jax import loss, objectives, optim, sharding, testing, train_step
from dapo_jax.datatypes import RLBatch
from dapo_jax.model import transformer as model

CFG = testing.tiny_model_config(vocab_size=64, num_heads=4, num_kv_heads=2)
OPT = optim.OptimConfig(lr=1e-3, warmup_steps=0, weight_decay=0.1, grad_clip=1.0)


def make_batch(B=8, Pl=6, C=10, seed=0):
  """Random rollouts with unequal completion lengths and some fully masked (filtered) rows."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(4, CFG.vocab_size, size=(B, Pl + C)).astype(np.int32)
  pmask = np.ones((B, Pl), bool)
  pmask[1, :3] = False
  lengths = rng.integers(1, C + 1, size=B)
  lengths[0] = C
  lengths[-1] = 1
  cmask = np.arange(C)[None] < lengths[:, None]
  loss_mask = cmask.copy()
  loss_mask[2] = False  # An overlong-filtered row.
  return RLBatch(tokens_BT=tokens, mask_BT=np.concatenate([pmask, cmask], 1), loss_mask_BC=loss_mask,
                 old_logp_BC=rng.normal(-4.2, 0.3, size=(B, C)).astype(np.float32),
                 adv_B=rng.normal(size=B).astype(np.float32), ref_logp_BC=np.zeros((B, C), np.float32))


def one_device_mesh():
  return sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])


# The first rollout step trains at lr 0 (warm-up): tests that compare updated parameters start at
# rollout step 1. A large Adam epsilon keeps the first update linear in the gradient, so gradients
# that are zero up to float noise (the key bias: softmax is shift invariant) do not move by ~lr.
LINEAR_OPT = optim.OptimConfig(lr=1e-3, warmup_steps=0, weight_decay=0.1, grad_clip=1.0, eps=1e-3)


def make_trainer(cfg=CFG, opt=OPT, mesh=None, pg=objectives.PGConfig(), **kw):
  return train_step.Trainer(cfg, opt, mesh or one_device_mesh(), objectives.policy_gradient(cfg, pg), **kw)


def logprobs(trainer, params, batch, pg=objectives.PGConfig()):
  fn = trainer.forward(objectives.completion_logprobs(trainer.model_cfg, pg.temperature, pg.group_size))
  return fn(params, trainer.put_batch(batch))


def run(mesh, num_microbatches, batch, steps=1, pg=objectives.PGConfig(), cfg=CFG, opt=OPT, rollout_step=0, **kw):
  trainer = make_trainer(cfg, opt, mesh, pg, num_microbatches=num_microbatches, **kw)
  state = trainer.init(jax.random.key(0))
  if rollout_step:
    state = state.replace(rollout_step=jax.device_put(jnp.int32(rollout_step), trainer.state_sharding.rollout_step))
  metrics = []
  for _ in range(steps):
    state, m = trainer.step(state, trainer.put_batch(batch))
    metrics.append(jax.device_get(m))
  return trainer, jax.device_get(state), metrics


def test_microbatch_accumulation_equals_full_batch_gradient():
  batch = make_batch()
  trainer = make_trainer()
  state = trainer.init(jax.random.key(0))
  objective = objectives.policy_gradient(CFG, objectives.PGConfig())
  counts = objective.counts(batch)
  # Jitted: two programs, not hundreds of op-by-op ones.
  grad = jax.jit(jax.grad(lambda p, mb: objective.loss(p, mb, counts)[0]))
  full = grad(state.params, batch)
  micro = jax.jit(train_step.split_microbatches, static_argnums=1)(batch, 4)
  acc = jax.tree.map(jnp.zeros_like, full)
  for m in range(4):
    acc = jax.tree.map(jnp.add, acc, grad(state.params, jax.tree.map(lambda x: x[m], micro)))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), acc, full)
  # And through the jitted step: the same update and metrics with 1 and 4 micro-batches.
  _, s1, m1 = run(one_device_mesh(), 1, batch)
  _, s4, m4 = run(one_device_mesh(), 4, batch)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), s1.params, s4.params)
  for k in m1[0]:
    np.testing.assert_allclose(m1[0][k], m4[0][k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("rows,seq_len,group,shards,budget,expected", [
    (64, 96, 1, 1, 2048, 4),       # 16 rows x 96 = 1536 <= 2048 < 32 x 96
    (64, 96, 1, 1, 1024, 8),       # 8 x 96 = 768
    (64, 96, 1, 1, 10**6, 1),      # fits whole
    (64, 96, 8, 1, 2048, 4),       # 8 groups: counts 1, 2, 4, 8 -> 2 groups (16 rows) each
    (64, 96, 8, 1, 100, 8),        # over budget even at one group: the most there is
    (64, 96, 8, 2, 2048, 2),       # 4 groups per shard: 64 / (2 x 2) = 16 rows per shard
    (48, 100, 1, 1, 1000, 6),      # 48 rows: 5 does not divide, 6 does (8 x 100 = 800)
    (6, 10, 4, 1, 10, 1),          # groups do not divide the rows: one micro-batch
])
def test_auto_microbatches(rows, seq_len, group, shards, budget, expected):
  assert train_step.auto_microbatches(rows, seq_len, group_size=group, shards=shards,
                                      max_tokens=budget) == expected


def test_the_budget_counts_what_a_scored_tokens_logits_hold():
  """3 V fp32 floats per scored token against a position's saved activations, by hand: SmolLM2-135M
  (D 576, 30 layers, 9 heads and 3 of 64, MLP 1536, V 49152); none with chunked logits."""
  smol = testing.tiny_model_config(vocab_size=49152, embed_dim=576, num_layers=30, num_heads=9, num_kv_heads=3,
                                   head_dim=64, mlp_dim=1536, remat="dots")
  per_layer = 576 + (576 + 2 * 192 + 2 * 576 + 2 * 1536)  # input; q, k, v, attention out, o, gate, up, down
  np.testing.assert_allclose(train_step.scored_token_positions(smol), 3 * 49152 / (30 * per_layer))
  full = dataclasses.replace(smol, remat="full")
  np.testing.assert_allclose(train_step.scored_token_positions(full), 3 * 49152 / (30 * 576))
  assert train_step.scored_token_positions(dataclasses.replace(smol, logits_chunk=8)) == 0.0
  # 8 groups of 8 rows [32 | 32]: 512 positions and 256 scored each; 2048 holds 4 groups, or 2 with
  # logits as large as SmolLM2's (0.85 positions each: 730 per group).
  assert train_step.auto_microbatches(64, 64, group_size=8, max_tokens=2048, prompt_len=32) == 2
  scored = train_step.scored_token_positions(smol)
  assert train_step.auto_microbatches(64, 64, group_size=8, max_tokens=2048, prompt_len=32, scored=scored) == 4


def test_auto_microbatches_runs_the_step_in_that_many():
  # 8 rows x 16 tokens, 10 of them scored; a budget of 4 rows makes 2 micro-batches of 4 rows.
  batch = make_batch(B=8, Pl=6, C=10)
  row = 16 + 10 * train_step.scored_token_positions(CFG)
  auto, s_auto, m_auto = run(one_device_mesh(), 0, batch, microbatch_tokens=int(np.ceil(4 * row)))
  assert auto.microbatches_for(batch) == 2
  _, s2, m2 = run(one_device_mesh(), 2, batch)
  _, s1, _ = run(one_device_mesh(), 1, batch)
  jax.tree.map(np.testing.assert_array_equal, s_auto.params, s2.params)  # The same program as 2.
  assert m_auto[0]["loss"] == m2[0]["loss"]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), s_auto.params, s1.params)
  with pytest.raises(ValueError, match="microbatch_tokens=0"):
    make_trainer(num_microbatches=0, microbatch_tokens=0)


def _surrogate_np(logp, old, adv, eps_low=0.2, eps_high=0.28, c=10.0):
  """Per-token decoupled clip with dual clip, by hand (paper Eq. 10)."""
  ratio = np.exp(logp - old)
  a = adv[:, None]
  loss = np.maximum(-a * ratio, -a * np.clip(ratio, 1 - eps_low, 1 + eps_high))
  return np.where(a < 0, np.minimum(loss, -a * c), loss)


def test_verl_weighting_differs_only_with_unequal_microbatches():
  """verl: each micro-batch's own token mean, weighted by its share of rows; with M=2 micro-batch m
  holds rows m, m+2, ... (`split_microbatches`). Equal token counts make it the global token mean."""
  trainers = {verl: make_trainer(opt=LINEAR_OPT, num_microbatches=2,
                                 pg=objectives.PGConfig(verl_microbatch_weighting=verl))
              for verl in (False, True)}
  params0 = jax.device_get(trainers[False].init(jax.random.key(0)).params)

  def step(verl, batch):  # One update at rollout step 1 (lr > 0) from the same parameters.
    t = trainers[verl]
    state = t.init(params=params0).replace(rollout_step=jax.device_put(jnp.int32(1), t.state_sharding.rollout_step))
    return jax.device_get(t.step(state, t.put_batch(batch)))

  batch = make_batch()
  logp = np.asarray(logprobs(trainers[False], params0, batch), np.float64)
  per_tok = _surrogate_np(logp, batch.old_logp_BC, batch.adv_B)
  mask = batch.loss_mask_BC
  rows = [np.arange(m, 8, 2) for m in range(2)]
  real = [r[mask[r].any(1)] for r in rows]  # Rows with loss tokens (verl's batch has no empty ones).
  n_real = sum(len(r) for r in real)
  verl = sum(len(r) / n_real * (per_tok[r] * mask[r]).sum() / mask[r].sum() for r in real)
  glob = (per_tok * mask).sum() / mask.sum()
  assert abs(verl - glob) > 1e-3  # The test batch's two micro-batches have unequal token counts.
  (s_v, m_v), (s_g, m_g) = step(True, batch), step(False, batch)
  np.testing.assert_allclose(m_v["pg_loss"], verl, rtol=1e-5)
  np.testing.assert_allclose(m_g["pg_loss"], glob, rtol=1e-5)
  assert not np.allclose(s_v.params["layers"]["wq_DNH"], s_g.params["layers"]["wq_DNH"], atol=1e-6)

  # Equal token counts per micro-batch: rows 2k and 2k+1 get the same length, so both weightings
  # are one objective and give the same update.
  lengths = np.repeat([10, 3, 0, 6], 2)
  equal = batch.replace(loss_mask_BC=np.arange(10)[None] < lengths[:, None])
  (s_v, m_v), (s_g, m_g) = step(True, equal), step(False, equal)
  for k in ("loss", "pg_loss", "grad_norm", "entropy"):
    np.testing.assert_allclose(m_v[k], m_g[k], rtol=1e-5, atol=1e-7, err_msg=k)
  assert m_g["lr"] == 1e-3
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), s_v.params, s_g.params)

  # A short step's padding rows (empty loss masks, here rows 1, 5 and 7) are not rows of verl's batch:
  # each micro-batch weighs by its share of the rows that have loss tokens.
  lengths = np.array([10, 0, 3, 7, 6, 0, 9, 0])
  padded = batch.replace(loss_mask_BC=np.arange(10)[None] < lengths[:, None])
  mask = padded.loss_mask_BC
  real = [r[mask[r].any(1)] for r in rows]
  assert sum(len(r) for r in real) == 5
  want = sum(len(r) / 5 * (per_tok[r] * mask[r]).sum() / mask[r].sum() for r in real)
  np.testing.assert_allclose(step(True, padded)[1]["pg_loss"], want, rtol=1e-5)


def test_pg_loss_matches_direct_policy_loss():
  batch = make_batch()
  trainer = make_trainer()
  state = trainer.init(jax.random.key(0))
  logits = model.logits(CFG, state.params, batch.tokens_BT, batch.mask_BT)
  C = batch.loss_mask_BC.shape[1]
  logp = loss.token_logprobs(logits[:, -C - 1:-1], batch.tokens_BT[:, -C:])
  ref, _ = loss.policy_loss(logp, batch.old_logp_BC, batch.adv_B, batch.loss_mask_BC, eps_low=0.2,
                            eps_high=0.28, clip_ratio_c=10.0)
  _, metrics = trainer.step(state, trainer.put_batch(batch))
  np.testing.assert_allclose(metrics["pg_loss"], ref, rtol=1e-5)
  # Old log-probs recomputed by the trainer equal the direct computation.
  np.testing.assert_allclose(logprobs(trainer, trainer.init(jax.random.key(0)).params, batch), logp, atol=1e-5)


def log_softmax_np(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_step_at_temperature_against_numpy():
  """At T != 1, π_old's forward (log-probs), the logged entropy and the ratio inside the loss all
  come from logits / T: one step against float64 NumPy on the model's logits."""
  T = 0.6
  pg = objectives.PGConfig(temperature=T)
  batch = make_batch()
  trainer = make_trainer(pg=pg)
  params = jax.device_get(trainer.init(jax.random.key(0)).params)
  # Logits far enough from uniform that 1/T changes the distribution.
  params = dict(params, embed_VD=params["embed_VD"] * 3)
  state = trainer.init(params=params)
  C = batch.loss_mask_BC.shape[1]
  logits = np.asarray(model.logits(CFG, params, batch.tokens_BT[:, :-1], batch.mask_BT[:, :-1]), np.float64)[:, -C:]
  logp_BV = log_softmax_np(logits / T)
  logp = np.take_along_axis(logp_BV, batch.tokens_BT[:, -C:, None], -1)[..., 0]
  np.testing.assert_allclose(logprobs(trainer, params, batch, pg), logp, rtol=1e-5)
  # π_old a little off the current policy, so that the ratio differs from 1 and clips on some tokens.
  old = (logp + np.random.default_rng(1).normal(0.0, 0.3, logp.shape)).astype(np.float32)
  _, m = jax.device_get(trainer.step(state, trainer.put_batch(batch.replace(old_logp_BC=old))))
  r, a, mask = np.exp(logp - old), batch.adv_B.astype(np.float64)[:, None], batch.loss_mask_BC
  tok = np.maximum(-a * r, -a * np.clip(r, 0.8, 1.28))
  tok = np.where((a < 0) & (tok > -a * 10.0), -a * 10.0, tok)
  clipped = ((a > 0) & (r > 1.28)) | ((a < 0) & (r < 0.8))
  mean = lambda x: (x * mask).sum() / mask.sum()
  entropy = lambda lp_BV: mean(-(np.exp(lp_BV) * lp_BV).sum(-1))
  assert 0 < mean(clipped) < 1
  expected = {"pg_loss": mean(tok), "pg_clipfrac": mean(clipped), "ppo_kl": mean(old - logp),
              "entropy": entropy(logp_BV)}
  for k, v in expected.items():
    np.testing.assert_allclose(m[k], v, rtol=1e-5, atol=1e-7, err_msg=k)
  assert entropy(log_softmax_np(logits)) - m["entropy"] > 0.3  # T = 1 would be clearly off.


def test_nonfinite_update_is_skipped_and_counted():
  batch = make_batch()
  bad = batch.replace(adv_B=np.full_like(batch.adv_B, np.nan))
  trainer = make_trainer()
  state = trainer.init(jax.random.key(0))
  state, _ = trainer.step(state, trainer.put_batch(batch))  # Moments that an applied update would move.
  before = jax.device_get((state.params, state.opt_state))
  state, m = trainer.step(state, trainer.put_batch(bad))
  assert m["update_skipped"] == 1 and int(state.skipped) == 1 and int(state.bad_streak) == 1
  jax.tree.map(np.testing.assert_array_equal, jax.device_get((state.params, state.opt_state)), before)
  state, m = trainer.step(state, trainer.put_batch(batch))
  assert m["update_skipped"] == 0 and int(state.bad_streak) == 0 and int(state.step) == 2


def test_the_non_finite_skip_holds_no_second_state():
  """The non-finite skip is a branch, so AdamW updates the donated state in place: XLA's temporaries
  are at most the clipped gradients (optax's clip materialises them), where a select between the new
  and the old state held a second tree."""
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  params = {"w": f32(8, 256, 512), "embed": f32(4096, 128), "norm": f32(8, 256)}
  tx = optim.make(OPT)
  state = jax.eval_shape(lambda p: train_step.TrainState.create(p, tx), params)
  apply = jax.jit(lambda s, g: train_step.apply_update(s, jnp.float32(1.0), {}, g, {"num_tokens": jnp.float32(1.0)},
                                                       tx=tx, optim_cfg=OPT), donate_argnums=0)
  temp = apply.lower(state, params).compile().memory_analysis().temp_size_in_bytes
  grad_bytes = sum(np.prod(p.shape) * 4 for p in params.values())
  assert temp <= 1.05 * grad_bytes, (temp, grad_bytes)


def test_learning_rate_per_rollout_step():
  cfg = optim.OptimConfig(lr=1e-6, warmup_steps=10)
  got = [float(optim.lr_at(cfg, s)) for s in range(13)]
  np.testing.assert_allclose(got, [1e-6 * min(1, s / 10) for s in range(13)], rtol=1e-6)
  assert got[0] == 0.0 and got[11] == pytest.approx(1e-6)
  # Within a rollout step the LR is constant: the first rollout step does not move the params.
  trainer = make_trainer(opt=cfg)
  state = trainer.init(jax.random.key(0))
  before = jax.device_get(state.params)
  state, m = trainer.step(state, trainer.put_batch(make_batch()))
  assert m["lr"] == 0.0
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), before)


def test_sharded_step_matches_one_device():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  batch = make_batch(B=8)
  mesh8 = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  kw = dict(steps=2, opt=LINEAR_OPT, rollout_step=1)  # lr > 0: the parameters move.
  trainer, s8, m8 = run(mesh8, 2, batch, **kw)
  _, s1, m1 = run(one_device_mesh(), 2, batch, **kw)
  init = jax.device_get(trainer.init(jax.random.key(0)).params)
  for a, b in zip(m8, m1):  # Every metric of both steps, the gradient norm among them.
    assert a.keys() == b.keys() and "grad_norm" in a
    for k in a:
      np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)
  assert m8[0]["lr"] == 1e-3 and m8[1]["grad_norm"] != m8[0]["grad_norm"]  # The step saw the first update.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), s8.params, s1.params)
  for k in ("wq_DNH", "w_down_FD"):
    assert np.abs(s8.params["layers"][k] - init["layers"][k]).max() > 1e-4, k
  specs = jax.tree.map(lambda s: s.spec, trainer.state_sharding.params)
  assert specs["layers"]["wq_DNH"] == P(None, "fsdp", "tensor", None)
  assert specs["layers"]["w_down_FD"] == P(None, "tensor", "fsdp")
  assert specs["embed_VD"] == P("tensor", "fsdp")
  mu = trainer.state_sharding.opt_state.inner_state[1][0].mu  # AdamW moments shard like params.
  assert mu["layers"]["wq_DNH"].spec == P(None, "fsdp", "tensor", None)


def test_sharded_step_with_bf16_matmuls_matches_one_device():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  cfg = testing.tiny_model_config(vocab_size=64, num_heads=4, num_kv_heads=2, matmul_dtype="bfloat16")
  batch = make_batch(B=8)
  init = jax.device_get(make_trainer(cfg).init(jax.random.key(0)).params)
  _, s8, m8 = run(sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}), 2, batch, cfg=cfg)
  _, s1, m1 = run(one_device_mesh(), 2, batch, cfg=cfg)
  # Shards sum in another order; a last-bit difference can move a bf16 rounding, so compare loosely:
  # the loss, and each parameter's update (lr 1e-3, so ~1e-3 per element).
  np.testing.assert_allclose(m8[0]["loss"], m1[0]["loss"], rtol=1e-3)
  jax.tree.map(lambda a, b, p0: np.testing.assert_allclose(a - p0, b - p0, atol=1e-4), s8.params, s1.params, init)


def test_shared_prompt_forward_equals_repeated_rows():
  # Groups of G=2 rows with one prompt each: running each prompt once gives the same update.
  batch = make_batch(B=8)
  prompt_len = 6
  tokens, mask = batch.tokens_BT.copy(), batch.mask_BT.copy()
  tokens[1::2, :prompt_len], mask[1::2, :prompt_len] = tokens[::2, :prompt_len], mask[::2, :prompt_len]
  batch = batch.replace(tokens_BT=tokens, mask_BT=mask)
  shared = objectives.PGConfig(group_size=2)
  _, base, mb = run(one_device_mesh(), 1, batch)
  meshes = [one_device_mesh()] + ([sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})]
                                  if len(jax.devices()) >= 8 else [])
  for mesh in meshes:
    for num_microbatches in (1, 2):
      trainer, state, m = run(mesh, num_microbatches, batch, pg=shared)
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), state.params, base.params)
      for k in ("loss", "pg_loss", "entropy", "grad_norm", "ppo_kl"):
        np.testing.assert_allclose(m[0][k], mb[0][k], rtol=1e-5, atol=1e-6, err_msg=k)
  # The log-prob pass (π_old) too, with the micro-batch order undone (padding positions may differ).
  params = trainer.init(jax.random.key(0)).params
  plain = make_trainer(num_microbatches=2)
  real = batch.mask_BT[:, prompt_len:]
  np.testing.assert_allclose(np.where(real, logprobs(trainer, params, batch, shared), 0),
                             np.where(real, logprobs(plain, jax.device_get(params), batch), 0), atol=1e-5)
