"""Attention in packed sequences: the block pairs by hand, attention over them against dense masked
attention, and local layers windowed by position in branches (against the padded rows)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from packing_test import CFG, MOE, _assert_parts_make_the_batch, long_tail_batch

from dapo_jax import objectives, packing
from dapo_jax.model import layers
from dapo_jax.model.packed_attention import Segments, attend_blocks


def test_block_pairs_by_hand():
  # One sequence of 16 positions in blocks of 4: segment 1 is a trunk [0, 3) and branches [3, 7),
  # [7, 10); segment 2 a lone row [10, 14); padding [14, 16).
  seg = np.array([[1] * 10 + [2] * 4 + [0] * 2])
  br = np.array([[0] * 3 + [1] * 4 + [2] * 3 + [0] * 4 + [0] * 2])
  q, k = packing.block_pairs(seg, (seg > 0).astype(int), br, 4)
  pairs = sorted((int(i), int(j)) for i, j in zip(q[0], k[0]) if i >= 0)
  # Block 0 (trunk, branch 1): itself. Block 1 (branch 1, branch 2): itself, block 0 (trunk, branch 1's
  # start). Block 2 (branch 2 then segment 2): branch 2 began in block 1, its trunk is block 0; segment
  # 2 starts in block 2. Block 3 (segment 2, padding): blocks 2 and 3.
  assert pairs == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (3, 2), (3, 3)]
  assert q.shape == (1, 8) and (q[0] >= 0).sum() == 8  # 8 pairs: a multiple of the 4 blocks.
  assert q.dtype == k.dtype == np.int32


def _segments(parts, block):
  return [Segments.of(p.packed) for p in parts if p.packed.block == block]


@pytest.mark.parametrize("window,softcap,chunk", [(None, 0.0, 0), (5, 0.0, 0), (None, 3.0, 0), (None, 0.0, 8)],
                         ids=["plain", "window", "softcap", "chunked"])
def test_attention_over_block_pairs_is_dense_masked_attention(window, softcap, chunk):
  """Random queries, keys and values over the packings of a long-tailed batch (groups of 4 sharing a
  prompt): values and gradients at every real query equal `layers.attend_rows` under the dense mask."""
  batch = long_tail_batch(shared=4)
  parts = packing.packed_microbatches(batch, max_tokens=64, block=4)
  rng = np.random.default_rng(0)
  K, R, H = 2, 2, 8
  for seg in _segments(parts, 4):
    B, T = seg.segments_BT.shape
    q = jnp.asarray(rng.normal(size=(B, T, K, R, H)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32) for _ in range(2))
    real = np.asarray(seg.real_BT())[..., None, None, None]
    w = jnp.asarray(rng.normal(size=(B, T, K, R, H)), jnp.float32) * real  # Only real queries count.

    def dense(q, k, v):
      return jnp.sum(w * layers.attend_rows(q, k, v, seg.dense_mask(window), softcap=softcap))

    def blocks(q, k, v):
      return jnp.sum(w * attend_blocks(q, k, v, seg, window, chunk=chunk, softcap=softcap))

    out_d = layers.attend_rows(q, k, v, seg.dense_mask(window), softcap=softcap)
    out_b = attend_blocks(q, k, v, seg, window, chunk=chunk, softcap=softcap)
    np.testing.assert_allclose(np.asarray(out_b) * real, np.asarray(out_d) * real, rtol=1e-5, atol=1e-6)
    for g_d, g_b in zip(jax.grad(dense, (0, 1, 2))(q, k, v), jax.grad(blocks, (0, 1, 2))(q, k, v)):
      np.testing.assert_allclose(g_b, g_d, rtol=1e-4, atol=1e-6)
  assert len(_segments(parts, 4)) == 2


def test_a_local_layer_windows_a_branch_by_position():
  """A sliding window counts positions, not sequence indices: a branch's position continues its trunk's
  with other branches between them. Index distance would cut keys the padded rows see."""
  batch = long_tail_batch(shared=4)
  seg = Segments.of(packing.packed_microbatches(batch, max_tokens=64)[0].packed)
  by_index = layers.windowed(seg.dense_mask(), 6)
  assert not np.array_equal(np.asarray(seg.dense_mask(6)), np.asarray(by_index))


@pytest.mark.parametrize("block", [0, 4, 8])
def test_packed_rows_of_a_model_with_local_layers_give_the_padded_loss_and_gradients(block):
  """Gemma 3's pattern (a local layer of window 6 among global ones), groups of 4 sharing a prompt:
  the objective over packed micro-batches (dense, or over block pairs) is the padded batch's."""
  cfg = dataclasses.replace(CFG, local_layers=(0,), sliding_window=6)
  batch = long_tail_batch(shared=4)
  obj = objectives.policy_gradient(cfg, objectives.PGConfig())
  parts = packing.packed_microbatches(batch, max_tokens=64, block=block)
  assert any(int(p.packed.branches_MT.max()) > 1 for p in parts)
  _assert_parts_make_the_batch(obj, batch, parts, cfg)


@pytest.mark.parametrize("name", ["token_mean", "seq_mean_token_sum", "gspo", "moe"])
def test_packed_rows_over_block_pairs_give_the_padded_loss_and_gradients(name):
  """Sequences of the whole budget attending over block pairs: loss, metrics, gradient of the padded
  batch, with rows alone and groups of 2 sharing a prompt, and for Qwen3-MoE (rows alone: its
  load-balancing loss counts a shared prompt's tokens once per sequence, docs/packing.md)."""
  cfg, pg = CFG, dict(loss_agg=name) if name.startswith("seq") else dict(policy_loss=name) if name == "gspo" else {}
  if name == "moe":
    cfg = MOE
  for G in ((1,) if name == "moe" else (1, 2)):
    batch = long_tail_batch(shared=G)
    obj = objectives.policy_gradient(cfg, objectives.PGConfig(**pg))
    parts = packing.packed_microbatches(batch, max_tokens=256 if name == "moe" else 64, block=8)
    assert all(p.packed.block == 8 and p.packed.tokens_MT.shape[0] == 1 for p in parts)
    _assert_parts_make_the_batch(obj, batch, parts, cfg)
