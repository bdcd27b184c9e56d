"""Packed micro-batches (host, NumPy): a mini-batch's rows packed without padding into sequences of a
token budget (`datatypes.PackedRows`), for the padding-free update (`train.packing`, docs/packing.md),
and forward passes over packed rows whose results go back to the rows' places.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from dapo_jax import sharding
from dapo_jax.datatypes import PackedRows, RLBatch
from dapo_jax.errors import ConfigError
from dapo_jax.model import mrope


def packed_microbatches(batch, **budget) -> list:
  """`packed_rows`' micro-batches alone."""
  return [part for part, _ in packed_rows(batch, **budget)]


def packed_pass(fn: Callable, batch, put: Callable, **budget):
  """A forward pass `fn(placed micro-batch) -> [R, Cb, ...]` (or a tuple of such) over `batch`'s rows
  packed (`packed_rows`), its values put back in the rows' places: [B, C, ...] fp32 (0 where a row has
  no completion token), or of an integer output's dtype (-1 there)."""
  B, C = batch.loss_mask_BC.shape
  out = None
  for part, rows in packed_rows(batch, **budget):
    values = sharding.fetch(fn(put(part)))
    values = tuple(map(np.asarray, values)) if isinstance(values, tuple) else (np.asarray(values),)
    if out is None:
      out = tuple(np.full((B, C) + v.shape[2:], -1, v.dtype) if np.issubdtype(v.dtype, np.integer)
                  else np.zeros((B, C) + v.shape[2:], np.float32) for v in values)
    real = rows >= 0
    for o, v in zip(out, values):
      o[rows[real], :v.shape[1]] = v[real]
  return out if len(out) > 1 else out[0]


