"""Attention inside packed sequences (`datatypes.PackedRows`): which key a query sees, and attention
that computes only the (query block, key block) pairs where some query sees some key.

A packed sequence holds segments: one per row, per prompt whose rows share it, or one for the whole
sequence when its prompts begin alike. A segment is a tree of runs: the prompts' shared beginning
(prompt 0), each prompt's part (prompt 1, 2, ...), in which a trunk (branch 0) and branches (1, 2,
...), each branch seeing the trunk and itself. Query t sees key s iff both are in one segment and
either s <= t, s is in the shared beginning or in t's prompt part, there in the trunk or in t's branch,
or both are in one image (a vision-language model's: its tokens see each other both ways, as
`vision.image_attention` opens them in rows); and, in a local layer, s is fewer than `window`
*positions* behind t: a branch's positions continue its trunk's although other branches may lie
between them in the sequence, so index distance is not position distance here (the rows layout's
`layers.windowed` assumes it is).

Dense masked attention costs T^2 per sequence whatever its segments. With a block pair list
(`packing.block_pairs`, made on the host, where the packing is known) the sequence is cut into blocks
of c tokens and only the listed pairs are computed, each pair's scores [c, c] under the mask; a
query block's pairs are merged by an online softmax (the running maximum, sum and weighted values of
flash attention), so the result is the dense softmax's. The cost is then the pairs', about the
segments' own causal pairs plus half a block per token, whatever the sequence's length: a sequence
may hold the whole token budget.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dapo_jax.model import layers as layers_lib


@struct.dataclass
class Segments:
  """A packed micro-batch's layout, as attention reads it ([B, T] each: `PackedRows`' fields)."""
  segments_BT: jax.Array    # int32: 1.. = the segment in its sequence; 0 = padding
  prompts_BT: jax.Array     # int32: 0 = the segment's shared beginning, k = its k-th prompt's part
  branches_BT: jax.Array    # int32: 0 = the part's trunk, k = its k-th branch
  positions_BT: jax.Array   # int32: the token's position in its row
  # int32 [B, P]: the (query block, key block) pairs to compute, -1 = none; None: dense attention.
  query_block_BP: jax.Array | None = None
  key_block_BP: jax.Array | None = None
  # int32: the rows that read each token (a shared trunk or beginning: several); None: one per real token.
  rows_BT: jax.Array | None = None
  images_BT: jax.Array | None = None  # int32: each image's tokens' number (0 = text); None: no images
  block: int = struct.field(pytree_node=False, default=0)  # tokens per block

  @classmethod
  def of(cls, packed) -> "Segments":
    """The layout of a `PackedRows`."""
    return cls(packed.segments_MT, packed.prompts_MT, packed.branches_MT, packed.positions_MT,
               packed.query_block_MP, packed.key_block_MP, packed.rows_MT, packed.image_MT, packed.block)

  def real_BT(self) -> jax.Array:
    """Each token's weight in per-row statistics (the routers' loads): the rows that read it, as the
    padded layouts count a shared prompt once per row; 0 for padding."""
    if self.rows_BT is not None:
      return self.rows_BT
    return self.segments_BT > 0

  def ids(self) -> tuple:
    """What `sees` reads of each token: (segment, prompt, branch, position[, image])."""
    ids = (self.segments_BT, self.prompts_BT, self.branches_BT, self.positions_BT)
    return ids if self.images_BT is None else ids + (self.images_BT,)

  def dense_mask(self, window=None) -> jax.Array:
    """[B, T, T] bool: query t sees key s (the module docstring's rule)."""
    idx_BT = jnp.broadcast_to(jnp.arange(self.segments_BT.shape[1]), self.segments_BT.shape)
    return sees(self.ids(), idx_BT, self.ids(), idx_BT, window)


def sees(ids_q, idx_q, ids_k, idx_k, window=None) -> jax.Array:
  """[..., Tq, Tk] bool from the queries' (segment, prompt, branch, position[, image]) [..., Tq] and
  sequence index idx_q, and the keys' [..., Tk]: the module docstring's rule."""
  (seg_q, pr_q, br_q, pos_q, *image_q), (seg_k, pr_k, br_k, pos_k, *image_k) = ids_q, ids_k
  q = lambda x: x[..., :, None]
  k = lambda x: x[..., None, :]
  in_part = (q(pr_q) == k(pr_k)) & ((k(br_k) == 0) | (q(br_q) == k(br_k)))
  seen = (k(idx_k) <= q(idx_q)) & ((k(pr_k) == 0) | in_part)
  if image_q:
    seen |= (q(image_q[0]) == k(image_k[0])) & k(image_k[0] > 0)
  out = (q(seg_q) == k(seg_k)) & k(seg_k > 0) & seen
  if window is not None:
    out &= q(pos_q) - k(pos_k) < window
  return out


def attend_blocks(q_BTKRH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, segments: Segments, window=None,
                  chunk: int = 0, scale: float | None = None, softcap: float = 0.0, impl: str = "einsum") -> jax.Array:
  """Attention of packed sequences over `segments`' block pairs, [B, T, K, R, H]: each pair's masked
  scores, merged per query block by an online softmax. All pairs at once, or, with `chunk`
  (`model.attn_chunk`), in steps of as many pairs as `chunk` queries' dense scores would hold (with
  the pairs' blocks), each step rematerialised. A query that sees no key (padding) gets 0. Always
  einsum, whatever `impl` (`jax.nn.dot_product_attention` has no pair lists)."""
  del impl
  B, T, K, R, H = q_BTKRH.shape
  c = segments.block
  n, P = T // c, segments.query_block_BP.shape[1]
  # Pairs per step: as many as hold what `chunk` queries' dense scores would, the pairs' gathered query,
  # key, value and output blocks counted with their scores.
  per_pair = c * K * R * (c + 2 * H) + 2 * c * K * H
  g = min(P, max(1, chunk * T * K * R // per_pair)) if chunk else P
  steps = -(-P // g)
  pad = lambda x: jnp.pad(x, ((0, 0), (0, steps * g - P)), constant_values=-1)
  pairs_SBg = tuple(jnp.moveaxis(pad(x).reshape(B, steps, g), 1, 0)
                    for x in (segments.query_block_BP, segments.key_block_BP))
  blocks = lambda x: x.reshape(B, n, c, *x.shape[2:])  # [B, T, ...] -> [B, n, c, ...]
  q_BncKRH, k_BncKH, v_BncKH = blocks(q_BTKRH), blocks(k_BTKH), blocks(v_BTKH)
  ids_Bnc = tuple(blocks(x) for x in segments.ids())
  at = jax.vmap(lambda x, i: x[i])  # Per row: [n, c, ...] at g block numbers -> [g, c, ...]
  into = jax.vmap(lambda acc, i, x: acc.at[i].add(x))  # Per row: [n, ...] += [g, ...] at g block numbers
  scale = H ** -0.5 if scale is None else scale

  def step(carry, pairs):
    m_BnKRc, l_BnKRc, o_BnKRcH = carry
    qi_Bg, kj_Bg = pairs
    listed_Bg = qi_Bg >= 0
    qi_Bg, kj_Bg = jnp.maximum(qi_Bg, 0), jnp.maximum(kj_Bg, 0)
    idx = lambda b: b[:, :, None] * c + jnp.arange(c)[None, None]  # [B, g, c]: the blocks' sequence indices
    mask_BgQS = sees(tuple(at(x, qi_Bg) for x in ids_Bnc), idx(qi_Bg),
                     tuple(at(x, kj_Bg) for x in ids_Bnc), idx(kj_Bg), window) & listed_Bg[:, :, None, None]
    s_BgKRQS = jnp.einsum("BgQKRH,BgSKH->BgKRQS", at(q_BncKRH, qi_Bg), at(k_BncKH, kj_Bg),
                          preferred_element_type=jnp.float32)
    s_BgKRQS = layers_lib.soft_cap(s_BgKRQS * scale, softcap)
    mask_BgKRQS = mask_BgQS[:, :, None, None]
    # The running maximum only keeps exp() finite; the result does not depend on it, so no gradient.
    m_BgKRQ = jax.lax.stop_gradient(jnp.max(jnp.where(mask_BgKRQS, s_BgKRQS, -jnp.inf), axis=-1))
    m_new = jnp.maximum(m_BnKRc, jax.vmap(lambda acc, i, x: acc.at[i].max(x))(
        jnp.full_like(m_BnKRc, -jnp.inf), qi_Bg, m_BgKRQ))
    finite = lambda m: jnp.where(jnp.isfinite(m), m, 0.0)
    keep_BnKRc = jnp.exp(m_BnKRc - finite(m_new))  # 0 where nothing was seen before
    p_BgKRQS = jnp.exp(jnp.where(mask_BgKRQS, s_BgKRQS, -jnp.inf) - finite(at(m_new, qi_Bg))[..., None])
    o_BgKRQH = jnp.einsum("BgKRQS,BgSKH->BgKRQH", p_BgKRQS.astype(v_BTKH.dtype), at(v_BncKH, kj_Bg),
                          preferred_element_type=jnp.float32)
    l_new = l_BnKRc * keep_BnKRc + into(jnp.zeros_like(l_BnKRc), qi_Bg, p_BgKRQS.sum(-1))
    o_new = o_BnKRcH * keep_BnKRc[..., None] + into(jnp.zeros_like(o_BnKRcH), qi_Bg, o_BgKRQH)
    return (m_new, l_new, o_new), None

  init = (jnp.full((B, n, K, R, c), -jnp.inf), jnp.zeros((B, n, K, R, c)), jnp.zeros((B, n, K, R, c, H)))
  (_, l_BnKRc, o_BnKRcH), _ = jax.lax.scan(jax.checkpoint(step) if steps > 1 else step, init, pairs_SBg)
  out_BnKRcH = o_BnKRcH / jnp.where(l_BnKRc > 0, l_BnKRc, 1.0)[..., None]
  return out_BnKRcH.transpose(0, 1, 4, 2, 3, 5).reshape(B, T, K, R, H).astype(q_BTKRH.dtype)
