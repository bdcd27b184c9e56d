"""Packed updates: rows packed without padding into sequences of a token budget give the padded
update (loss, metrics, gradients, params after two steps) for every loss mode and aggregation."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax import objectives, optim, packing, sharding, testing, train_step
from dapo_jax.datatypes import RLBatch
from dapo_jax.model import lora
from dapo_jax.model import transformer as model_lib
from dapo_jax.model.packed_attention import Segments

CFG = testing.tiny_model_config(vocab_size=64)
OPT = optim.OptimConfig(lr=1e-3, warmup_steps=0, weight_decay=0.1, grad_clip=1.0, eps=1e-3)
MOE = dataclasses.replace(CFG, arch="qwen3_moe", qk_norm=True, qkv_bias=False, num_experts=4, experts_per_token=2,
                          expert_mlp_dim=16, norm_topk_prob=True, router_aux_coef=0.01)
LENGTHS = [3, 20, 2, 4, 24, 9, 1, 5]  # Completion lengths (C = 24); prompts of 5 tokens, rows 2 and 3 of 3.


def long_tail_batch(C=24, P=5, seed=0, rollout_logp=False, shared=1, prefix=0) -> RLBatch:
  """Rows of LENGTHS' completions; with `shared` = G, each G consecutive rows have one prompt; with
  `prefix` = n, every prompt begins with the same n real tokens."""
  rng = np.random.default_rng(seed)
  B = len(LENGTHS)
  pmask = np.ones((B, P), bool)
  pmask[2:4, :2] = False  # Left padding.
  cmask = np.arange(C)[None] < np.array(LENGTHS)[:, None]
  prompts = np.repeat(rng.integers(4, 64, size=(B, P))[::shared], shared, axis=0)
  for b in range(B):
    prompts[b, np.flatnonzero(pmask[b])[:prefix]] = np.arange(prefix) + 1
  tokens = np.concatenate([np.where(pmask, prompts, 0),
                           np.where(cmask, rng.integers(4, 64, size=(B, C)), 0)], 1).astype(np.int32)
  loss_mask = cmask.copy()
  loss_mask[5] = False  # An overlong-filtered row.
  old = rng.normal(-4, 0.3, size=(B, C)).astype(np.float32)
  return RLBatch(tokens_BT=tokens, mask_BT=np.concatenate([pmask, cmask], 1), loss_mask_BC=loss_mask,
                 old_logp_BC=old, adv_B=rng.normal(size=B).astype(np.float32),
                 ref_logp_BC=rng.normal(-4, 0.3, size=(B, C)).astype(np.float32),
                 rollout_logp_BC=(old + rng.normal(0, 0.2, size=(B, C))).astype(np.float32) if rollout_logp else None)


def rows_of(batch, part) -> list[int]:
  """The batch rows in a packed micro-batch's row slots (-1: unused), found by their advantages."""
  return [int(np.flatnonzero(np.asarray(batch.adv_B) == a)[0]) if ok else -1
          for a, ok in zip(part.adv_B, part.packed.row_B)]


def scored_sources(part) -> np.ndarray:
  """[B, C]: the packed position predicting each completion token (its shard's sequences end to end)."""
  pk, (B, C) = part.packed, part.loss_mask_BC.shape
  out = np.full(B * C + 1, -1)
  out[np.minimum(pk.place_K, B * C)] = pk.source_K
  return out[:-1].reshape(B, C)


