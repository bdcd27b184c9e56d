"""The paged KV cache: a pool of fixed-size pages per layer, and a page table per row.

A row's T positions are the dense cache's (`kv_cache`: a left-padded prompt, then the completion),
cut into M = ceil(T / page) logical pages; table[b, j] is the pool page that holds logical page j
of row b. Rows share pages (a prompt's, for all the samples of it), and a row holds pages only where
it has tokens: the rest of its table names the null page 0, all zeros, which the mask hides.

Layout (one pool per layer, like the dense cache's rows, so a decode step writes in place):
  k:      L arrays [N, K, H, page]  keys of pool page n (a page's positions minor, as the dense
                                    cache's [B, K, H, S])
  v:      L arrays [N, K, page, H]  its values (as [B, K, S, H])
  table:  [B, M] int32              pool page of each logical page of each row
  mask:   [B, T] bool               position t of row b holds a real token (the dense cache's mask)
A page is then a contiguous block of a dense row: gathering a row's pages in table order and
joining their position axes gives its dense cache exactly ([B, K, H, T] and [B, K, T, H]), which the
attention core reads unchanged, so paged and dense decoding compute the very same numbers. This
gather (`read`) is the reference path, runnable on every backend; a kernel that reads the pages in
place (the peers' paged attention) contracts the same axes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

NULL_PAGE = 0  # Never written: the page of positions a row holds no token at.


@struct.dataclass
class PagedCache:
  k: list[jax.Array]   # L x [N, K, H, page]
  v: list[jax.Array]   # L x [N, K, page, H]
  table_BM: jax.Array  # int32 pool page of each logical page
  mask_BS: jax.Array   # [B, T] bool

  @property
  def size(self) -> int:
    """T, the positions of a row (as `KVCache.size`)."""
    return self.mask_BS.shape[1]

  @property
  def page_size(self) -> int:
    return self.v[0].shape[2]

  @property
  def num_pages(self) -> int:
    return self.v[0].shape[0]


def pages_per_row(T: int, page_size: int) -> int:
  """M, the logical pages of a row of T positions."""
  return -(-T // page_size)


def empty(num_layers: int, num_pages: int, num_kv_heads: int, head_dim: int, page_size: int, B: int, T: int,
          dtype) -> PagedCache:
  """A pool of `num_pages` zeroed pages (page 0 the null page) and B rows of T positions holding none."""
  K, H, p = num_kv_heads, head_dim, page_size
  return PagedCache(k=[jnp.zeros((num_pages, K, H, p), dtype) for _ in range(num_layers)],
                    v=[jnp.zeros((num_pages, K, p, H), dtype) for _ in range(num_layers)],
                    table_BM=jnp.full((B, pages_per_row(T, p)), NULL_PAGE, jnp.int32),
                    mask_BS=jnp.zeros((B, T), bool))


def read(k_NKHp: jax.Array, v_NKpH: jax.Array, table_BM: jax.Array, T: int) -> tuple[jax.Array, jax.Array]:
  """One layer's dense view of every row, gathered through the table: keys [B, K, H, T], values [B, K, T, H]."""
  B, M = table_BM.shape
  _, K, H, p = k_NKHp.shape
  k_BKHMp = k_NKHp[table_BM].transpose(0, 2, 3, 1, 4)
  v_BKMpH = v_NKpH[table_BM].transpose(0, 2, 1, 3, 4)
  return k_BKHMp.reshape(B, K, H, M * p)[..., :T], v_BKMpH.reshape(B, K, M * p, H)[:, :, :T]


def update(k_NKHp: jax.Array, v_NKpH: jax.Array, table_BM: jax.Array, new_k_BKTH: jax.Array, new_v_BKTH: jax.Array,
           index_B: jax.Array, T: int) -> tuple[jax.Array, jax.Array]:
  """Writes one new key/value per row (T = 1) at position index_B[b], in page table[b, index // page] at
  offset index % page. A row whose index is T or more writes nothing (an ended row: its pages may be
  another row's by now)."""
  p = v_NKpH.shape[2]
  rows_B = jnp.arange(table_BM.shape[0])
  page_B = table_BM[rows_B, jnp.minimum(index_B // p, table_BM.shape[1] - 1)]
  page_B = jnp.where(index_B < T, page_B, k_NKHp.shape[0])  # Out of range: dropped.
  offset_B = index_B % p
  return (k_NKHp.at[page_B, :, :, offset_B].set(new_k_BKTH[:, :, 0].astype(k_NKHp.dtype), mode="drop"),
          v_NKpH.at[page_B, :, offset_B, :].set(new_v_BKTH[:, :, 0].astype(v_NKpH.dtype), mode="drop"))


def write_pages(cache: PagedCache, k_LUKPH: jax.Array, v_LUKPH: jax.Array, start: int, src_W: jax.Array,
                page_W: jax.Array, dst_W: jax.Array, n: jax.Array) -> PagedCache:
  """Copies prefilled prompts into the pool, in place: for w < n, logical page page_W[w] of prompt row
  src_W[w] (its P positions placed at [start, start + P) of a row, as `kv_cache.write_row` places them)
  into pool page dst_W[w]. The page's positions outside the prompt are written as zeros."""
  P, p = k_LUKPH.shape[3], cache.page_size

  def write(w, pools):
    ks, vs = pools
    pos_p = page_W[w] * p + jnp.arange(p) - start
    pos_p = jnp.where((pos_p >= 0) & (pos_p < P), pos_p, P)  # Out of range: filled with zeros.
    take = lambda x_KPH: jnp.take(x_KPH, pos_p, axis=1, mode="fill", fill_value=0)
    ks = [jax.lax.dynamic_update_slice(x, take(new[src_W[w]]).swapaxes(1, 2)[None].astype(x.dtype), (dst_W[w], 0, 0, 0))
          for x, new in zip(ks, k_LUKPH)]
    vs = [jax.lax.dynamic_update_slice(x, take(new[src_W[w]])[None].astype(x.dtype), (dst_W[w], 0, 0, 0))
          for x, new in zip(vs, v_LUKPH)]
    return ks, vs

  ks, vs = jax.lax.fori_loop(0, n, write, (cache.k, cache.v))
  return cache.replace(k=ks, v=vs)
