"""The KV cache: an explicit pytree that the decoder reads and returns.

Layout (one buffer per layer, so a decode step writes and reads each layer's buffer in place;
slicing one stacked [L, ...] array would copy a layer's whole cache on every token):
  k:      L arrays [B, K, H, S]  keys at cache slot s (slot = absolute index into the left-padded
                                 prompt followed by the decoded tokens)
  v:      L arrays [B, K, S, H]  values at cache slot s
                                 Both attention matmuls are then batched over (B, K) and contract
                                 a non-minor axis of the cache: no transposed copy per token.
  mask:   [B, S] bool            slot s holds a real token (prompt padding and unwritten slots: False)
A query written at slot i attends to every slot j <= i with mask[b, j].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
  k: list[jax.Array]   # L x [B, K, H, S]
  v: list[jax.Array]   # L x [B, K, S, H]
  mask_BS: jax.Array

  @property
  def size(self) -> int:
    return self.mask_BS.shape[1]


def from_prompt(k_LBKPH: jax.Array, v_LBKPH: jax.Array, prompt_mask_BP: jax.Array, size: int) -> KVCache:
  """A cache of `size` slots whose first P hold a prefilled prompt's keys and values."""
  P = k_LBKPH.shape[3]
  pad = ((0, 0), (0, 0), (0, size - P), (0, 0))
  k = [jnp.pad(x_BKPH, pad).swapaxes(2, 3) for x_BKPH in k_LBKPH]
  v = [jnp.pad(x_BKPH, pad) for x_BKPH in v_LBKPH]
  mask_BS = jnp.pad(prompt_mask_BP.astype(bool), ((0, 0), (0, size - P)))
  return KVCache(k, v, mask_BS)


def write_mask(cache: KVCache, new_mask_BT: jax.Array, index: jax.Array) -> KVCache:
  """Marks the slots [index, index + T) as holding the given tokens."""
  mask_BS = jax.lax.dynamic_update_slice(cache.mask_BS, new_mask_BT.astype(bool), (0, index))
  return cache.replace(mask_BS=mask_BS)


def update(k_BKHS: jax.Array, v_BKSH: jax.Array, new_k_BKTH: jax.Array, new_v_BKTH: jax.Array,
           index: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Writes one layer's T new keys/values at slots [index, index + T); `index` is one slot for every
  row, or one per row ([B], T = 1: rows of a continuous batch sit at their own positions)."""
  if jnp.ndim(index) == 0:
    return (jax.lax.dynamic_update_slice(k_BKHS, new_k_BKTH.swapaxes(2, 3).astype(k_BKHS.dtype), (0, 0, 0, index)),
            jax.lax.dynamic_update_slice(v_BKSH, new_v_BKTH.astype(v_BKSH.dtype), (0, 0, index, 0)))
  rows_B = jnp.arange(k_BKHS.shape[0])
  return (k_BKHS.at[rows_B, :, :, index].set(new_k_BKTH[:, :, 0].astype(k_BKHS.dtype)),
          v_BKSH.at[rows_B, :, index, :].set(new_v_BKTH[:, :, 0].astype(v_BKSH.dtype)))


def write_row(cache: KVCache, row: jax.Array, start: int, k_LKPH: jax.Array, v_LKPH: jax.Array,
              mask_S: jax.Array) -> KVCache:
  """Fills one whole cache row (a continuous batch's freed slot) in place: keys and values of P
  positions at slots [start, start + P) and the row's mask."""
  k = [jax.lax.dynamic_update_slice(x, new.swapaxes(1, 2)[None].astype(x.dtype), (row, 0, 0, start))
       for x, new in zip(cache.k, k_LKPH)]
  v = [jax.lax.dynamic_update_slice(x, new[None].astype(x.dtype), (row, 0, start, 0)) for x, new in zip(cache.v, v_LKPH)]
  return KVCache(k, v, jax.lax.dynamic_update_slice(cache.mask_BS, mask_S[None], (row, 0)))


def write_mask_rows(cache: KVCache, write_B: jax.Array, index_B: jax.Array) -> KVCache:
  """Marks slot index_B[b] of each row b where write_B[b] (one new token per row)."""
  rows_B = jnp.arange(cache.mask_BS.shape[0])
  return cache.replace(mask_BS=cache.mask_BS.at[rows_B, index_B].set(cache.mask_BS[rows_B, index_B] | write_B))