def test_rows_pack_first_fit_longest_first_by_hand():
  batch = long_tail_batch()
  # The forward reads each row's real tokens among its first P + C - 1 = 28 columns: prompt (5, or 3
  # for rows 2 and 3) + completion, but for row 4 (24 tokens) its last one. Rows 4, 1, 5, 7, 0, 3, 6, 2
  # have 28, 25, 14, 10, 8, 7, 6, 5 tokens.
  parts = packing.packed_microbatches(batch, max_tokens=64)
  # Sequences of P + C = 29 positions, 64 // 29 = 2 per micro-batch, first fit: 28 | 25, then the
  # rest waits: 14 + 10 + 5 | 8 + 7 + 6.
  assert [rows_of(batch, p) for p in parts] == [[4, 1], [5, 7, 2, 0, 3, 6, -1, -1]]
  assert [p.packed.tokens_MT.shape for p in parts] == [(2, 29), (2, 29)]
  assert [p.loss_mask_BC.shape for p in parts] == [(2, 24), (8, 24)]  # Row slots: a power of two.
  p = parts[1]
  segments = [np.unique(s[s > 0], return_counts=True)[1].tolist() for s in p.packed.segments_MT]
  assert segments == [[14, 10, 5], [8, 7, 6]]
  # Positions restart in each segment; completion token c of a row is read where the one before it sits.
  np.testing.assert_array_equal(p.packed.positions_MT[0], list(range(14)) + list(range(10)) + list(range(5)))
  sources = scored_sources(p)
  np.testing.assert_array_equal(sources[1, :LENGTHS[7]], 14 + 4 + np.arange(5))  # row 7 after row 5
  np.testing.assert_array_equal(sources[3, :LENGTHS[0]], 29 + 4 + np.arange(3))  # row 0: sequence 1
  # The lm head's tokens: the completions' own, 24 of them, K = 24 (m x 2^e, m in 8..15: 12 x 2).
  pk = p.packed
  assert pk.source_K.shape == (24,)
  assert int((pk.place_K < 8 * 24).sum()) == 24 == sum(LENGTHS[b] for b in [5, 7, 2, 0, 3, 6])
  np.testing.assert_array_equal(pk.target_K[:24], np.asarray(p.tokens_BT).reshape(-1)[pk.place_K[:24]])
  np.testing.assert_array_equal(p.packed.tokens_MT[0, 14:24], batch.tokens_BT[7][batch.mask_BT[7]])
  # Length buckets: short rows go in sequences of P + 16 = 21 positions, 3 of them in 64 tokens.
  bucketed = packing.packed_microbatches(batch, max_tokens=64, buckets=(8, 16, 24))
  assert [(q.packed.tokens_MT.shape, q.loss_mask_BC.shape[1]) for q in bucketed] == [((2, 29), 24), ((3, 21), 16)]
  assert rows_of(batch, bucketed[1]) == [5, 3, 7, 0, 6, 2, -1, -1]
  # Two data shards: sequence i goes to shard i % 2, and shard d's row slots are the d-th half.
  two = packing.packed_microbatches(batch, max_tokens=64, shards=2)
  assert [q.packed.tokens_MT.shape for q in two] == [(4, 29)]
  assert rows_of(batch, two[0]) == [4, 5, 7, 2, 1, 0, 3, 6]
  # Logits that hold a quarter position per completion token: beside row 4 (24 tokens) a second
  # sequence holds 2 x 29 positions and at least 25 tokens (64.25 > 64); beside row 1 (20), rows 0
  # and 6 (3 + 1 tokens: 58 + 6 = 64), not row 3 or 2; then rows 5, 7, 2 | 3 (58 + 20 / 4).
  assert [rows_of(batch, q) for q in packing.packed_microbatches(batch, max_tokens=64, scored=0.25)] == [
      [4], [1, 0, 6, -1], [5, 7, 2, 3]]
  # A budget below a row's length: one sequence per micro-batch.
  assert [rows_of(batch, q) for q in packing.packed_microbatches(batch, max_tokens=8)] == [
      [4], [1], [5, 7, 2, -1], [0, 3, 6, -1]]


