"""The host side of a paged KV cache (`model.paged_cache`): which pool pages are free, and how many
holders each used page has.

A page is held by every sample whose page table names it, and by a kept prefill whose samples still
wait (the prompt pages it wrote, so that its later samples share them): it returns to the free list
when its last holder lets go. Page 0, the null page, is never handed out.
"""
from __future__ import annotations

import numpy as np

from dapo_jax.model import paged_cache


class PagePool:
  """`num_pages` pages of `page_size` positions: the free list and a reference count per page."""

  def __init__(self, num_pages: int, page_size: int):
    if num_pages < 2:
      raise ValueError(f"rollout.kv_pages={num_pages}: expected at least 2 pages (one is the null page)")
    self.num_pages, self.page_size = num_pages, page_size
    self.free = list(range(num_pages - 1, paged_cache.NULL_PAGE, -1))  # Popped from the end: lowest ids first.
    self.refs = np.zeros(num_pages, np.int32)
    self.peak = 0

  @property
  def used(self) -> int:
    return self.num_pages - 1 - len(self.free)

  @property
  def available(self) -> int:
    return len(self.free)

  def allocate(self, n: int) -> list[int]:
    """n free pages, each with one holder (the caller checks `available` first)."""
    if n > len(self.free):
      raise RuntimeError(f"{n} pages asked of a pool with {len(self.free)} free")
    pages = [self.free.pop() for _ in range(n)]
    self.refs[pages] = 1
    self.peak = max(self.peak, self.used)
    return pages

  def retain(self, pages) -> None:
    """One more holder of each of `pages` (a sample sharing them)."""
    for page in pages:
      assert self.refs[page] > 0, f"page {page} is free"
      self.refs[page] += 1

  def release(self, pages) -> None:
    """One holder fewer of each of `pages`; those left without one are free again."""
    for page in pages:
      assert self.refs[page] > 0, f"page {page} released twice"
      self.refs[page] -= 1
      if not self.refs[page]:
        self.free.append(page)
