"""Ring attention over the mesh's `sequence` axis (`model.sequence_attention="ring"`): packed sequences
whose tokens are split over S devices, each shard's queries against every shard's keys and values
without gathering them.

Each device keeps its own [T/S] queries, keys and values. In S steps it scores its queries against the
key/value block it holds (masked by `packed_attention.sees` on the blocks' ids), merges the block into
an online softmax, and passes the block to the next device (`ppermute`): after S steps every query has
seen every key once, and a device never holds more than two blocks. The backward pass is written out
(`jax.custom_vjp`): it keeps only the shard's inputs, output and log-sum-exp, and runs the ring again,
the keys' and values' gradients travelling with their block, so they reach their own device after S
steps. Autodiff through the loop would instead keep every block it saw: the gathered keys again.

Queries run in blocks of `chunk` (`model.attn_chunk`, 0 = all of a shard's) against each key block, so
the scores held are [B, K, R, chunk, T/S].
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dapo_jax import sharding
from dapo_jax.model import packed_attention


def attend(q_BTKRH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, segments: packed_attention.Segments,
           window=None, chunk: int = 0, scale: float | None = None) -> jax.Array:
  """Masked attention of packed sequences, [B, T, K, R, H], by a ring over the `sequence` axis of the
  current mesh (whole on one device: the same result)."""
  mesh = jax.sharding.get_abstract_mesh()
  H = q_BTKRH.shape[-1]
  scale = H ** -0.5 if scale is None else scale
  ids = segments.ids()
  if window is None:
    window = jnp.iinfo(jnp.int32).max
  window = jnp.asarray(window, jnp.int32)
  S = 1 if mesh.empty else mesh.shape.get("sequence", 1)
  T = q_BTKRH.shape[1]
  local = -(-T // S)  # A shard's tokens, whole query blocks: the sequence padded with padding tokens.
  if chunk and chunk < local:
    local = -(-local // chunk) * chunk
  pad = lambda x: jnp.pad(x, ((0, 0), (0, S * local - T)) + ((0, 0),) * (x.ndim - 2))
  q_BTKRH, k_BTKH, v_BTKH = pad(q_BTKRH), pad(k_BTKH), pad(v_BTKH)
  ids = tuple(pad(x) for x in ids)  # Segment 0: seen by nobody.
  if S == 1:
    return _ring(q_BTKRH, k_BTKH, v_BTKH, ids, window, scale, chunk, None, 1)[:, :T]
  has = lambda a: a if a in mesh.axis_names and mesh.shape[a] > 1 else None
  batch = tuple(a for a in sharding.BATCH_AXES if has(a)) or None
  tokens = P(batch, "sequence")
  q_spec, kv_spec = P(batch, "sequence", has("tensor")), P(batch, "sequence", has("tensor"))
  fn = functools.partial(_ring, scale=scale, chunk=chunk, axis="sequence", S=S)
  out = jax.shard_map(fn, in_specs=(q_spec, kv_spec, kv_spec, tuple(tokens for _ in ids), P()), out_specs=q_spec,
                      axis_names=set(mesh.axis_names), check_vma=False)(q_BTKRH, k_BTKH, v_BTKH, ids, window)
  return out[:, :T]


def _ring(q, k, v, ids, window, scale, chunk, axis, S):
  return _ring_vjp(scale, chunk, axis, S, q, k, v, ids, window)


def _shift(x, axis, S):
  """Each device's `x` to the next device of the ring (device i's to i + 1)."""
  if axis is None:
    return x
  return jax.lax.ppermute(x, axis, [(i, (i + 1) % S) for i in range(S)])


def _index(T: int, axis, S: int, step) -> jax.Array:
  """[T] sequence indices of the key block a device holds at `step` (its own at step 0)."""
  me = 0 if axis is None else jax.lax.axis_index(axis)
  return ((me - step) % S) * T + jnp.arange(T)


def _chunks(T: int, chunk: int) -> int:
  return T // chunk if chunk and T % chunk == 0 and chunk < T else 1


def _scores(q_BcKRH, k_BTKH, ids_q, idx_q, ids_k, idx_k, window, scale):
  """Masked fp32 scores [B, K, R, c, T] and their mask [B, 1, 1, c, T]."""
  # Tied to this layer's queries and keys: the mask alone is the same in every layer, and XLA would
  # otherwise compute every step's and block's ahead of the layers' loop (T x T bits, kept).
  q_BcKRH, k_BTKH, ids_q, idx_q, ids_k, idx_k = jax.lax.optimization_barrier(
      (q_BcKRH, k_BTKH, ids_q, idx_q, ids_k, idx_k))
  s = jnp.einsum("BcKRH,BSKH->BKRcS", q_BcKRH, k_BTKH, preferred_element_type=jnp.float32) * scale
  mask = packed_attention.sees(ids_q, idx_q, ids_k, idx_k, window)[:, None, None]
  return jnp.where(mask, s, -jnp.inf), mask


def _forward(scale, chunk, axis, S, q, k, v, ids, window):
  """(out [B, T, K, R, H], log-sum-exp [B, K, R, T]: -inf for a query that sees nothing)."""
  B, T, K, R, H = q.shape
  n = _chunks(T, chunk)
  c = T // n
  me = 0 if axis is None else jax.lax.axis_index(axis)
  idx_q = jnp.broadcast_to(me * T + jnp.arange(T), (B, T))
  split = lambda x: jnp.moveaxis(x.reshape(B, n, c, *x.shape[2:]), 1, 0)  # [n, B, c, ...]
  q_n, idx_n, ids_n = split(q), split(idx_q), tuple(split(x) for x in ids)

  def step(carry, s):
    m, l, o, k_blk, v_blk, ids_k = carry
    idx_k = jnp.broadcast_to(_index(T, axis, S, s), (B, T))

    def per_chunk(args):
      q_c, idx_c, ids_c, m_c, l_c, o_c = args
      s_c, _ = _scores(q_c, k_blk, ids_c, idx_c, ids_k, idx_k, window, scale)
      m_new = jnp.maximum(m_c, jnp.max(s_c, axis=-1))
      finite = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      p = jnp.exp(s_c - finite[..., None])
      keep = jnp.exp(m_c - finite)
      l_new = l_c * keep + p.sum(-1)
      o_new = o_c * keep[..., None] + jnp.einsum("BKRcS,BSKH->BKRcH", p.astype(v_blk.dtype), v_blk,
                                                 preferred_element_type=jnp.float32)
      return m_new, l_new, o_new

    m, l, o = jax.lax.map(per_chunk, (q_n, idx_n, ids_n, m, l, o))
    k_blk, v_blk, ids_k = _shift((k_blk, v_blk, ids_k), axis, S)
    return (m, l, o, k_blk, v_blk, ids_k), None

  init = (jnp.full((n, B, K, R, c), -jnp.inf), jnp.zeros((n, B, K, R, c)), jnp.zeros((n, B, K, R, c, H)), k, v, ids)
  (m, l, o, *_), _ = jax.lax.scan(step, init, jnp.arange(S))
  out = o / jnp.where(l > 0, l, 1.0)[..., None]  # [n, B, K, R, c, H]
  lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
  out = jnp.moveaxis(out, 0, 1).transpose(0, 1, 4, 2, 3, 5).reshape(B, T, K, R, H)
  lse = jnp.moveaxis(lse, 0, 3).reshape(B, K, R, T)
  return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ring_vjp(scale, chunk, axis, S, q, k, v, ids, window):
  return _forward(scale, chunk, axis, S, q, k, v, ids, window)[0]


def _ring_fwd(scale, chunk, axis, S, q, k, v, ids, window):
  out, lse = _forward(scale, chunk, axis, S, q, k, v, ids, window)
  return out, (q, k, v, ids, window, out, lse)


def _ring_bwd(scale, chunk, axis, S, res, d_out):
  q, k, v, ids, window, out, lse = res
  B, T, K, R, H = q.shape
  n = _chunks(T, chunk)
  c = T // n
  me = 0 if axis is None else jax.lax.axis_index(axis)
  idx_q = jnp.broadcast_to(me * T + jnp.arange(T), (B, T))
  split = lambda x: jnp.moveaxis(x.reshape(B, n, c, *x.shape[2:]), 1, 0)
  heads = lambda x: jnp.moveaxis(x.reshape(B, K, R, n, c), 3, 0)  # [B, K, R, T] -> [n, B, K, R, c]
  d_out = d_out.astype(jnp.float32)
  delta = jnp.einsum("BTKRH,BTKRH->BKRT", d_out, out.astype(jnp.float32))  # rowsum(dO * O)
  q_n, do_n, idx_n, ids_n = split(q), split(d_out), split(idx_q), tuple(split(x) for x in ids)
  lse_n, delta_n = heads(lse), heads(delta)

  def step(carry, s):
    dq, k_blk, v_blk, ids_k, dk, dv = carry
    idx_k = jnp.broadcast_to(_index(T, axis, S, s), (B, T))

    def per_chunk(acc, args):
      dk, dv = acc
      q_c, do_c, idx_c, ids_c, lse_c, delta_c = args
      s_c, _ = _scores(q_c, k_blk, ids_c, idx_c, ids_k, idx_k, window, scale)
      p = jnp.exp(s_c - jnp.where(jnp.isfinite(lse_c), lse_c, 0.0)[..., None])  # 0 where masked
      dv = dv + jnp.einsum("BKRcS,BcKRH->BSKH", p, do_c)
      dp = jnp.einsum("BcKRH,BSKH->BKRcS", do_c, v_blk.astype(jnp.float32))
      ds = p * (dp - delta_c[..., None]) * scale
      dq_c = jnp.einsum("BKRcS,BSKH->BcKRH", ds, k_blk.astype(jnp.float32))
      dk = dk + jnp.einsum("BKRcS,BcKRH->BSKH", ds, q_c.astype(jnp.float32))
      return (dk, dv), dq_c

    (dk, dv), dq_n = jax.lax.scan(per_chunk, (dk, dv), (q_n, do_n, idx_n, ids_n, lse_n, delta_n))
    dq = dq + jnp.moveaxis(dq_n, 0, 1).reshape(B, T, K, R, H)
    k_blk, v_blk, ids_k, dk, dv = _shift((k_blk, v_blk, ids_k, dk, dv), axis, S)  # Gradients travel along.
    return (dq, k_blk, v_blk, ids_k, dk, dv), None

  zeros_kv = jnp.zeros(k.shape, jnp.float32)
  init = (jnp.zeros(q.shape, jnp.float32), k, v, ids, zeros_kv, zeros_kv)
  (dq, _, _, _, dk, dv), _ = jax.lax.scan(step, init, jnp.arange(S))
  zero_ids = tuple(None for _ in ids)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), zero_ids, None


_ring_vjp.defvjp(_ring_fwd, _ring_bwd)