def test_rows_of_one_prompt_share_it_in_a_sequence_by_hand():
  batch = long_tail_batch(shared=2)  # Rows (0, 1), (2, 3), (4, 5), (6, 7) share a prompt (of 3 tokens for 2, 3).
  # Rows 4, 1, 5, 7, 0, 3, 6, 2 read 28, 25, 14, 10, 8, 7, 6, 5 tokens; a row whose prompt is already
  # in a sequence costs its tokens past the prompt's first P - 1 there: row 0 joins row 1 (25 + 4).
  parts = packing.packed_microbatches(batch, max_tokens=64)
  assert [rows_of(batch, p) for p in parts] == [[4, 1, 0, -1], [5, 7, 6, 3, 2, -1, -1, -1]]
  pk = parts[1].packed
  # Sequence 0: row 5 alone (14), then rows 7 and 6: their prompt but its last token (4), then each
  # one's branch from that token on (6, 2). Sequence 1: rows 3 and 2, prompt 3 tokens: 2, then 5, 3.
  np.testing.assert_array_equal(pk.segments_MT[0], [1] * 14 + [2] * 12 + [0] * 3)
  np.testing.assert_array_equal(pk.branches_MT[0], [0] * 14 + [0] * 4 + [1] * 6 + [2] * 2 + [0] * 3)
  np.testing.assert_array_equal(pk.positions_MT[0, :26], list(range(14)) + list(range(10)) + [4, 5])
  np.testing.assert_array_equal(pk.branches_MT[1], [0] * 2 + [1] * 5 + [2] * 3 + [0] * 19)
  row6, row7 = (batch.tokens_BT[b][batch.mask_BT[b]] for b in (6, 7))
  np.testing.assert_array_equal(pk.tokens_MT[0, 14:26], np.concatenate([row7[:10], row6[4:6]]))
  sources = scored_sources(parts[1])
  np.testing.assert_array_equal(sources[1, :LENGTHS[7]], 18 + np.arange(5))  # Row 7 from its branch's start.
  np.testing.assert_array_equal(sources[2, :LENGTHS[6]], [24])
  np.testing.assert_array_equal(sources[4, :LENGTHS[2]], 29 + 7 + np.arange(2))  # Row 2: sequence 1.
  # A branch sees its trunk and itself: row 6's token sees the trunk, not row 7's branch.
  mask = np.asarray(model_lib.packed_attention_mask(pk.segments_MT, pk.branches_MT))[0]
  np.testing.assert_array_equal(np.flatnonzero(mask[25]), list(range(14, 18)) + [24, 25])
  np.testing.assert_array_equal(np.flatnonzero(mask[20]), list(range(14, 21)))
  np.testing.assert_array_equal(np.flatnonzero(mask[16]), list(range(14, 17)))


def test_prompts_that_begin_alike_share_their_beginning_by_hand():
  batch = long_tail_batch(shared=2, prefix=2)  # Groups of 2 rows; every prompt begins with tokens 1, 2.
  # A row costs its tokens past the prompts' common beginning (2) in a sequence holding another
  # prompt, past its prompt's first P - 1 where its prompt is already: micro-batch 2 fits rows 5, 7, 3
  # and 6 in one sequence (14 + 8 + 5 + 2 = 29).
  parts = packing.packed_microbatches(batch, max_tokens=64)
  assert [rows_of(batch, p) for p in parts] == [[4, 1, 0, -1], [5, 7, 6, 3, 2, -1, -1, -1]]  # Slots: by prompt.
  pk = parts[1].packed
  # One segment: the beginning (2), row 5 after it (12), rows 7 and 6's trunk (2) and branches (6, 2),
  # row 3 after the beginning (5). Positions are each row's own.
  np.testing.assert_array_equal(pk.segments_MT[0], [1] * 29)
  np.testing.assert_array_equal(pk.prompts_MT[0], [0] * 2 + [1] * 12 + [2] * 10 + [3] * 5)
  np.testing.assert_array_equal(pk.branches_MT[0], [0] * 16 + [1] * 6 + [2] * 2 + [0] * 5)
  np.testing.assert_array_equal(pk.positions_MT[0], [0, 1] + list(range(2, 14)) + [2, 3] + list(range(4, 10)) +
                                [4, 5] + list(range(2, 7)))
  row3 = batch.tokens_BT[3][batch.mask_BT[3]]
  np.testing.assert_array_equal(pk.tokens_MT[0, :2], [1, 2])
  np.testing.assert_array_equal(pk.tokens_MT[0, 24:], row3[2:7])
  np.testing.assert_array_equal(scored_sources(parts[1])[3, :LENGTHS[3]], 24 + np.arange(4))
  # Row 3's last token sees the beginning and its own part; row 6's second, the beginning, its
  # prompt's trunk and its branch.
  mask = np.asarray(Segments.of(pk).dense_mask())[0]
  np.testing.assert_array_equal(np.flatnonzero(mask[28]), [0, 1, 24, 25, 26, 27, 28])
  np.testing.assert_array_equal(np.flatnonzero(mask[23]), [0, 1, 14, 15, 22, 23])


