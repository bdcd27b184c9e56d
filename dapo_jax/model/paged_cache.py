"""The paged KV cache: a pool of fixed-size pages per layer, and a page table per row.

A row's tokens are numbered from its first: token c (its position, as the rotary embedding counts it)
lies in logical page c // page at offset c % page, and table[b, j] is the pool page that holds row b's
logical page j. Beside the table a row keeps the dense cache's mask over its T dense positions
(`kv_cache`: the left-padded prompt, then the completion): which positions hold a token, and which its
query attends to (a sliding window's mask marks fewer); the marked position t holds token number
(marked positions before t) (`token_index`).

Numbering the tokens from each row's first, rather than by dense position, makes a page what the
peers' pages are: page j of any prompt holds its tokens [j page, (j + 1) page) whatever its padding,
so prompts that begin alike begin with the same pages (a group's samples, a server's requests with one
system prompt), and JAX's Pallas paged-attention kernels, which read each row's tokens [0, length),
read the pool as it is. Rows share pages, and a row holds pages only where it has tokens: the rest of
its table names the null page 0, all zeros.

The rows and the pool are split alike over the batch shards of a mesh (`shards`): rows [g B/G, (g + 1) B/G)
and pool pages [g N/G, (g + 1) N/G) are shard g's, on the same device, and a row's table names pages of its
shard's pool by their ids within it (each shard's page 0 its null page). Every read and write of a row then
touches its own device's pages only: the gathers and scatters below are batched over the shards.

Layout (one pool per layer, so a decode step writes in place; the kernels' layout):
  k, v:   L arrays [K, N, page, H]  keys and values of pool page n; N = G shards x the pages of each
  table:  [B, M] int32              page (of its shard's pool) of each logical page of each row
  mask:   [B, T] bool               dense position t of row b holds a token (the dense cache's mask)

Decoding reads the pages one of three ways (`read`, the `PagedCache.read` of a cache):
  gather  `read`: every row's dense view, gathered token by token through the table, which the dense
          attention reads unchanged: the dense cache's very numbers, on every backend (the reference);
  ragged  `attend`: the pages that hold a row's tokens only, a chunk of (row, page) pairs at a time,
          each page's scores joining its row's online softmax (as the peers' ragged kernels do, in
          plain JAX); the cost follows the tokens held, not B x T;
  kernel  `kernel_attend`: JAX's Pallas paged-attention kernel (TPU's on a TPU, else the GPU one, run
          interpreted on a CPU), for layers that attend to all their tokens; a sliding window's
          layers read ragged.
The last two equal the gather to rounding (their softmax is summed page by page).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dapo_jax.model import layers

NULL_PAGE = 0  # Never written: the page of logical pages a row holds no token in.
READS = ("gather", "ragged", "kernel")
KERNEL_PAGES = 8  # The Pallas kernels' pages per compute block.


@struct.dataclass
class PagedCache:
  k: list[jax.Array]   # L x [K, N, page, H]
  v: list[jax.Array]   # L x [K, N, page, H]
  table_BM: jax.Array  # int32 page of each logical page, an id within the row's shard's pool
  mask_BS: jax.Array   # [B, T] bool, over dense positions
  shards: int = struct.field(pytree_node=False, default=1)  # G: rows and pool pages split alike
  read: str = struct.field(pytree_node=False, default="gather")  # how decoding reads it (`READS`)
  chunk_pages: int = struct.field(pytree_node=False, default=128)  # `attend`'s pages per chunk

  @property
  def size(self) -> int:
    """T, the dense positions of a row (as `KVCache.size`)."""
    return self.mask_BS.shape[1]

  @property
  def page_size(self) -> int:
    return self.v[0].shape[2]

  @property
  def num_pages(self) -> int:
    """The pages of each shard's pool."""
    return self.v[0].shape[1] // self.shards


