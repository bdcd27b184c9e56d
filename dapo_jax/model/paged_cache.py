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
gather (`read`) is the reference path, runnable on every backend.

`attend` reads the pages in place instead, ragged (as the peers' paged-attention kernels do): only
the pages that hold a row's tokens, a chunk of (row, page) pairs at a time, each page's scores joining
its row's online softmax. Its cost follows the tokens the rows hold, not B x (P + C) positions, and
it never holds more than a chunk of pages' keys; it equals the gathered read to rounding (the softmax
is summed page by page), so the gather stays the bit-exact reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dapo_jax.model import layers

NULL_PAGE = 0  # Never written: the page of positions a row holds no token at.


@struct.dataclass
class PagedCache:
  k: list[jax.Array]   # L x [N, K, H, page]
  v: list[jax.Array]   # L x [N, K, page, H]
  table_BM: jax.Array  # int32 page of each logical page, an id within the row's shard's pool
  mask_BS: jax.Array   # [B, T] bool
  shards: int = struct.field(pytree_node=False, default=1)  # G: rows and pool pages split alike
  chunk_pages: int = struct.field(pytree_node=False, default=0)  # `attend`'s pages per chunk; 0 = `read`

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
          dtype, shards: int = 1, chunk_pages: int = 0) -> PagedCache:
  """A pool of `num_pages` zeroed pages per shard (each shard's page 0 its null page) and B rows of T
  positions holding none; decoding reads it by `attend`, `chunk_pages` pages at a time (0: by `read`)."""
  K, H, p, N = num_kv_heads, head_dim, page_size, shards * num_pages
  return PagedCache(k=[jnp.zeros((N, K, H, p), dtype) for _ in range(num_layers)],
                    v=[jnp.zeros((N, K, p, H), dtype) for _ in range(num_layers)],
                    table_BM=jnp.full((B, pages_per_row(T, p)), NULL_PAGE, jnp.int32),
                    mask_BS=jnp.zeros((B, T), bool), shards=shards, chunk_pages=chunk_pages)


