"""The host side of a paged KV cache (`model.paged_cache`): which pool pages are free, how many
holders each used page has, and (with a prefix cache) which pages hold which prompt prefixes.

A page is held by every sample whose page table names it, by a kept prefill whose samples still
wait (the prompt pages it wrote, so that its later samples share them), and by the prefix cache: it
returns to the free list when its last holder lets go. Page 0, the null page, is never handed out.

The prefix cache keeps the whole prompt pages written so far under the hash of their tokens and every
token before them (`prefix_keys`: page j of a prompt holds its tokens [j page, (j + 1) page), so two
prompts with the same first (j + 1) x page tokens have the same page j). A cached page that no sample
or prefill holds is idle: it counts as available, and the least recently used idle pages are let go
when free pages run short (as vLLM's prefix cache and SGLang's radix cache evict).
"""
from __future__ import annotations

import collections
import hashlib

import numpy as np

from dapo_jax.model import paged_cache


def prefix_keys(tokens: np.ndarray, page_size: int) -> list[bytes]:
  """The cache keys of the whole pages of a prompt's tokens: key j hashes tokens [0, (j + 1) page)."""
  keys, digest = [], b""
  tokens = np.asarray(tokens, np.int32)
  for j in range(len(tokens) // page_size):
    digest = hashlib.blake2b(digest + tokens[j * page_size:(j + 1) * page_size].tobytes(), digest_size=16).digest()
    keys.append(digest)
  return keys


class PagePool:
  """`num_pages` pages of `page_size` positions: the free list, a reference count per page, and the
  prefix cache (`lookup`, `keep`)."""

  def __init__(self, num_pages: int, page_size: int):
    if num_pages < 2:
      raise ValueError(f"rollout.kv_pages={num_pages}: expected at least 2 pages (one is the null page)")
    self.num_pages, self.page_size = num_pages, page_size
    self.free = list(range(num_pages - 1, paged_cache.NULL_PAGE, -1))  # Popped from the end: lowest ids first.
    self.refs = np.zeros(num_pages, np.int32)
    self.peak = 0
    self.cached: dict[bytes, int] = {}  # prefix key -> the page holding it
    self.key_of: dict[int, bytes] = {}
    self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # Held by the cache alone, LRU first.
    self.evicted = 0                    # Cached pages let go for room.

  @property
  def used(self) -> int:
    """Pages held by samples or prefills (an idle cached page is available)."""
    return self.num_pages - 1 - self.available

  @property
  def available(self) -> int:
    return len(self.free) + len(self.idle)

  def allocate(self, n: int) -> list[int]:
    """n pages, each with one holder (the caller checks `available` first): free ones, then the least
    recently used idle cached ones, let go of the cache."""
    if n > self.available:
      raise RuntimeError(f"{n} pages asked of a pool with {self.available} available")
    while len(self.free) < n:
      page, _ = self.idle.popitem(last=False)
      del self.cached[self.key_of.pop(page)]
      self.refs[page] = 0
      self.free.append(page)
      self.evicted += 1
    pages = [self.free.pop() for _ in range(n)]
    self.refs[pages] = 1
    self.peak = max(self.peak, self.used)
    return pages

  def retain(self, pages) -> None:
    """One more holder of each of `pages` (a sample sharing them, a prefill taking cached ones)."""
    for page in pages:
      assert self.refs[page] > 0, f"page {page} is free"
      self.refs[page] += 1
      self.idle.pop(page, None)
    self.peak = max(self.peak, self.used)

  def release(self, pages) -> None:
    """One holder fewer of each of `pages`; those left without one are free again (a cached page left
    to the cache alone is idle, the most recently used)."""
    for page in pages:
      assert self.refs[page] > 0, f"page {page} released twice"
      self.refs[page] -= 1
      if not self.refs[page]:
        self.free.append(page)
      elif self.refs[page] == 1 and page in self.key_of:
        self.idle[page] = None

  def lookup(self, keys: list[bytes]) -> list[int]:
    """The cached pages of the longest run of `keys` from the first (each now the most recently used)."""
    pages = []
    for key in keys:
      page = self.cached.get(key)
      if page is None:
        break
      pages.append(page)
      if page in self.idle:
        self.idle.move_to_end(page)
    return pages

  def keep(self, keys: list[bytes], pages: list[int]) -> None:
    """The cache holds each of `pages` (held by the caller, just written) under its key."""
    for key, page in zip(keys, pages):
      if key not in self.cached and page not in self.key_of:
        self.cached[key], self.key_of[page] = page, key
        self.refs[page] += 1

  def clear(self) -> None:
    """The cache lets go of every page (the params that wrote them are gone)."""
    for page in list(self.key_of):
      self.refs[page] -= 1
      if not self.refs[page]:
        self.free.append(page)
    self.cached, self.key_of, self.idle = {}, {}, collections.OrderedDict()