@pytest.mark.parametrize("block", [0, 8])
def test_prompts_that_begin_alike_give_the_padded_loss_metrics_and_gradients(block):
  """Prompts with a common beginning, alone and in groups of 2, with a local layer: packed (dense, or
  over block pairs) against the padded rows."""
  cfg = dataclasses.replace(CFG, local_layers=(0,), sliding_window=6)
  obj = objectives.policy_gradient(cfg, objectives.PGConfig(kl_coef=0.1))
  for G in (1, 2):
    batch = long_tail_batch(shared=G, prefix=2)
    parts = packing.packed_microbatches(batch, max_tokens=64, block=block)
    assert any(int(p.packed.prompts_MT.max()) > 1 for p in parts)  # Some sequence shares the beginning.
    _assert_parts_make_the_batch(obj, batch, parts, cfg)


@pytest.mark.parametrize("name", ["token_mean", "seq_mean_token_sum", "kl_k3", "gspo", "one/clip_cov"])
def test_rows_sharing_prompts_give_the_padded_loss_metrics_and_gradients(name):
  """Groups of 2 and of 4 rows with one prompt, packed (each sequence computes a prompt once) against
  the padded rows."""
  for G in (2, 4):
    batch = long_tail_batch(shared=G)
    obj = objectives.policy_gradient(CFG, objectives.PGConfig(**CASES[name]))
    parts = packing.packed_microbatches(batch, max_tokens=256 if name.startswith("one/") else 64)
    assert any(int(p.packed.branches_MT.max()) > 1 for p in parts)  # Some prompt is shared.
    _assert_parts_make_the_batch(obj, batch, parts)