def by_shard(x_N: jax.Array, G: int) -> jax.Array:
  """[N, ...] -> [G, N / G, ...]: shard g's block of rows (or pool pages) at [g]."""
  return x_N.reshape(G, x_N.shape[0] // G, *x_N.shape[1:])


def _gather(pool_N: jax.Array, table_BM: jax.Array, G: int) -> jax.Array:
  """pool_N[table_BM] [B, M, ...], each of the G shards' rows from its own block of the pool."""
  B, M = table_BM.shape
  gathered = jax.vmap(lambda pool_n, table_bM: pool_n[table_bM])(by_shard(pool_N, G), by_shard(table_BM, G))
  return gathered.reshape(B, M, *pool_N.shape[1:])


def read(k_NKHp: jax.Array, v_NKpH: jax.Array, table_BM: jax.Array, T: int, G: int = 1) -> tuple[jax.Array, jax.Array]:
  """One layer's dense view of every row, gathered through the table: keys [B, K, H, T], values [B, K, T, H].
  Each of the G shards' rows gathers from its own pool (the pages [g N/G, (g + 1) N/G))."""
  B, M = table_BM.shape
  _, K, H, p = k_NKHp.shape
  k_BMKHp, v_BMKpH = _gather(k_NKHp, table_BM, G), _gather(v_NKpH, table_BM, G)
  k_BKHMp = k_BMKHp.transpose(0, 2, 3, 1, 4)
  v_BKMpH = v_BMKpH.transpose(0, 2, 1, 3, 4)
  return k_BKHMp.reshape(B, K, H, M * p)[..., :T], v_BKMpH.reshape(B, K, M * p, H)[:, :, :T]


def attend(q_BKRH: jax.Array, k_NKHp: jax.Array, v_NKpH: jax.Array, table_BM: jax.Array, mask_BT: jax.Array,
           live_B: jax.Array, chunk_pages: int, G: int = 1, scale: float | None = None,
           softcap: float = 0.0) -> jax.Array:
  """One query per head of each row against the positions its mask marks, the pages read in place:
  [B, K, R, H]. Rows not `live_B` (ended: their pages may be another's by now) read nothing.

  Ragged, as the peers' paged-attention kernels are: the (row, page) pairs whose page holds a marked
  position are listed, and a loop takes them `chunk_pages` at a time, as many chunks as there are
  such pages (the work follows the tokens the rows hold, not B x M). Each page's scores (scaled by
  `scale`, default H**-0.5, soft-capped at `softcap`) join its row's online softmax in fp32:
  `layers.attention` over the gathered rows (`read`), to rounding."""
  B, M = table_BM.shape
  _, K, H, p = k_NKHp.shape
  R, T = q_BKRH.shape[2], mask_BT.shape[1]
  scale = H ** -0.5 if scale is None else scale
  low = jnp.finfo(jnp.float32).min  # A score no key has: exp(low - a real max) = 0, and no inf - inf.
  mask_BMp = jnp.pad(mask_BT, ((0, 0), (0, M * p - T))).reshape(B, M, p) & live_B[:, None, None]

  def shard(q_bKRH, k_nKHp, v_nKpH, table_bM, mask_bMp):
    b = table_bM.shape[0]
    live_X = mask_bMp.any(-1).reshape(b * M)  # X = b x M (row, page) pairs.
    (item_X,) = jnp.nonzero(live_X, size=b * M, fill_value=b * M)
    item_X = jnp.pad(item_X, (0, -(b * M) % chunk_pages), constant_values=b * M)
    page_X = jnp.append(table_bM.reshape(b * M), NULL_PAGE)[item_X]
    mask_Xp = jnp.append(mask_bMp.reshape(b * M, p), jnp.zeros((1, p), bool), axis=0)[item_X]
    row_X = item_X // M  # b for no pair: dropped by the segment sums.

    def step(c, carry):
      max_bKR, sum_bKR, out_bKRH = carry
      take = lambda x: jax.lax.dynamic_slice_in_dim(x, c * chunk_pages, chunk_pages)
      page_c, row_c, mask_cp = take(page_X), take(row_X), take(mask_Xp)
      q_cKRH = q_bKRH[jnp.minimum(row_c, b - 1)]
      scores_cKRp = jnp.einsum("cKRH,cKHp->cKRp", q_cKRH, k_nKHp[page_c], preferred_element_type=jnp.float32)
      live_c11p = mask_cp[:, None, None]
      scores_cKRp = jnp.where(live_c11p, layers.soft_cap(scores_cKRp * scale, softcap), low)
      max_cKR = scores_cKRp.max(-1)
      new_max_bKR = jnp.maximum(max_bKR, jax.ops.segment_max(max_cKR, row_c, num_segments=b))
      weight_cKR = jnp.exp(max_cKR - new_max_bKR[jnp.minimum(row_c, b - 1)])
      probs_cKRp = jnp.where(live_c11p, jnp.exp(scores_cKRp - max_cKR[..., None]), 0.0)
      out_cKRH = jnp.einsum("cKRp,cKpH->cKRH", probs_cKRp.astype(q_bKRH.dtype), v_nKpH[page_c],
                            preferred_element_type=jnp.float32)
      rescale_bKR = jnp.exp(max_bKR - new_max_bKR)
      sum_bKR = sum_bKR * rescale_bKR + jax.ops.segment_sum(probs_cKRp.sum(-1) * weight_cKR, row_c, b)
      out_bKRH = out_bKRH * rescale_bKR[..., None] + jax.ops.segment_sum(out_cKRH * weight_cKR[..., None], row_c, b)
      return new_max_bKR, sum_bKR, out_bKRH

    init = (jnp.full((b, K, R), low), jnp.zeros((b, K, R)), jnp.zeros((b, K, R, H)))
    chunks = -(-live_X.sum() // chunk_pages)
    _, sum_bKR, out_bKRH = jax.lax.fori_loop(0, chunks, step, init)
    return out_bKRH / jnp.where(sum_bKR > 0, sum_bKR, 1.0)[..., None]

  out_GbKRH = jax.vmap(shard)(*(by_shard(x, G) for x in (q_BKRH, k_NKHp, v_NKpH, table_BM, mask_BMp)))
  return out_GbKRH.reshape(B, K, R, H).astype(q_BKRH.dtype)


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
