"""The KV cache: an explicit pytree that the model reads and returns.

Layout (one cache for the whole model, layers stacked so `nn.scan` slices it):
  k, v:   [L, B, S, K, H]  keys/values at cache slot s (slot = absolute index into the
                           left-padded prompt followed by the decoded tokens)
  mask:   [B, S] bool      slot s holds a real token (prompt padding and unwritten slots: False)
A query written at slot i attends to every slot j <= i with mask[b, j].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
  k_LBSKH: jax.Array
  v_LBSKH: jax.Array
  mask_BS: jax.Array

  @property
  def size(self) -> int:
    return self.mask_BS.shape[1]


def init(num_layers: int, batch: int, size: int, num_kv_heads: int, head_dim: int,
         dtype=jnp.float32) -> KVCache:
  shape = (num_layers, batch, size, num_kv_heads, head_dim)
  return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch, size), bool))


def write_mask(cache: KVCache, new_mask_BT: jax.Array, index: jax.Array) -> KVCache:
  """Marks the slots [index, index + T) as holding the given tokens."""
  mask_BS = jax.lax.dynamic_update_slice(cache.mask_BS, new_mask_BT.astype(bool), (0, index))
  return cache.replace(mask_BS=mask_BS)


def attention_mask(cache_mask_BS: jax.Array, index: jax.Array, num_queries: int) -> jax.Array:
  """[B, T, S] mask for T queries written at slots index..index+T-1: causal and real keys only."""
  q_T = index + jnp.arange(num_queries)
  causal_TS = jnp.arange(cache_mask_BS.shape[1])[None, :] <= q_T[:, None]
  return causal_TS[None, :, :] & cache_mask_BS[:, None, :]


def update(kv, new_k_BTKH: jax.Array, new_v_BTKH: jax.Array, layer: jax.Array, index: jax.Array):
  """Writes T new keys/values of one layer at slots [index, index + T); kv = (k_LBSKH, v_LBSKH)."""
  k_LBSKH, v_LBSKH = kv
  start = (layer, 0, index, 0, 0)
  return (jax.lax.dynamic_update_slice(k_LBSKH, new_k_BTKH[None].astype(k_LBSKH.dtype), start),
          jax.lax.dynamic_update_slice(v_LBSKH, new_v_BTKH[None].astype(v_LBSKH.dtype), start))


def layer(kv, layer: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(k_BSKH, v_BSKH) of one layer."""
  return tuple(jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False) for x in kv)