CASES = {  # name: PGConfig fields; "one/": the mode (or its metrics) reads a micro-batch's own tokens: one is compared
    "token_mean": dict(),
    "seq_mean_token_mean": dict(loss_agg="seq_mean_token_mean"),
    "seq_mean_token_sum": dict(loss_agg="seq_mean_token_sum"),
    "dr_grpo_norm": dict(loss_agg="seq_mean_token_sum_norm", norm_len=24),
    "kl_k3": dict(kl_coef=0.1, kl_estimator="k3"),
    "gspo": dict(policy_loss="gspo"),
    "cispo": dict(policy_loss="cispo"),
    "gpg": dict(policy_loss="gpg"),
    "sapo": dict(policy_loss="sapo"),
    "geo_mean": dict(policy_loss="geo_mean"),
    "dro": dict(policy_loss="dro", dro_beta=0.1),
    "dppo_tv": dict(policy_loss="dppo_tv"),
    "dppo_kl": dict(policy_loss="dppo_kl"),
    "old_is_current": dict(old_is_current=True),
    "one/rollout_is_sequence": dict(rollout_correction=objectives.RolloutCorrection(rollout_is="sequence")),
    "one/clip_cov": dict(policy_loss="clip_cov", clip_cov_ratio=0.2),
    "one/kl_cov": dict(policy_loss="kl_cov", kl_cov_ratio=0.2),
    "one/verl_weighting": dict(verl_microbatch_weighting=True),
    "one/rollout_rs_bypass_reinforce": dict(rollout_correction=objectives.RolloutCorrection(
        rollout_rs="token_k1", rollout_rs_threshold="2.0", bypass_mode=True, loss_type="reinforce")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_packed_loss_metrics_and_gradients_equal_the_padded_ones(name):
  """Each policy-loss mode and aggregation: the objective summed over packed micro-batches (two, of
  a 64-token budget, or one) against the padded batch: loss, every metric, the gradient."""
  batch = long_tail_batch(rollout_logp="rollout" in name)
  obj = objectives.policy_gradient(CFG, objectives.PGConfig(**CASES[name]))
  parts = packing.packed_microbatches(batch, max_tokens=256 if name.startswith("one/") else 64)
  assert len(parts) == (1 if name.startswith("one/") else 2)
  _assert_parts_make_the_batch(obj, batch, parts)


def _assert_parts_make_the_batch(obj, batch, parts, cfg=CFG):
  """The objective summed over packed micro-batches is the padded batch's: loss, metrics, gradient."""
  params = _params(cfg)
  step = jax.jit(jax.value_and_grad(obj.loss, has_aux=True))
  (loss, metrics), grads = step(params, batch, obj.counts(batch))
  counts = jax.tree.map(lambda *c: sum(c), *[obj.counts(p) for p in parts])
  (loss_p, metrics_p), grads_p = jax.tree.map(lambda *x: sum(x), *[step(params, p, counts) for p in parts])
  np.testing.assert_allclose(loss_p, loss, rtol=1e-5, atol=1e-6)
  assert metrics_p.keys() == metrics.keys()
  for k in metrics:
    np.testing.assert_allclose(metrics_p[k], metrics[k], rtol=1e-5, atol=1e-6, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6), grads, grads_p)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) > 1e-3  # Not a vacuous comparison.


def _trainer(cfg, pg, mesh, adapters=None):
  return train_step.Trainer(cfg, OPT, mesh, objectives.policy_gradient(cfg, pg), num_microbatches=1, lora=adapters)


def _two_steps(trainer, params0, parts):
  """Two updates from params0 on the same micro-batches; (metrics of each, final state)."""
  state = trainer.init(params=params0)
  state = state.replace(rollout_step=jax.device_put(jnp.int32(1), trainer.state_sharding.rollout_step))
  out = []
  for _ in range(2):
    placed = [trainer.put_batch(p) for p in parts]
    state, m = trainer.accumulate_step(state, placed) if len(placed) > 1 else trainer.step(state, placed[0])
    out.append(jax.device_get(m))
  return out, jax.device_get(state)


def _assert_same_update(padded, packed):
  (m_pad, s_pad), (m_pk, s_pk) = padded, packed
  for a, b in zip(m_pad, m_pk):
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=k)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(y, x, atol=1e-6), s_pad.params, s_pk.params)
  assert int(s_pk.step) == int(s_pad.step) == 2


def _params(cfg=CFG):
  return model_lib.init_params(cfg, jax.random.key(3))


@pytest.mark.parametrize("case", ["one_device", "mesh_2x2x2", "lora_int8", "moe", "chunked_logits",
                                  "vs_shared_prompt", "blocks/mesh_2x2x2", "blocks/lora_int8"])