def packed_rows(batch, *, max_tokens: int, shards: int = 1, buckets: Sequence[int] = (),
                scored: float = 0.0, block: int = 0, image_token: int = -1, vision=None) -> list[tuple]:
  """A mini-batch's rows packed without padding (host, pure): the micro-batches of a padding-free
  update (`datatypes.PackedRows`).

  A row's segment is what the padded forward reads of it, its real tokens among the first P + C - 1
  columns, so every log-prob and entropy is the padded update's. Rows with the same prompt (a group's
  samples) share it: a sequence holding several of them holds their prompt once, all but its last
  token, as a segment's trunk that each row's branch (the prompt's last token, then the completion)
  attends to. Rows go longest first (with `block`, a prompt's rows one after another, so that they
  share a sequence, prompts by their longest row). A micro-batch's sequences are as long as its longest row's length
  bucket, P + the smallest of `buckets` (or C) that holds its completion, so attention, quadratic in a
  sequence's length, costs no more than the padded rows' would; it holds `max_tokens` // that many
  sequences per data shard (one at least), filled first-fit, and the rows that do not fit wait for the
  next micro-batch. With `scored` > 0 the budget also counts what the rows' logits hold, `scored`
  positions for each completion token (`train_step.scored_token_positions`): a shard takes no row
  past `max_tokens` of its sequences' positions and that (its first row always). The lm head runs on
  the completion tokens alone (`PackedRows.source_K`), K per shard, within 1/8 above their count.
  Row slots per shard (and the last micro-batch's sequences) are a power of two: a run compiles few
  shapes. The rows' [B, C] arrays are cut to the micro-batch's completion bucket.
  With `block` > 0, attention reads key blocks (`block_pairs`, `packed_attention.attend_blocks`), so
  its cost follows the segments rather than a sequence's length: a shard then holds one sequence of
  the whole budget (`max_tokens` rounded down to whole blocks, or the longest row's bucket), the
  budget counts the positions filled, and the sequence is cut to the thirty-seconds of the budget (in
  whole blocks) that hold them.
  Prompts that begin alike (few-shot examples, a system prompt) share that beginning too: a sequence
  holding several prompts holds it once, as a prefix their parts attend to (`_pack`).
  Rows with images (`RLBatch.images_BMD`, placeholders `image_token`) share a prompt only with rows of
  the same images, and a beginning only up to the first placeholder; each sequence lists the vectors
  of its placeholders in order (`PackedRows.image_source_MN`) and numbers its images (`image_MT`),
  whose tokens see each other both ways, as in the rows layout (`vision.image_attention`). `vision` (the
  model's `VisionConfig`) names the placeholder instead of `image_token`; with Qwen2.5-VL's tower the
  images stay causal, each token carries its row's M-RoPE positions (`PackedRows.mrope_MT3`), and
  prompts share no beginning (a row's positions shift by what its images save: `mrope`).
  Returns (micro-batch, the batch's row in each of its row slots, -1 for none) pairs. Any batch laid
  out as `RLBatch` (a `ValueBatch`).
  """
  images = getattr(batch, "images_BMD", None)
  image_token = image_token if vision is None else vision.image_token_id
  if images is not None and image_token < 0:
    raise ConfigError("packing.packed_rows: rows with images (images_BMD) need their placeholder's id "
                      "(image_token)")
  B, C = batch.loss_mask_BC.shape
  T = batch.tokens_BT.shape[1]
  P = T - C
  mask = np.asarray(batch.mask_BT, bool)
  length_B = mask[:, :T - 1].sum(1)  # The forward's real tokens per row.
  prompt_B, completion_B = mask[:, :P].sum(1), mask[:, P:].sum(1)
  tokens_BP = np.asarray(batch.tokens_BT)[:, :P]
  prompt_id_B = _prompt_ids(tokens_BP, mask[:, :P], None if images is None else np.asarray(images))
  trunk_B = np.maximum(prompt_B - 1, 0)  # What a row shares with its prompt's other rows.
  prefix = _common_prefix(tokens_BP, mask[:, :P], length_B > 0)
  if images is not None:  # Alike placeholders may hold different images: the beginning stops before them.
    firsts = [np.flatnonzero(t[m] == image_token) for t, m in zip(tokens_BP, mask[:, :P])]
    prefix = min([prefix] + [int(f[0]) for f in firsts if len(f)])
  mrope_BT3 = None
  if vision is not None and vision.kind == "qwen2_5_vl":
    positions_BT = np.maximum(np.cumsum(mask, 1) - 1, 0)
    mrope_BT3 = np.moveaxis(np.asarray(mrope.mrope_positions(vision, positions_BT, batch.tokens_BT, images)), 0, -1)
    prefix = 0 if images is not None else prefix
  rows = _Rows(length_B, prompt_B, completion_B, prompt_id_B, prefix, image_token,
               vision is None or vision.bidirectional, mrope_BT3)
  edges = sorted({c for c in buckets if c < C} | {C})
  bucket = lambda n: next(c for c in edges if c >= n)
  pending = sorted(np.flatnonzero(length_B), key=lambda b: -length_B[b])
  if block:  # Any row fits a sequence of the whole budget: a prompt's rows go together, its prompt packed once.
    by_prompt = {}
    for b in pending:
      by_prompt.setdefault(prompt_id_B[b], []).append(b)
    pending = [b for group in by_prompt.values() for b in group]
  out = []
  while pending:
    Cb = bucket(max(completion_B[b] for b in pending))
    L = P + Cb  # Holds any row whose completion fits Cb (a row feeds at most P + Cb - 1 tokens then).
    if block:
      L = max(max_tokens // block, -(-L // block)) * block
    n = shards * max(1, max_tokens // L)
    bins, fill, prompts, rest = [[] for _ in range(n)], [0] * n, [set() for _ in range(n)], []
    opened, tokens = [0] * shards, [0] * shards  # Per shard: sequences in use, scored tokens.

    def holds(i, b):  # Bin i's shard within its budget with row b there too (or b its first).
      d = i % shards
      if block:  # Positions filled, not sequences opened.
        taken = sum(fill[j] for j in range(d, n, shards)) + cost(i)
      else:
        taken = (opened[d] + (not bins[i])) * L
      return not opened[d] or taken + (tokens[d] + completion_B[b]) * scored <= max_tokens

    for b in pending:  # First fit, longest first; a prompt already in a sequence costs nothing more there,
      # a new one its part after the prompts' common beginning.
      cost = lambda i: length_B[b] - (trunk_B[b] if prompt_id_B[b] in prompts[i] else rows.prefix if prompts[i] else 0)
      k = next((i for i in range(n) if fill[i] + cost(i) <= L and completion_B[b] <= Cb
                and (not scored or holds(i, b))), None)
      if k is None:
        rest.append(b)
      else:
        fill[k] += int(cost(k))
        opened[k % shards] += not bins[k]
        tokens[k % shards] += int(completion_B[b])
        bins[k].append(int(b))
        prompts[k].add(prompt_id_B[b])
    pending = rest
    used = [rows for rows in bins if rows]
    S = _pow2_at_least(-(-len(used) // shards), len(bins) // shards)
    if block:  # The sequences cut to what holds the fullest, in 32nds of the budget (few shapes).
      unit = -(-max(max_tokens // 32, 1) // block) * block
      L = min(L, -(-max(fill) // unit) * unit)
    out.append(_pack(batch, used, shards, S, L, Cb, rows, block))
  return out


@dataclasses.dataclass(frozen=True)
class _Rows:
  """A mini-batch's rows as packing sees them: real tokens the forward reads, prompt and completion
  lengths, prompt numbers (`_prompt_ids`), and the real tokens all prompts begin with (each prompt's
  last one excluded: it begins its rows' branches)."""
  length_B: np.ndarray
  prompt_B: np.ndarray
  completion_B: np.ndarray
  prompt_id_B: np.ndarray
  prefix: int
  image_token: int = -1
  bidirectional: bool = True  # an image's tokens see each other both ways (Gemma 3)
  mrope_BT3: np.ndarray | None = None  # int32 [B, T, 3]: each token's M-RoPE positions (Qwen2.5-VL)


def _common_prefix(tokens_BP: np.ndarray, mask_BP: np.ndarray, rows_B: np.ndarray) -> int:
  """The number of real tokens every prompt of `rows_B` begins with, at most the shortest prompt but one."""
  prompts = [t[m] for t, m, r in zip(tokens_BP, mask_BP, rows_B) if r]
  if len({p.tobytes() for p in prompts}) < 2:
    return 0
  n = min(len(p) for p in prompts) - 1
  first = prompts[0][:n]
  for p in prompts[1:]:
    same = np.flatnonzero(p[:n] != first)
    n = int(same[0]) if len(same) else n
    first = first[:n]
  return max(n, 0)


def _prompt_ids(tokens_BP: np.ndarray, mask_BP: np.ndarray, images_BMD: np.ndarray | None = None) -> np.ndarray:
  """[B] int: rows with the same real prompt tokens (and the same image vectors) get the same number."""
  seen = {}
  key = lambda b: tokens_BP[b][mask_BP[b]].tobytes() + (b"" if images_BMD is None else images_BMD[b].tobytes())
  return np.array([seen.setdefault(key(b), len(seen)) for b in range(len(tokens_BP))], np.int64)


def _pack(batch: RLBatch, bins: list[list[int]], shards: int, S: int, L: int, Cb: int, rows: "_Rows",
          block: int = 0) -> tuple:
  """One packed micro-batch, and its row slots' rows: bin i is sequence i // shards of shard i % shards
  (S sequences of L each). In a sequence, rows of one prompt make one segment: the prompt but its last
  token once (branch 0), then each row's branch (1, 2, ...); a row alone is a segment of branch 0.
  A sequence of several prompts that begin alike (`rows.prefix` > 0 tokens) is one segment: the prefix
  once (prompt 0), then each prompt's part (prompt 1, 2, ...) laid out as above after the prefix."""
  tokens, mask = np.asarray(batch.tokens_BT), np.asarray(batch.mask_BT, bool)
  per_shard = [[_by_prompt(seq_rows, rows) for i, seq_rows in enumerate(bins) if i % shards == d]
               for d in range(shards)]
  # Row slots, per shard: its sequences' rows in order, each prompt's together.
  slots = [[b for seq in seqs for group in seq for b in group] for seqs in per_shard]
  R = _pow2_at_least(max(map(len, slots)), len(rows.length_B))
  row_idx = np.full((shards, R), -1)
  ids_DL = {k: np.zeros((shards, S * L), np.int32)
            for k in ("tokens", "positions", "segments", "prompts", "branches", "rows")}
  picks = [[] for _ in range(shards)]  # (source, target, place) of each shard's scored tokens
  routes = getattr(batch, "routes_BCLk", None)  # Routing replay: each real token's recorded experts (-1: none).
  if routes is not None:
    routes = np.asarray(routes)
    ids_DL["routes"] = np.full((shards, S * L) + routes.shape[2:], -1, np.int32)
    prompt_routes = np.full((int(rows.prompt_B.max()),) + routes.shape[2:], -1, np.int32)
    real_routes = lambda b: np.concatenate([prompt_routes[:int(rows.prompt_B[b])],
                                            routes[b, :int(rows.completion_B[b])]])
  images = getattr(batch, "images_BMD", None)
  if images is not None:  # Each placeholder's image (numbered per shard) and vector (in its shard's slots).
    I = images.shape[1]
    if rows.bidirectional:
      ids_DL["image"] = np.zeros((shards, S * L), np.int32)
    sources = [[[] for _ in range(S)] for _ in range(shards)]
  if rows.mrope_BT3 is not None:
    ids_DL["mrope"] = np.zeros((shards, S * L, 3), np.int32)

  def put(d, start, real, lo, hi, segment, prompt, branch, b, readers=1):  # Row b's real tokens [lo, hi).
    for k, v in (("tokens", real[lo:hi]), ("positions", np.arange(lo, hi)), ("segments", segment),
                 ("prompts", prompt), ("branches", branch), ("rows", readers)):
      ids_DL[k][d, start:start + hi - lo] = v
    if routes is not None:
      ids_DL["routes"][d, start:start + hi - lo] = real_routes(b)[lo:hi]
    if rows.mrope_BT3 is not None:
      ids_DL["mrope"][d, start:start + hi - lo] = rows.mrope_BT3[b][mask[b]][lo:hi]
    if images is not None:
      is_image = real == rows.image_token
      image = np.cumsum(is_image & ~np.r_[False, is_image[:-1]])  # The row's 1st, 2nd, ... image
      at = lo + np.flatnonzero(is_image[lo:hi])
      if rows.bidirectional:
        ids_DL["image"][d, start + at - lo] = slot[b] * (I + 1) + image[at]
      sources[d][start // L].extend(slot[b] * I + np.cumsum(is_image)[at] - 1)
    return start + hi - lo

  for d, seqs in enumerate(per_shard):
    slot = {b: r for r, b in enumerate(slots[d])}
    row_idx[d, :len(slots[d])] = slots[d]
    for s, groups in enumerate(seqs):
      start = s * L
      N = rows.prefix if len(groups) > 1 else 0
      if N:  # The prompts' common beginning, once: every prompt's part sees it.
        b = groups[0][0]
        start = put(d, start, tokens[b][mask[b]], 0, N, 1, 0, 0, b, readers=sum(map(len, groups)))
      for k, group in enumerate(groups, 1):
        segment, prompt = (1, k) if N else (k, 1)
        shared = len(group) > 1
        if shared:  # The trunk: the prompt but its last token (after the prefix).
          b = group[0]
          start = put(d, start, tokens[b][mask[b]], N, int(rows.prompt_B[b]) - 1, segment, prompt, 0, b,
                      readers=len(group))
        for branch, b in enumerate(group, 1):
          real, p, c = tokens[b][mask[b]], int(rows.prompt_B[b]), int(rows.completion_B[b])
          lo = p - 1 if shared else N
          # Completion token c is predicted at the row's position p - 1 + c.
          picks[d] += zip(start + (p - 1 - lo) + np.arange(c), real[p:p + c], (d * R + slot[b]) * Cb + np.arange(c))
          start = put(d, start, real, lo, int(rows.length_B[b]), segment, prompt, branch if shared else 0, b)
  seq = lambda x: x.reshape(shards * S, L)  # [D, S x L] -> [D x S, L]: shard d's are sequences d*S .. d*S + S - 1.
  K = _eighths_at_least(max(len(p) for p in picks), R * Cb)
  scored_DK3 = np.zeros((shards, K, 3), np.int32)
  scored_DK3[..., 2] = shards * R * Cb  # Padding: dropped.
  for d, p in enumerate(picks):
    if p:
      scored_DK3[d, :len(p)] = p
  P = batch.tokens_BT.shape[1] - batch.loss_mask_BC.shape[1]
  source_K, target_K, place_K = (scored_DK3[..., i].reshape(-1) for i in range(3))
  ids = {f"{k}_MT": seq(v) for k, v in ids_DL.items() if k not in ("routes", "mrope")}
  if rows.mrope_BT3 is not None:
    ids["mrope_MT3"] = ids_DL["mrope"].reshape(shards * S, L, 3)
  if routes is not None:
    ids["routes_MTLk"] = ids_DL["routes"].reshape(shards * S, L, *routes.shape[2:])
  if images is not None:
    n = _pow2_at_least(max(len(x) for per_seq in sources for x in per_seq), R * I)
    ids["image_source_MN"] = np.zeros((shards * S, max(n, 1)), np.int32)
    for m, x in enumerate(x for per_seq in sources for x in per_seq):
      ids["image_source_MN"][m, :len(x)] = x
  if block:
    ids["query_block_MP"], ids["key_block_MP"] = block_pairs(ids["segments_MT"], ids["prompts_MT"],
                                                             ids["branches_MT"], block, ids.get("image_MT"))
  return _rows_of(batch, row_idx.reshape(-1), P, Cb).replace(packed=PackedRows(
      **ids, source_K=source_K, target_K=target_K, place_K=place_K, row_B=row_idx.reshape(-1) >= 0,
      shards=shards, block=block)), row_idx.reshape(-1)


def _by_prompt(seq_rows: list[int], rows: "_Rows") -> list[list[int]]:
  """A sequence's rows by prompt, the prompts in order of first appearance."""
  groups = {}
  for b in seq_rows:
    groups.setdefault(rows.prompt_id_B[b], []).append(b)
  return list(groups.values())


def block_pairs(segments_MT: np.ndarray, prompts_MT: np.ndarray, branches_MT: np.ndarray,
                block: int, image_MT: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
  """The (query block, key block) pairs of packed sequences cut into blocks of `block` positions where
  a query sees a key (`packed_attention.sees`: its own run's tokens up to it, its prompt's trunk, its
  segment's prefix, and every token of its image): int32 [M, P] query blocks and key blocks, -1 after a
  sequence's pairs, P the most any sequence has, rounded up to a multiple of its block count (few shapes)."""
  M, T = segments_MT.shape
  n = T // block
  need_Mnn = np.zeros((M, n, n), bool)
  span = lambda lo, hi: slice(lo // block, (hi - 1) // block + 1)  # The blocks of tokens [lo, hi).
  for m in range(M):
    seg, prompt, br = segments_MT[m], prompts_MT[m], branches_MT[m]
    change = np.ones(T, bool)
    change[1:] = (seg[1:] != seg[:-1]) | (prompt[1:] != prompt[:-1]) | (br[1:] != br[:-1])
    starts = np.flatnonzero(change)
    seen = {}  # (segment, prompt) -> [lo, hi) of its prefix (prompt 0) or trunk (branch 0)
    for lo, hi in zip(starts, list(starts[1:]) + [T]):  # Runs of one (segment, prompt, branch).
      key = (int(seg[lo]), int(prompt[lo]))
      if key[0] == 0:
        continue
      if br[lo] == 0:
        seen[key] = (lo, hi)
      above = []  # The runs it sees besides its own: the segment's prefix, the prompt's trunk.
      if prompt[lo] > 0 and (key[0], 0) in seen:
        above.append(seen[key[0], 0])
      if br[lo] > 0 and key in seen:
        above.append(seen[key])
      for i in range(lo // block, (hi - 1) // block + 1):
        need_Mnn[m, i, lo // block:i + 1] = True
        for a_lo, a_hi in above:
          need_Mnn[m, i, span(a_lo, a_hi)] = True
    if image_MT is not None:  # An image's tokens see each other both ways.
      for image in set(image_MT[m][image_MT[m] > 0].tolist()):
        at = np.flatnonzero(image_MT[m] == image)
        need_Mnn[m, span(at[0], at[-1] + 1), span(at[0], at[-1] + 1)] = True
  P = -(-int(need_Mnn.sum((1, 2)).max()) // n) * n
  query_MP, key_MP = np.full((M, P), -1, np.int32), np.full((M, P), -1, np.int32)
  for m in range(M):
    i, j = np.nonzero(need_Mnn[m])
    query_MP[m, :len(i)], key_MP[m, :len(j)] = i, j
  return query_MP, key_MP


def _eighths_at_least(n: int, cap: int) -> int:
  """The smallest m x 2^e >= n with m in 8..15 (at most 1/8 above n: the lm head's rows, which pay
  for every padded one), but at most `cap` (when cap >= n); below 16, n itself."""
  n = int(n)
  step = 1 << max(n.bit_length() - 4, 0)
  return min(-(-n // step) * step, max(cap, n))


def _pow2_at_least(n: int, cap: int) -> int:
  """The smallest power of two >= n, but at most `cap` (when cap >= n)."""
  return min(1 << max(int(n) - 1, 0).bit_length(), max(cap, int(n)))


def _rows_of(batch, idx: np.ndarray, P: int, Cb: int):
  """The completion columns [:Cb] of rows `idx` of `batch` (-1: an empty row: no token, no loss): its
  tokens and mask cut to the completions, its [B, C] arrays to [:Cb], its [B] arrays taken."""
  real = idx >= 0
  take = lambda x: None if x is None else np.where(
      real.reshape((-1,) + (1,) * (np.ndim(x) - 1)), np.asarray(x)[np.maximum(idx, 0)], 0).astype(np.asarray(x).dtype)
  out = {}
  for f in dataclasses.fields(batch):
    x = getattr(batch, f.name)
    if not f.metadata.get("pytree_node", True) or f.name == "packed":
      continue
    if x is None or f.name.endswith("_B") or f.name in ("images_BMD", "pixels_BICSS", "grids_BI2"):
      out[f.name] = take(x)
    elif f.name in ("tokens_BT", "mask_BT"):
      out[f.name] = take(np.asarray(x)[:, P:P + Cb])
    else:  # [B, C]
      out[f.name] = take(np.asarray(x)[:, :Cb])
  return type(batch)(**out)
