"""Length-bucketed updates: micro-batches of groups sorted by length, each cut to a length bucket,
give the update of the padded batch (the token mean stays global)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax import objectives, optim, sharding, testing, train_step
from dapo_jax.datatypes import RLBatch

CFG = testing.tiny_model_config(vocab_size=64)
OPT = optim.OptimConfig(lr=1e-3, warmup_steps=0, weight_decay=0.1, grad_clip=1.0, eps=1e-3)


def long_tail_batch(Q=4, G=2, P=5, C=24, seed=0):
  """Groups sharing a prompt, responses of very different lengths (right-padded to C)."""
  rng = np.random.default_rng(seed)
  prompt = np.repeat(rng.integers(4, 64, size=(Q, P)), G, 0)
  pmask = np.ones((Q * G, P), bool)
  pmask[::G][1, :2] = pmask[1::G][1, :2] = False
  length = np.array([3, 20, 2, 4, 24, 9, 1, 5])[:Q * G]
  cmask = np.arange(C)[None] < length[:, None]
  tokens = np.concatenate([prompt, np.where(cmask, rng.integers(4, 64, size=(Q * G, C)), 0)], 1).astype(np.int32)
  loss_mask = cmask.copy()
  loss_mask[5] = False  # An overlong-filtered row.
  return RLBatch(tokens_BT=tokens, mask_BT=np.concatenate([pmask, cmask], 1), loss_mask_BC=loss_mask,
                 old_logp_BC=rng.normal(-4, 0.3, size=(Q * G, C)).astype(np.float32),
                 adv_B=rng.normal(size=Q * G).astype(np.float32), ref_logp_BC=np.zeros((Q * G, C), np.float32))


def test_a_shared_prefix_layout_is_budgeted_by_what_it_computes():
  """Groups of 2 in the shared-prefix layout (N = 16 shared tokens, the rest in W = 8 columns of a
  P = 30 prompt): a group costs W + 2 x C tokens and a micro-batch N once, not 2 x (P + C)."""
  assert train_step.group_tokens(2, 30, 8) == 76
  assert train_step.group_tokens(2, 30, 8, prefix=(16, 8)) == 8 + 16
  batch = long_tail_batch(P=5).replace(prefix_len=16, suffix_len=8)  # (only the budget reads them here)
  cut = train_step.bucketed_microbatches(batch, 0, 2, (8, 16, 24), max_tokens=16 + 2 * (8 + 2 * 8))
  # Bucket 8 (groups of longest 4 and 5): 2 groups of 24 tokens after the prefix's 16; the two
  # others wait for bucket 24, which fits one group of 8 + 48 tokens per micro-batch.
  assert [(mb.tokens_BT.shape, mb.prefix_len, mb.suffix_len) for mb in cut] == [
      ((4, 13), 16, 8), ((2, 29), 16, 8), ((2, 29), 16, 8)]
  # The auto count: 8 groups of 2 rows of 30 + 24 columns; 4 fit 16 + 4 x (8 + 48) = 240 tokens.
  assert train_step.auto_microbatches(16, 54, group_size=2, max_tokens=240, prefix=(16, 8), prompt_len=30) == 2
  assert train_step.auto_microbatches(16, 54, group_size=2, max_tokens=240) == 4  # rows whole: 2 x 108


def test_buckets_and_microbatches_by_hand():
  assert train_step.length_buckets(512) == (64, 128, 192, 256, 320, 384, 448, 512)
  assert train_step.length_buckets(32) == (8, 16, 24, 32)
  mbs = train_step.bucketed_microbatches(long_tail_batch(), 2, 2, (8, 16, 24))
  # Groups by longest response: [3, 20] -> 20, [2, 4] -> 4, [24, 9] -> 24, [1, 5] -> 5; sorted: 4, 5 | 20, 24.
  assert [mb.loss_mask_BC.shape[1] for mb in mbs] == [8, 24]
  np.testing.assert_array_equal(mbs[0].mask_BT[:, 5:].sum(1), [2, 4, 1, 5])
  np.testing.assert_array_equal(mbs[1].mask_BT[:, 5:].sum(1), [3, 20, 24, 9])


def test_token_budget_microbatches_by_hand():
  """With no set count, each bucket packs its rows to the token budget (P=5 prompt tokens)."""
  lengths = lambda mbs: [(mb.tokens_BT.shape, mb.mask_BT[:, 5:].sum(1).tolist()) for mb in mbs]
  batch = long_tail_batch()  # Response lengths 3, 20, 2, 4, 24, 9, 1, 5.
  # 64 tokens: bucket 8 takes 64 // 13 = 4 rows (1, 2, 3, 4); 5 waits for bucket 16 (3 rows of 21
  # tokens: only 5, 9 there), then bucket 24 takes 2 rows of 29 tokens twice.
  assert lengths(train_step.bucketed_microbatches(batch, 0, 1, (8, 16, 24), max_tokens=64)) == [
      ((4, 13), [1, 2, 3, 4]), ((2, 29), [5, 9]), ((2, 29), [20, 24])]
  # Whole groups of 2 (longest 20, 4, 24, 5): two of 26 tokens fit 64 at bucket 8.
  assert lengths(train_step.bucketed_microbatches(batch, 0, 2, (8, 16, 24), max_tokens=64)) == [
      ((4, 13), [2, 4, 1, 5]), ((2, 29), [3, 20]), ((2, 29), [24, 9])]
  # 150 tokens: buckets 8 and 16 would take 11 and 7 rows, so all 8 wait for bucket 24 (5 rows of
  # 29); its 3 leftovers go in power-of-two micro-batches, 2 + 1.
  assert lengths(train_step.bucketed_microbatches(batch, 0, 1, (8, 16, 24), max_tokens=150)) == [
      ((5, 29), [1, 2, 3, 4, 5]), ((2, 29), [9, 20]), ((1, 29), [24])]
  # Two data shards: the budget is per shard, rows go in pairs.
  assert lengths(train_step.bucketed_microbatches(batch, 0, 1, (8, 16, 24), max_tokens=26, shards=2)) == [
      ((4, 13), [1, 2, 3, 4]), ((2, 21), [5, 9]), ((2, 29), [20, 24])]
  # 4 groups over 3 shards do not split: one micro-batch, as the auto count does.
  assert [mb.tokens_BT.shape for mb in train_step.bucketed_microbatches(
      batch, 0, 2, (8, 16, 24), max_tokens=26, shards=3)] == [(8, 29)]


@pytest.mark.parametrize("share_prompt,max_tokens,agg,mode,sharded", [  # max_tokens: a set micro-batch count, or a budget.
    (False, 0, "token_mean", "vanilla", True), (True, 0, "token_mean", "vanilla", False),
    (False, 64, "token_mean", "vanilla", False), (True, 64, "token_mean", "vanilla", True),
    # Dr.GRPO divides each row's sum by the completion budget, which a bucket must not shorten.
    (True, 64, "seq_mean_token_sum_norm", "vanilla", False), (False, 0, "seq_mean_token_sum_norm", "vanilla", False),
    # GSPO's ratio is one per response, CISPO's weight one per token: whole rows in every bucket.
    (True, 64, "seq_mean_token_mean", "gspo", False), (False, 0, "token_mean", "cispo", False)])
def test_bucketed_update_equals_the_padded_update(share_prompt, max_tokens, agg, mode, sharded):
  """`sharded` also runs it on a 2 x 2 x 2 mesh (the two micro-batching modes; each case is costly there)."""
  batch = long_tail_batch()
  G = 2 if share_prompt else 0
  pg = objectives.PGConfig(group_size=G, loss_agg=agg, norm_len=24, kl_coef=0.1, policy_loss=mode)
  meshes = [sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])]
  if sharded and len(jax.devices()) >= 8:
    meshes.append(sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}))
  results = []
  for mesh in meshes:
    trainer = train_step.Trainer(CFG, OPT, mesh, objectives.policy_gradient(CFG, pg), num_microbatches=2)
    params0 = jax.device_get(trainer.init(jax.random.key(0)).params)
    start = lambda: trainer.init(params=params0).replace(
        rollout_step=jax.device_put(jnp.int32(1), trainer.state_sharding.rollout_step))  # lr > 0
    s_pad, m_pad = jax.device_get(trainer.step(start(), trainer.put_batch(batch)))
    shards = sharding.batch_shards(mesh.shape)
    parts = train_step.bucketed_microbatches(batch, 0 if max_tokens else 2, max(G, 1), train_step.length_buckets(24, 3),
                                             max_tokens=max_tokens, shards=shards)
    if shards == 1 or not max_tokens:  # (4 shards of 8 rows take all 4 groups in one micro-batch.)
      assert max(p.loss_mask_BC.shape[1] for p in parts) == 24 and min(p.loss_mask_BC.shape[1] for p in parts) < 24
    s_b, m_b = jax.device_get(trainer.accumulate_step(start(), [trainer.put_batch(p) for p in parts]))
    for k in ("loss", "pg_loss", "kl_loss", "grad_norm", "entropy", "num_tokens"):
      np.testing.assert_allclose(m_b[k], m_pad[k], rtol=1e-5, atol=1e-7, err_msg=k)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), s_b.params, s_pad.params)
    assert int(s_b.step) == int(s_pad.step) == 1
    results.append(s_b.params)
  if len(results) > 1:
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), *results)


def test_sum_norm_without_the_budget_weighs_bucketed_rows_by_their_bucket():
  """The control of the test above: each micro-batch's own padded length as C (what `norm_len=0`
  means) gives a bucketed loss that is not the padded one."""
  batch = long_tail_batch()
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  pg = objectives.PGConfig(loss_agg="seq_mean_token_sum_norm", norm_len=0)
  trainer = train_step.Trainer(CFG, OPT, mesh, objectives.policy_gradient(CFG, pg), num_microbatches=2)
  state = trainer.init(jax.random.key(0))
  _, m_pad = jax.device_get(trainer.step(state, trainer.put_batch(batch)))
  parts = train_step.bucketed_microbatches(batch, 2, 1, train_step.length_buckets(24, 3))
  _, m_b = jax.device_get(trainer.accumulate_step(trainer.init(jax.random.key(0)), [trainer.put_batch(p) for p in parts]))
  assert abs(float(m_b["pg_loss"]) - float(m_pad["pg_loss"])) > 1e-3 * abs(float(m_pad["pg_loss"]))


def test_an_update_with_no_loss_tokens_moves_nothing():
  batch = long_tail_batch()
  empty = batch.replace(loss_mask_BC=np.zeros_like(batch.loss_mask_BC))
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  trainer = train_step.Trainer(CFG, OPT, mesh, objectives.policy_gradient(CFG, objectives.PGConfig()))
  state = trainer.init(jax.random.key(0)).replace(rollout_step=jnp.int32(1))
  before = jax.device_get(state)
  after, m = jax.device_get(trainer.step(state, trainer.put_batch(empty)))
  jax.tree.map(np.testing.assert_array_equal, after.params, before.params)
  jax.tree.map(np.testing.assert_array_equal, after.opt_state, before.opt_state)
  assert int(after.step) == 0 and int(after.skipped) == 0 and m["update_applied"] == 0
  # The step's metrics average the applied updates only, weighted by their loss tokens.
  from dapo_jax import metrics
  mean = metrics.mean_updates([{"pg_loss": 2.0, "num_tokens": 30.0, "update_applied": 1.0, "update_skipped": 0.0},
                               {"pg_loss": 5.0, "num_tokens": 10.0, "update_applied": 1.0, "update_skipped": 0.0},
                               {"pg_loss": 0.0, "num_tokens": 0.0, "update_applied": 0.0, "update_skipped": 0.0}])
  assert mean["pg_loss"] == pytest.approx((2 * 30 + 5 * 10) / 40)