def test_two_packed_updates_equal_two_padded_updates(case):
  """Through the Trainer (micro-batches of two shapes accumulated, AdamW): metrics of each update and
  params after two, on one device and the (2, 2, 2) mesh, LoRA on int8, Qwen3-MoE, chunked logits, and
  against the padded shared-prompt layout (groups of 2 rows sharing a prompt, which runs once);
  "blocks/": attention over block pairs (`packing.block_pairs`)."""
  cfg, adapters, mesh = CFG, None, sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  budget = 64  # Two micro-batches of 4 and 8 row slots.
  block = 8 if case.startswith("blocks/") else 0
  case = case.removeprefix("blocks/")
  if case == "mesh_2x2x2":
    if len(jax.devices()) < 8:
      pytest.skip("needs 8 devices (tests/conftest.py forces 8 host devices)")
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  elif case == "lora_int8":
    adapters = lora.LoraConfig(rank=4, alpha=8, base_quant="int8")
  elif case == "moe":
    cfg, budget = MOE, 256  # The load-balancing loss is one micro-batch's: compare one with one.
  elif case == "chunked_logits":
    cfg = dataclasses.replace(CFG, logits_chunk=8)
  batch, G = long_tail_batch(), 0
  if case == "vs_shared_prompt":
    G, P = 2, 5
    tokens, mask = batch.tokens_BT.copy(), batch.mask_BT.copy()
    tokens[1::2, :P], mask[1::2, :P] = tokens[::2, :P], mask[::2, :P]
    batch = batch.replace(tokens_BT=tokens, mask_BT=mask)
  trainer = _trainer(cfg, objectives.PGConfig(kl_coef=0.1, group_size=G), mesh, adapters)
  params0 = jax.device_get(trainer.init(jax.random.key(0)).params)
  parts = packing.packed_microbatches(batch, max_tokens=budget, shards=sharding.batch_shards(mesh.shape), block=block)
  _assert_same_update(_two_steps(trainer, params0, [batch]), _two_steps(trainer, params0, parts))