def pages_per_row(T: int, page_size: int) -> int:
  """M, the logical pages of a row of at most T tokens."""
  return -(-T // page_size)


def empty(num_layers: int, num_pages: int, num_kv_heads: int, head_dim: int, page_size: int, B: int, T: int,
          dtype, shards: int = 1, read: str = "gather", chunk_pages: int = 128) -> PagedCache:
  """A pool of `num_pages` zeroed pages per shard (each shard's page 0 its null page) and B rows of T
  dense positions holding none; decoding reads it by `read` (ragged: `chunk_pages` pages at a time)."""
  if read not in READS:
    raise ValueError(f"paged read {read!r}: expected one of {READS}")
  K, H, p, N = num_kv_heads, head_dim, page_size, shards * num_pages
  return PagedCache(k=[jnp.zeros((K, N, p, H), dtype) for _ in range(num_layers)],
                    v=[jnp.zeros((K, N, p, H), dtype) for _ in range(num_layers)],
                    table_BM=jnp.full((B, pages_per_row(T, p)), NULL_PAGE, jnp.int32),
                    mask_BS=jnp.zeros((B, T), bool), shards=shards, read=read, chunk_pages=chunk_pages)


def by_shard(x: jax.Array, G: int, axis: int = 0) -> jax.Array:
  """Splits `axis` (rows, or pool pages) into [G, n / G] at its place: shard g's block at [g]."""
  return x.reshape(*x.shape[:axis], G, x.shape[axis] // G, *x.shape[axis + 1:])


def token_index(mask_BT: jax.Array) -> jax.Array:
  """[B, T] int32: the number of marked positions before each position (a marked one's token number)."""
  return jnp.cumsum(mask_BT, axis=1, dtype=jnp.int32) - mask_BT


def token_mask(mask_BT: jax.Array, C: int, attend_BT: jax.Array | None = None) -> jax.Array:
  """[B, C] bool (C = M x page): the positions `attend_BT` marks (default: all that `mask_BT` marks), by token
  number (`token_index(mask_BT)`) instead of dense position. Those of a run of positions (a sliding
  window's) are a run of token numbers: from the first attended token's to the last's, by row (no
  scatter, so a row's mask stays on its own device)."""
  attend_BT = mask_BT if attend_BT is None else attend_BT & mask_BT
  index_BT = token_index(mask_BT)
  first_B1 = jnp.min(jnp.where(attend_BT, index_BT, C), axis=1, keepdims=True)
  end_B1 = jnp.max(jnp.where(attend_BT, index_BT + 1, 0), axis=1, keepdims=True)
  token_1C = jnp.arange(C)[None, :]
  return (token_1C >= first_B1) & (token_1C < end_B1)


def read(k_KNpH: jax.Array, v_KNpH: jax.Array, table_BM: jax.Array, mask_BT: jax.Array,
         G: int = 1) -> tuple[jax.Array, jax.Array]:
  """One layer's dense view of every row: keys [B, K, H, T] and values [B, K, T, H], position t holding
  the row's token number `token_index(mask)[t]` (unmarked positions: some token of the row, which the
  mask hides). Each of the G shards' rows gathers from its own pool (pages [g N/G, (g + 1) N/G))."""
  M, p = table_BM.shape[1], k_KNpH.shape[2]
  index_BT = jnp.minimum(token_index(mask_BT), M * p - 1)
  page_BT = jnp.take_along_axis(table_BM, index_BT // p, axis=1)

  def gather(pool_KnpH, page_bT, offset_bT):
    return pool_KnpH[:, page_bT, offset_bT]  # [K, b, T, H]

  def view(pool_KNpH):
    out_GKbTH = jax.vmap(gather, in_axes=(1, 0, 0))(by_shard(pool_KNpH, G, 1), by_shard(page_BT, G),
                                                   by_shard(index_BT % p, G))
    return out_GKbTH.transpose(0, 2, 1, 3, 4).reshape(-1, *out_GKbTH.shape[1:2], *out_GKbTH.shape[3:])

  k_BKTH, v_BKTH = view(k_KNpH), view(v_KNpH)
  return k_BKTH.swapaxes(2, 3), v_BKTH


def attend(q_BKRH: jax.Array, k_KNpH: jax.Array, v_KNpH: jax.Array, table_BM: jax.Array, tokens_BC: jax.Array,
           live_B: jax.Array, chunk_pages: int, G: int = 1, scale: float | None = None,
           softcap: float = 0.0) -> jax.Array:
  """One query per head of each row against the tokens `tokens_BC` marks (by token number, C = M x page:
  `token_mask`), the pages read in place: [B, K, R, H]. Rows not `live_B` (ended: their pages may be
  another's by now) read nothing.

  Ragged, as the peers' paged-attention kernels are: the (row, page) pairs whose page holds a marked
  token are listed, and a loop takes them `chunk_pages` at a time, as many chunks as there are such
  pages (the work follows the tokens the rows hold, not B x M). Each page's scores (scaled by `scale`,
  default H**-0.5, soft-capped at `softcap`) join its row's online softmax in fp32: `layers.attention`
  over the gathered rows (`read`), to rounding."""
  B, M = table_BM.shape
  K, _, p, H = k_KNpH.shape
  R = q_BKRH.shape[2]
  scale = H ** -0.5 if scale is None else scale
  low = jnp.finfo(jnp.float32).min  # A score no key has: exp(low - a real max) = 0, and no inf - inf.
  mask_BMp = tokens_BC.reshape(B, M, p) & live_B[:, None, None]

  def shard(q_bKRH, k_KnpH, v_KnpH, table_bM, mask_bMp):
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
      scores_cKRp = jnp.einsum("cKRH,KcpH->cKRp", q_cKRH, k_KnpH[:, page_c], preferred_element_type=jnp.float32)
      live_c11p = mask_cp[:, None, None]
      scores_cKRp = jnp.where(live_c11p, layers.soft_cap(scores_cKRp * scale, softcap), low)
      max_cKR = scores_cKRp.max(-1)
      new_max_bKR = jnp.maximum(max_bKR, jax.ops.segment_max(max_cKR, row_c, num_segments=b))
      weight_cKR = jnp.exp(max_cKR - new_max_bKR[jnp.minimum(row_c, b - 1)])
      probs_cKRp = jnp.where(live_c11p, jnp.exp(scores_cKRp - max_cKR[..., None]), 0.0)
      out_cKRH = jnp.einsum("cKRp,KcpH->cKRH", probs_cKRp.astype(q_bKRH.dtype), v_KnpH[:, page_c],
                            preferred_element_type=jnp.float32)
      rescale_bKR = jnp.exp(max_bKR - new_max_bKR)
      sum_bKR = sum_bKR * rescale_bKR + jax.ops.segment_sum(probs_cKRp.sum(-1) * weight_cKR, row_c, b)
      out_bKRH = out_bKRH * rescale_bKR[..., None] + jax.ops.segment_sum(out_cKRH * weight_cKR[..., None], row_c, b)
      return new_max_bKR, sum_bKR, out_bKRH

    init = (jnp.full((b, K, R), low), jnp.zeros((b, K, R)), jnp.zeros((b, K, R, H)))
    chunks = -(-live_X.sum() // chunk_pages)
    _, sum_bKR, out_bKRH = jax.lax.fori_loop(0, chunks, step, init)
    return out_bKRH / jnp.where(sum_bKR > 0, sum_bKR, 1.0)[..., None]

  out_GbKRH = jax.vmap(shard, in_axes=(0, 1, 1, 0, 0))(
      by_shard(q_BKRH, G), by_shard(k_KNpH, G, 1), by_shard(v_KNpH, G, 1), by_shard(table_BM, G),
      by_shard(mask_BMp, G))
  return out_GbKRH.reshape(B, K, R, H).astype(q_BKRH.dtype)


def kernel_attend(q_BKRH: jax.Array, k_KNpH: jax.Array, v_KNpH: jax.Array, table_BM: jax.Array,
                  length_B: jax.Array, G: int = 1, scale: float | None = None, softcap: float = 0.0) -> jax.Array:
  """`attend` of each row's tokens [0, length_B) by JAX's own Pallas paged-attention kernel: TPU's on a
  TPU, the GPU one elsewhere (on a CPU in Pallas's interpret mode: slow, for checking only). [B, K, R, H];
  a row of length 0 reads its first token. The table is padded with null pages to the kernels' blocks."""
  B, M = table_BM.shape
  K, _, p, H = k_KNpH.shape
  R = q_BKRH.shape[2]
  scale = H ** -0.5 if scale is None else scale
  per_block = min(KERNEL_PAGES, M)
  splits = min(16, -(-M // per_block))
  table_BM = jnp.pad(table_BM, ((0, 0), (0, -M % (per_block * splits))), constant_values=NULL_PAGE)
  q_BNH = (q_BKRH * scale).astype(q_BKRH.dtype).reshape(B, K * R, H)
  length_B = jnp.maximum(length_B, 1).astype(jnp.int32)
  cap = softcap or None
  if jax.default_backend() == "tpu":
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
    run = lambda q, k, v, t, n: paged_attention(q, k, v, n, t, pages_per_compute_block=per_block,
                                                attn_logits_soft_cap=cap)
  else:
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu
    run = lambda q, k, v, t, n: gpu.paged_attention(q, k, v, t, n, block_h=16, pages_per_compute_block=per_block,
                                                    k_splits=splits, attn_logits_soft_cap=cap,
                                                    interpret=jax.default_backend() == "cpu")
  out_GbNH = jax.vmap(run, in_axes=(0, 1, 1, 0, 0))(by_shard(q_BNH, G), by_shard(k_KNpH, G, 1),
                                                   by_shard(v_KNpH, G, 1), by_shard(table_BM, G), by_shard(length_B, G))
  return out_GbNH.reshape(B, K, R, H)


def update(k_KNpH: jax.Array, v_KNpH: jax.Array, table_BM: jax.Array, new_k_BKH: jax.Array, new_v_BKH: jax.Array,
           token_B: jax.Array, live_B: jax.Array, G: int = 1) -> tuple[jax.Array, jax.Array]:
  """Writes one new key/value per row, its token number token_B[b], into page table[b, token // page]
  (of the row's shard's pool) at offset token % page. A row not `live_B` writes nothing (an ended row:
  its pages may be another row's by now)."""
  N, p = v_KNpH.shape[1], v_KNpH.shape[2]
  rows_B = jnp.arange(table_BM.shape[0])
  page_B = table_BM[rows_B, jnp.clip(token_B // p, 0, table_BM.shape[1] - 1)]
  page_B = jnp.where(live_B, page_B, N // G)  # Out of the shard's range: dropped.
  offset_B = token_B % p

  def write(k_KnpH, v_KnpH, page_b, offset_b, new_k_bKH, new_v_bKH):
    return (k_KnpH.at[:, page_b, offset_b].set(new_k_bKH.swapaxes(0, 1).astype(k_KnpH.dtype), mode="drop"),
            v_KnpH.at[:, page_b, offset_b].set(new_v_bKH.swapaxes(0, 1).astype(v_KnpH.dtype), mode="drop"))

  k_GKnpH, v_GKnpH = jax.vmap(write, in_axes=(1, 1, 0, 0, 0, 0), out_axes=1)(
      by_shard(k_KNpH, G, 1), by_shard(v_KNpH, G, 1), *(by_shard(x, G) for x in (page_B, offset_B, new_k_BKH,
                                                                                new_v_BKH)))
  return k_GKnpH.reshape(k_KNpH.shape), v_GKnpH.reshape(v_KNpH.shape)


def write_pages(cache: PagedCache, k_LUKPH: jax.Array, v_LUKPH: jax.Array, mask_UP: jax.Array, src_GW: jax.Array,
                page_GW: jax.Array, dst_GW: jax.Array, n: jax.Array) -> PagedCache:
  """Copies prefilled prompts into the pool, in place: for each shard g and w < n, logical page
  page_GW[g, w] of prompt row src_GW[g, w] (its tokens [j page, (j + 1) page), the marked positions of
  mask_UP in order) into page dst_GW[g, w] of shard g's pool (out of its range: no write). The page's
  offsets past the prompt's last token are written as zeros."""
  P, p, G = k_LUKPH.shape[3], cache.page_size, cache.shards
  order_UP = jnp.argsort(~mask_UP, axis=1, stable=True)  # Each row's marked positions first, in order.
  count_U = mask_UP.sum(axis=1)

  def write_one(k_KnpH, v_KnpH, new_k_UKPH, new_v_UKPH, src, page, dst):
    token_p = page * p + jnp.arange(p)
    pos_p = jnp.where(token_p < count_U[src], order_UP[src, jnp.minimum(token_p, P - 1)], P)  # P: zeros.
    take = lambda x_KPH: jnp.take(x_KPH, pos_p, axis=1, mode="fill", fill_value=0)
    return (k_KnpH.at[:, dst].set(take(new_k_UKPH[src]).astype(k_KnpH.dtype), mode="drop"),
            v_KnpH.at[:, dst].set(take(new_v_UKPH[src]).astype(v_KnpH.dtype), mode="drop"))

  write_shards = jax.vmap(write_one, in_axes=(1, 1, None, None, 0, 0, 0), out_axes=1)

  def write(w, pools):
    ks, vs = pools
    out = [write_shards(by_shard(k, G, 1), by_shard(v, G, 1), new_k, new_v, src_GW[:, w], page_GW[:, w],
                        dst_GW[:, w]) for k, v, new_k, new_v in zip(ks, vs, k_LUKPH, v_LUKPH)]
    return [k.reshape(ks[0].shape) for k, _ in out], [v.reshape(vs[0].shape) for _, v in out]

  ks, vs = jax.lax.fori_loop(0, n, write, (cache.k, cache.v))
  return cache.replace(k=ks, v=vs)
