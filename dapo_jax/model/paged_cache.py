"""The paged KV cache: a pool of fixed-size pages per layer, and a page table per row.

A row's T positions are the dense cache's (`kv_cache`: a left-padded prompt, then the completion),
cut into M = ceil(T / page) logical pages; table[b, j] is the pool page that holds logical page j
of row b. Rows share pages (a prompt's, for all the samples of it), and a row holds pages only where
it has tokens: the rest of its table names the null page 0, all zeros, which the mask hides.

The rows and the pool are split alike over the batch shards of a mesh (`shards`): rows [g B/G, (g + 1) B/G)
and pool pages [g N/G, (g + 1) N/G) are shard g's, on the same device, and a row's table names pages of its
shard's pool by their ids within it (each shard's page 0 its null page). Every read and write of a row then
touches its own device's pages only: the gathers and scatters below are batched over the shards.

Layout (one pool per layer, like the dense cache's rows, so a decode step writes in place):
  k:      L arrays [N, K, H, page]  keys of pool page n (a page's positions minor, as the dense
                                    cache's [B, K, H, S]); N = G shards x the pages of each
  v:      L arrays [N, K, page, H]  its values (as [B, K, S, H])
  table:  [B, M] int32              page (of its shard's pool) of each logical page of each row
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
  table_BM: jax.Array  # int32 page of each logical page, an id within the row's shard's pool
  mask_BS: jax.Array   # [B, T] bool
  shards: int = struct.field(pytree_node=False, default=1)  # G: rows and pool pages split alike

  @property
  def size(self) -> int:
    """T, the positions of a row (as `KVCache.size`)."""
    return self.mask_BS.shape[1]

  @property
  def page_size(self) -> int:
    return self.v[0].shape[2]

  @property
  def num_pages(self) -> int:
    """The pages of each shard's pool."""
    return self.v[0].shape[0] // self.shards