def test_a_run_with_packing_makes_the_padded_runs_update(tmp_path):
  """`train.packing=True` through the loop: the same rollouts, the same first update's metrics."""
  import dapo_jax
  metrics = {}
  for packed in (False, True):
    overrides = {"train.num_steps": 1, "train.packing": packed, "train.num_microbatches": 0, "train.eval_every": 0,
                 "reward.fn": "dapo_jax.testing:length_reward", "reward.workers": 1}
    with dapo_jax.Run("configs/default.py:runlocal", workdir=str(tmp_path / str(packed)), **overrides) as run:
      metrics[packed] = run.train()
  padded, packed = metrics[False], metrics[True]
  actor = sorted(k for k in padded if k.startswith("actor/") and not k.endswith("_s"))
  assert {"actor/pg_loss", "actor/entropy", "actor/grad_norm"} <= set(actor), sorted(padded)
  for k in actor + ["rollout/samples", "response_length/mean"]:
    np.testing.assert_allclose(packed[k], padded[k], rtol=1e-4, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("packed", [False, True, 8], ids=["padded", "packed", "blocks"])
def test_a_sequence_parallel_update_equals_the_unsharded_one(packed):
  """`mesh.sequence` = 4 splits each row's (or packed sequence's) tokens over 4 of 8 forced devices, fsdp
  = 2 the rows: two updates give the metrics and params of one device's to 1e-5 (packed sequences
  attending densely, or over block pairs of 8)."""
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices (tests/conftest.py forces 8 host devices)")
  one = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  split = sharding.make_mesh({"data": 1, "fsdp": 2, "sequence": 4, "tensor": 1})
  assert dict(split.shape)["sequence"] == 4
  batch = long_tail_batch()
  pg = objectives.PGConfig(kl_coef=0.1)
  params0 = jax.device_get(_trainer(CFG, pg, one).init(jax.random.key(0)).params)
  runs = []
  for mesh in (one, split):
    parts = (packing.packed_microbatches(batch, max_tokens=64, shards=sharding.batch_shards(mesh.shape),
                                         block=0 if packed is True else packed) if packed else [batch])
    runs.append(_two_steps(_trainer(CFG, pg, mesh), params0, parts))
  _assert_same_update(*runs)


@pytest.mark.parametrize("chunk", [0, 8])
def test_ring_attention_over_the_sequence_axis_equals_the_unsharded_update(chunk):
  """`model.sequence_attention="ring"`: each shard's keys and values go around mesh.sequence = 4 instead of
  being gathered (a sliding-window layer, query blocks of `attn_chunk` or none); two packed updates on
  (fsdp 2, sequence 4) give the metrics and params of one device's dense update to 1e-5."""
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices (tests/conftest.py forces 8 host devices)")
  one = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  split = sharding.make_mesh({"data": 1, "fsdp": 2, "sequence": 4, "tensor": 1})
  cfg = dataclasses.replace(CFG, local_layers=(0,), sliding_window=24, attn_chunk=chunk)
  batch = long_tail_batch()
  pg = objectives.PGConfig(kl_coef=0.1)
  params0 = jax.device_get(_trainer(cfg, pg, one).init(jax.random.key(0)).params)
  runs = []
  for mesh, how in ((one, "gather"), (split, "ring")):
    parts = packing.packed_microbatches(batch, max_tokens=64, shards=sharding.batch_shards(mesh.shape), block=0)
    runs.append(_two_steps(_trainer(dataclasses.replace(cfg, sequence_attention=how), pg, mesh), params0, parts))
  _assert_same_update(*runs)


def test_the_sequence_axis_and_query_blocks_bound_a_long_rows_update_memory():
  """One row of 4,096 tokens: the compiled update's temporary memory per device (XLA's own memory
  analysis) on mesh.sequence = 4 is about a quarter of one device's (each device holds its quarter
  of the queries and their scores; the keys and values are gathered whole); `model.attn_chunk` cuts
  it further, in the rows layout and the shared-prompt one."""
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 devices (tests/conftest.py forces 8 host devices)")
  cfg = testing.tiny_model_config(vocab_size=64, embed_dim=64, mlp_dim=128)
  T, C = 4096, 4032
  rng = np.random.default_rng(0)
  batch = RLBatch(tokens_BT=rng.integers(4, 60, size=(1, T)).astype(np.int32), mask_BT=np.ones((1, T), bool),
                  loss_mask_BC=np.ones((1, C), bool), old_logp_BC=np.zeros((1, C), np.float32),
                  adv_B=np.ones(1, np.float32), ref_logp_BC=np.zeros((1, C), np.float32))
  temp = []
  for shape, n in (({"data": 1, "fsdp": 1, "tensor": 1}, 1), ({"data": 1, "fsdp": 1, "sequence": 4, "tensor": 1}, 4)):
    trainer = _trainer(cfg, objectives.PGConfig(), sharding.make_mesh(shape, jax.devices()[:n]))
    temp.append(trainer.compiled_step_memory(trainer.put_batch(batch)).temp_size_in_bytes)
  assert temp[1] < 0.3 * temp[0], temp
  # Query blocks bound the scores of the update's rows too (P + C - 1 = 4,095 tokens: the last block
  # padded), in both layouts, and compose with the sequence axis.
  for G in (0, 1):
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    blocks = _trainer(dataclasses.replace(cfg, attn_chunk=512), objectives.PGConfig(group_size=G), mesh)
    assert blocks.compiled_step_memory(blocks.put_batch(batch)).temp_size_in_bytes < 0.2 * temp[0]


def test_a_moes_load_statistics_count_a_shared_prompt_once_per_row():
  """Rows sharing prompts, packed: the routers' statistics (and the load-balancing loss) weigh a
  shared trunk by the rows that read it, as the padded rows count each row's prompt."""
  for G, prefix in ((2, 0), (4, 0), (2, 3)):  # (2, 3): prompts that also begin alike share that beginning
    batch = long_tail_batch(shared=G, prefix=prefix)
    obj = objectives.policy_gradient(MOE, objectives.PGConfig())
    parts = packing.packed_microbatches(batch, max_tokens=256)
    assert len(parts) == 1 and int(parts[0].packed.rows_MT.max()) > 1  # one micro-batch: the loss is one's
    _assert_parts_make_the_batch(obj, batch, parts, MOE)
