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


def packed_microbatches(batch, *, max_tokens: int, shards: int = 1, buckets: Sequence[int] = ()) -> list:
  """`packed_rows`' micro-batches alone."""
  return [part for part, _ in packed_rows(batch, max_tokens=max_tokens, shards=shards, buckets=buckets)]


def packed_pass(fn: Callable, batch, put: Callable, *, max_tokens: int, shards: int = 1,
                buckets: Sequence[int] = ()) -> np.ndarray:
  """A forward pass `fn(placed micro-batch) -> [R, Cb]` over `batch`'s rows packed (`packed_rows`), its
  values put back in the rows' places: [B, C] fp32 (0 where a row has no completion token)."""
  B, C = batch.loss_mask_BC.shape
  out = np.zeros((B, C), np.float32)
  for part, rows in packed_rows(batch, max_tokens=max_tokens, shards=shards, buckets=buckets):
    values = np.asarray(sharding.fetch(fn(put(part))))
    real = rows >= 0
    out[rows[real], :values.shape[1]] = values[real]
  return out


def packed_rows(batch, *, max_tokens: int, shards: int = 1, buckets: Sequence[int] = ()) -> list[tuple]:
  """A mini-batch's rows packed without padding (host, pure): the micro-batches of a padding-free
  update (`datatypes.PackedRows`).

  A row's segment is what the padded forward reads of it, its real tokens among the first P + C - 1
  columns, so every log-prob, entropy and routing statistic is the padded update's. Rows go longest
  first. A micro-batch's sequences are as long as its longest row's length bucket, P + the smallest of
  `buckets` (or C) that holds its completion, so attention, quadratic in a sequence's length, costs no
  more than the padded rows' would; it holds `max_tokens` // that many sequences per data shard (one
  at least), filled first-fit, and the rows that do not fit wait for the next micro-batch. Row slots
  per shard (and the last micro-batch's sequences) are a power of two: a run compiles few shapes. The
  rows' [B, C] arrays are cut to the micro-batch's completion bucket. Returns (micro-batch, the batch's
  row in each of its row slots, -1 for none) pairs. Any batch laid out as `RLBatch` (a `ValueBatch`).
  """
  B, C = batch.loss_mask_BC.shape
  T = batch.tokens_BT.shape[1]
  P = T - C
  mask = np.asarray(batch.mask_BT, bool)
  length_B = mask[:, :T - 1].sum(1)  # The forward's real tokens per row.
  prompt_B, completion_B = mask[:, :P].sum(1), mask[:, P:].sum(1)
  edges = sorted({c for c in buckets if c < C} | {C})
  bucket = lambda n: next(c for c in edges if c >= n)
  pending = sorted(np.flatnonzero(length_B), key=lambda b: -length_B[b])
  out = []
  while pending:
    Cb = bucket(completion_B[pending[0]])
    L = P + Cb  # Holds any row whose completion fits Cb (a row feeds at most P + Cb - 1 tokens then).
    n = shards * max(1, max_tokens // L)
    bins, fill, rest = [[] for _ in range(n)], [0] * n, []
    for b in pending:  # First fit, longest first; what fits nowhere waits.
      k = next((i for i, f in enumerate(fill) if f + length_B[b] <= L and completion_B[b] <= Cb), None)
      if k is None:
        rest.append(b)
      else:
        bins[k].append(int(b))
        fill[k] += int(length_B[b])
    pending = rest
    used = [rows for rows in bins if rows]
    S = _pow2_at_least(-(-len(used) // shards), len(bins) // shards)
    out.append(_pack(batch, used, shards, S, L, Cb, length_B, prompt_B, completion_B))
  return out


def _pack(batch: RLBatch, bins: list[list[int]], shards: int, S: int, L: int, Cb: int, length_B, prompt_B,
          completion_B) -> tuple:
  """One packed micro-batch, and its row slots' rows: bin i is sequence i // shards of shard i % shards
  (S sequences of L each)."""
  tokens, mask = np.asarray(batch.tokens_BT), np.asarray(batch.mask_BT, bool)
  per_shard = [[rows for i, rows in enumerate(bins) if i % shards == d] for d in range(shards)]
  R = _pow2_at_least(max(sum(len(rows) for rows in seqs) for seqs in per_shard), len(length_B))
  row_idx = np.full((shards, R), -1)
  tokens_DL, next_DL, positions_DL, segments_DL = (np.zeros((shards, S * L), np.int32) for _ in range(4))
  source_DRC = np.zeros((shards, R, Cb), np.int32)
  for d, seqs in enumerate(per_shard):
    r = 0
    for s, rows in enumerate(seqs):
      start = s * L
      for k, b in enumerate(rows):
        n, real = int(length_B[b]), tokens[b][mask[b]]
        tokens_DL[d, start:start + n] = real[:n]
        next_DL[d, start:start + len(real) - 1] = real[1:]  # (real is the n tokens, or one more)
        positions_DL[d, start:start + n] = np.arange(n)
        segments_DL[d, start:start + n] = k + 1
        # Completion token c is predicted at the segment's position prompt_len - 1 + c.
        source_DRC[d, r, :completion_B[b]] = start + prompt_B[b] - 1 + np.arange(completion_B[b])
        row_idx[d, r] = b
        start, r = start + n, r + 1
  seq = lambda x: x.reshape(shards * S, L)  # [D, S x L] -> [D x S, L]: shard d's are sequences d*S .. d*S + S - 1.
  P = batch.tokens_BT.shape[1] - batch.loss_mask_BC.shape[1]
  return _rows_of(batch, row_idx.reshape(-1), P, Cb).replace(packed=PackedRows(
      tokens_MT=seq(tokens_DL), next_MT=seq(next_DL), positions_MT=seq(positions_DL), segments_MT=seq(segments_DL),
      source_BC=source_DRC.reshape(shards * R, Cb), row_B=row_idx.reshape(-1) >= 0, shards=shards)), row_idx.reshape(-1)


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
    if x is None or f.name.endswith("_B"):
      out[f.name] = take(x)
    elif f.name in ("tokens_BT", "mask_BT"):
      out[f.name] = take(np.asarray(x)[:, P:P + Cb])
    else:  # [B, C]
      out[f.name] = take(np.asarray(x)[:, :Cb])
  return type(batch)(**out)