def pages_per_row(T: int, page_size: int) -> int:
  """M, the logical pages of a row of T positions."""
  return -(-T // page_size)


def empty(num_layers: int, num_pages: int, num_kv_heads: int, head_dim: int, page_size: int, B: int, T: int,
          dtype, shards: int = 1) -> PagedCache:
  """A pool of `num_pages` zeroed pages per shard (each shard's page 0 its null page) and B rows of T
  positions holding none."""
  K, H, p, N = num_kv_heads, head_dim, page_size, shards * num_pages
  return PagedCache(k=[jnp.zeros((N, K, H, p), dtype) for _ in range(num_layers)],
                    v=[jnp.zeros((N, K, p, H), dtype) for _ in range(num_layers)],
                    table_BM=jnp.full((B, pages_per_row(T, p)), NULL_PAGE, jnp.int32),
                    mask_BS=jnp.zeros((B, T), bool), shards=shards)


def by_shard(x_N: jax.Array, G: int) -> jax.Array:
  """[N, ...] -> [G, N / G, ...]: shard g's block of rows (or pool pages) at [g]."""
  return x_N.reshape(G, x_N.shape[0] // G, *x_N.shape[1:])


def read(k_NKHp: jax.Array, v_NKpH: jax.Array, table_BM: jax.Array, T: int, G: int = 1) -> tuple[jax.Array, jax.Array]:
  """One layer's dense view of every row, gathered through the table: keys [B, K, H, T], values [B, K, T, H].
  Each of the G shards' rows gathers from its own pool (the pages [g N/G, (g + 1) N/G))."""
  B, M = table_BM.shape
  _, K, H, p = k_NKHp.shape
  gather = jax.vmap(lambda pool_n, table_bM: pool_n[table_bM])
  k_BMKHp = gather(by_shard(k_NKHp, G), by_shard(table_BM, G)).reshape(B, M, K, H, p)
  v_BMKpH = gather(by_shard(v_NKpH, G), by_shard(table_BM, G)).reshape(B, M, K, p, H)
  k_BKHMp = k_BMKHp.transpose(0, 2, 3, 1, 4)
  v_BKMpH = v_BMKpH.transpose(0, 2, 1, 3, 4)
  return k_BKHMp.reshape(B, K, H, M * p)[..., :T], v_BKMpH.reshape(B, K, M * p, H)[:, :, :T]


def update(k_NKHp: jax.Array, v_NKpH: jax.Array, table_BM: jax.Array, new_k_BKTH: jax.Array, new_v_BKTH: jax.Array,
           index_B: jax.Array, T: int, G: int = 1) -> tuple[jax.Array, jax.Array]:
  """Writes one new key/value per row (T = 1) at position index_B[b], in page table[b, index // page] (of
  the row's shard's pool) at offset index % page. A row whose index is T or more writes nothing (an
  ended row: its pages may be another row's by now)."""
  N, p = v_NKpH.shape[0], v_NKpH.shape[2]
  rows_B = jnp.arange(table_BM.shape[0])
  page_B = table_BM[rows_B, jnp.minimum(index_B // p, table_BM.shape[1] - 1)]
  page_B = jnp.where(index_B < T, page_B, N // G)  # Out of the shard's range: dropped.
  offset_B = index_B % p

  def write(k_nKHp, v_nKpH, page_b, offset_b, new_k_bKH, new_v_bKH):
    return (k_nKHp.at[page_b, :, :, offset_b].set(new_k_bKH.astype(k_nKHp.dtype), mode="drop"),
            v_nKpH.at[page_b, :, offset_b, :].set(new_v_bKH.astype(v_nKpH.dtype), mode="drop"))

  k_GnKHp, v_GnKpH = jax.vmap(write)(*(by_shard(x, G) for x in (k_NKHp, v_NKpH, page_B, offset_B,
                                                                new_k_BKTH[:, :, 0], new_v_BKTH[:, :, 0])))
  return k_GnKHp.reshape(k_NKHp.shape), v_GnKpH.reshape(v_NKpH.shape)


def write_pages(cache: PagedCache, k_LUKPH: jax.Array, v_LUKPH: jax.Array, start: int, src_GW: jax.Array,
                page_GW: jax.Array, dst_GW: jax.Array, n: jax.Array) -> PagedCache:
  """Copies prefilled prompts into the pool, in place: for each shard g and w < n, logical page
  page_GW[g, w] of prompt row src_GW[g, w] (its P positions placed at [start, start + P) of a row, as
  `kv_cache.write_row` places them) into page dst_GW[g, w] of shard g's pool (out of its range: no
  write). The page's positions outside the prompt are written as zeros."""
  P, p, G = k_LUKPH.shape[3], cache.page_size, cache.shards

  def write_one(k_nKHp, v_nKpH, new_k_UKPH, new_v_UKPH, src, page, dst):
    pos_p = page * p + jnp.arange(p) - start
    pos_p = jnp.where((pos_p >= 0) & (pos_p < P), pos_p, P)  # Out of range: filled with zeros.
    take = lambda x_KPH: jnp.take(x_KPH, pos_p, axis=1, mode="fill", fill_value=0)
    return (k_nKHp.at[dst].set(take(new_k_UKPH[src]).swapaxes(1, 2).astype(k_nKHp.dtype), mode="drop"),
            v_nKpH.at[dst].set(take(new_v_UKPH[src]).astype(v_nKpH.dtype), mode="drop"))

  write_shards = jax.vmap(write_one, in_axes=(0, 0, None, None, 0, 0, 0))

  def write(w, pools):
    ks, vs = pools
    out = [write_shards(by_shard(k, G), by_shard(v, G), new_k, new_v, src_GW[:, w], page_GW[:, w], dst_GW[:, w])
           for k, v, new_k, new_v in zip(ks, vs, k_LUKPH, v_LUKPH)]
    return [k.reshape(ks[0].shape) for k, _ in out], [v.reshape(vs[0].shape) for _, v in out]

  ks, vs = jax.lax.fori_loop(0, n, write, (cache.k, cache.v))
  return cache.replace(k=ks, v=vs)
