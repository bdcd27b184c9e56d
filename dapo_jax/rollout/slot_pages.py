"""The host side of a paged KV cache's slots (`kv_layout="paged"`): a page pool per batch shard
(`pages.PagePool`) and the pages each slot's sample holds; which queued samples start on which shard,
the pages each decode round adds, and which samples are pre-empted when a shard's pool runs dry.

The slots are split over the G batch shards as a batch's rows are (slot s of a width W lies on shard
s // (W / G)), and so is the pool (`model.paged_cache`): a slot holds pages of its own shard's pool only,
named by their ids within it, so that its decode steps read and write its own device's memory.

A session (`session.Session`) asks this for pages and acts on the answers (the device's page tables,
the queue); the prompts' shared pages are held in the session's prefills (`_Prefill.pages`, keyed
(prompt id, shard)).
"""
from __future__ import annotations

import numpy as np

from dapo_jax import errors
from dapo_jax.model import paged_cache
from dapo_jax.rollout import pages as pages_lib


class SlotPages:
  """Per shard a pool of `engine.kv_pages` pages; per slot of the current width the pages it holds,
  the logical pages [0, covered) its table names, and when its sample started."""

  def __init__(self, engine, width: int, episodes: bool = False):  # engine: the `engine.Engine` whose pool this is
    """`episodes`: every sample is an episode, which cannot start over from its prompt (its environment
    has moved on): a sample starts only where its whole budget's pages are free beside the running
    samples' (theirs to the end of their budgets too), so none is ever pre-empted."""
    self.e, self.G, self.episodes = engine, engine.shards, episodes
    self.pools = [pages_lib.PagePool(engine.kv_pages, engine.page_size) for _ in range(self.G)]
    self.held: list[list[int]] = [[] for _ in range(width)]
    self.covered = np.zeros(width, np.int32)
    self.started_at = np.zeros(width, np.int64)  # Start number of each slot's sample: pre-emption takes the latest.
    self.starts = 0
    self.preempted_last = [False] * self.G  # Per shard: the last round's growth pre-empted a sample there.
    self.prompt_pages = 0         # Prompt pages written (one copy per prompt, prefill and shard).
    self.prompt_pages_shared = 0  # Prompt pages a sample took from another's copy instead of its own.
    self.preempted = 0            # Samples pre-empted (their pages freed, re-queued from their prompt).
    self.recomputed_tokens = 0    # Tokens the pre-empted samples had drawn, drawn again later.
    self.prefix_cache = engine.prefix_cache
    self.prefix_hits = 0          # Prompt pages a prefill found in a prefix cache (their tokens not computed).

  def shard(self, s: int) -> int:
    """The batch shard of slot `s` (at the current width)."""
    return s // (len(self.held) // self.G)

  def rows_to_fit(self, busy_slots: list[int]) -> int:
    """The width that holds the busy slots without moving one to another shard: G x the busiest shard's."""
    return self.G * max(np.bincount([self.shard(s) for s in busy_slots], minlength=self.G))

  # --- what a sample needs ------------------------------------------------------------------------

  def prompt_pages_of(self, prefill, w) -> tuple[list[int], int]:
    """The logical pages of `w`'s prompt that it shares with the other samples of its prefill (a session's
    `_Prefill`) on its shard (the whole pages of its tokens: those below the completion's first page),
    and its own first page."""
    first_own = int(prefill.real_UP[prefill.row[w.prompt_id]].sum()) // self.e.page_size
    return list(range(first_own)), first_own

  def keys(self, w) -> list[bytes]:
    """The prefix cache's keys of `w`'s prompt's whole pages."""
    return pages_lib.prefix_keys(w.prompt_P[w.mask_P.astype(bool)], self.e.page_size)

  def skippable_keys(self, w) -> list[bytes]:
    """The keys of the whole pages a prefill of `w`'s prompt may take from a cache: all but those of
    its last token (whose logits the prefill must compute)."""
    return self.keys(w)[:(int(w.mask_P.sum()) - 1) // self.e.page_size]

  def cached_run(self, w) -> tuple[int, list[int]]:
    """The longest run of `w`'s prompt's first pages that a shard's prefix cache holds: (that shard,
    their pages), leaving at least the prompt's last token to compute."""
    keys = self.skippable_keys(w)
    runs = [(len(run), -g, run) for g, pool in enumerate(self.pools) for run in [pool.lookup(keys)]]
    _, g, run = max(runs)
    return -g, run

  def clear_prefix_cache(self) -> None:
    for pool in self.pools:
      pool.clear()

  def last_page(self, w, drawn: int, steps: int) -> int:
    """The logical page of the last token `w` may write within `steps` more tokens."""
    most = min(drawn + steps, self.e.C if self.episodes else w.max_tokens, w.stop_at, self.e.C)
    return (int(w.mask_P.sum()) + max(most, 1) - 1) // self.e.page_size

  def _running(self, slot_work, g: int) -> list[int]:
    """Shard g's slots whose samples hold pages (a cancelled one holds none and grows no more)."""
    return [s for s, w in enumerate(slot_work) if w is not None and self.held[s] and self.shard(s) == g]

  def _growth(self, slot_work, drawn, slots: list[int], steps: int) -> list[tuple[int, int]]:
    """(slot, logical page) of every page the samples of `slots` need for `steps` more tokens."""
    return [(s, j) for s in slots
            for j in range(self.covered[s], self.last_page(slot_work[s], int(drawn[s]), steps) + 1)]

  # --- starting samples ---------------------------------------------------------------------------

  def admit(self, work, free: list[int], prefills, slot_work, drawn) -> tuple[list, list[int]]:
    """Places the longest start of `work` (queued samples, in order) in the `free` slots: each on a shard
    with a free slot whose free pages, less those its running samples need for the next
    `engine.RESERVE_ROUNDS` rounds (a reserve for their growth), hold the sample's own pages for one
    round and its prompt's pages not held on that shard yet; a shard that pre-empted a sample before
    this round admits none while samples run there (what it freed would go to a newcomer, and the next
    round pre-empt again). Of the shards that fit, the one where it costs the fewest pages (its prompt's
    pages are there: its group gathers on a shard), then the one with the most free pages. Returns
    (the samples started, their slots)."""
    rt = self.e.round_tokens
    reserve = self.e.C if self.episodes else self.e.reserve_rounds * rt
    room = [pool.available - len(self._growth(slot_work, drawn, self._running(slot_work, g), reserve))
            for g, pool in enumerate(self.pools)]
    paused = [self.preempted_last[g] and bool(self._running(slot_work, g)) for g in range(self.G)]
    free_of = [[] if paused[g] else [s for s in free if self.shard(s) == g] for g in range(self.G)]
    written: set[tuple[int, int]] = set()
    started, slots = [], []
    for w in work:
      prefill = prefills[w.prompt_id]
      shared, first_own = self.prompt_pages_of(prefill, w)
      own = self.last_page(w, 0, self.e.C if self.episodes else rt) - first_own + 1
      costs = [(own + (0 if (w.prompt_id, g) in prefill.pages or (w.prompt_id, g) in written else len(shared)),
                -room[g], g) for g in range(self.G) if free_of[g]]
      fits = [c for c in costs if c[0] <= room[c[2]]]
      if not fits:
        break
      need, _, g = min(fits)
      room[g] -= need
      written.add((w.prompt_id, g))
      started.append(w)
      slots.append(free_of[g].pop(0))
    return started, slots

  def start(self, prefill, work, slots: list[int]):
    """Pages for samples starting from `prefill` in `slots`: their prompt's shared pages on their shard
    (written once there) and their own for the first round (the first a copy of the prompt's partial
    last page). Returns `slots.start_paged`'s page arguments: table rows [A, M], the page writes per
    shard (prompt row, logical page, page of the shard's pool) [G, W] and the most writes of a shard."""
    e, p = self.e, self.e.page_size
    A, M = len(self.held), e.pages_per_sample
    W = A // self.G * (e.P // p + 1)  # A shard's samples' shared pages and own partial pages, at most.
    table_AM = np.full((A, M), paged_cache.NULL_PAGE, np.int32)
    writes: list[list[tuple[int, int, int]]] = [[] for _ in range(self.G)]
    for a, (w, s) in enumerate(zip(work, slots)):
      g, u, pool = self.shard(s), prefill.row[w.prompt_id], self.pools[self.shard(s)]
      shared_js, first_own = self.prompt_pages_of(prefill, w)
      if (w.prompt_id, g) in prefill.pages:
        self.prompt_pages_shared += len(shared_js)
      else:  # The prompt's first sample on this shard: its pages are written (those the shard's prefix cache
        # does not hold), and the prefill holds them.
        keys = self.keys(w)[:len(shared_js)]
        hit = pool.lookup(keys) if self.prefix_cache else []
        pool.retain(hit)
        new = pool.allocate(len(shared_js) - len(hit))
        prefill.pages[(w.prompt_id, g)] = hit + new
        writes[g] += [(u, j, page) for j, page in zip(shared_js[len(hit):], new)]
        if self.prefix_cache:
          pool.keep(keys[len(hit):], new)
        self.prompt_pages += len(new)
      shared = prefill.pages[(w.prompt_id, g)]
      pool.retain(shared)
      last = self.last_page(w, 0, e.round_tokens)
      own = pool.allocate(last - first_own + 1)
      if int(w.mask_P.sum()) % p:  # Its first page holds the prompt's last tokens: a copy of its own.
        writes[g].append((u, first_own, own[0]))
      table_AM[a, shared_js] = shared
      table_AM[a, first_own:last + 1] = own
      self.held[s] = shared + own
      self.covered[s] = last + 1
      self.started_at[s] = self.starts
      self.starts += 1
    return (table_AM, *self._write_arrays(writes, W))

  def seed(self, prefill, work, g: int):
    """Shard g's prefix cache keeps the whole pages of `work`'s prompts (a prefill's) that it does not
    hold yet, written from the prefill now, so that the prompts prefilled after them (in this insert, or
    later) start after them; no sample holds them yet (idle). Returns `start`'s page-write arrays, or
    None (nothing to write, or no room)."""
    pool, writes = self.pools[g], [[] for _ in range(self.G)]
    for w in work:
      keys = self.keys(w)
      todo = keys[len(pool.lookup(keys)):]
      if not todo or pool.available < len(todo):
        continue
      new = pool.allocate(len(todo))
      pool.keep(todo, new)
      pool.release(new)
      writes[g] += [(prefill.row[w.prompt_id], len(keys) - len(todo) + i, page) for i, page in enumerate(new)]
      self.prompt_pages += len(new)
    if not writes[g]:
      return None
    return self._write_arrays(writes, 1 << (len(writes[g]) - 1).bit_length())

  def _write_arrays(self, writes: list[list[tuple[int, int, int]]], W: int):
    """Page writes per shard (prompt row, logical page, page of the shard's pool) as `[G, W]` arrays
    (entries past a shard's writes out of its range: none) and the most writes of a shard."""
    src_GW, page_GW = np.zeros((2, self.G, W), np.int32)
    dst_GW = np.full((self.G, W), self.e.kv_pages, np.int32)  # Out of the shard's range: no write.
    for g, ws in enumerate(writes):
      if ws:
        src_GW[g, :len(ws)], page_GW[g, :len(ws)], dst_GW[g, :len(ws)] = np.array(ws, np.int32).T
    return src_GW, page_GW, dst_GW, np.int32(max(len(ws) for ws in writes))

  # --- growing, pre-empting, freeing --------------------------------------------------------------

  def grow(self, slot_work, drawn, steps: int, prefills) -> tuple[list[tuple[int, int, int]], list[int]]:
    """Allocates the pages the running samples may write within `steps` more tokens, shard by shard.
    Where a shard's free pages fall short, its latest started samples are pre-empted, their pages freed,
    until they do (the earliest started always run on: no sample waits forever behind later ones, and
    the latest has drawn the fewest tokens to draw again); if its one sample left still falls short, the
    pages that prefills hold for waiting samples there are let go. Returns (slot, logical page, page) of
    every page added, and the pre-empted slots, the latest started first (the caller re-queues them)."""
    added, victims = [], []
    self.preempted_last = [False] * self.G
    for g, pool in enumerate(self.pools):
      running = self._running(slot_work, g)
      need = self._growth(slot_work, drawn, running, steps)
      while len(need) > pool.available:
        if self.episodes:  # Admission left room for every episode's budget: this is a bug, not a load.
          raise RuntimeError(f"batch shard {g}'s pool cannot hold its episodes' next pages ({len(need)} needed, "
                             f"{pool.available} available)")
        if len(running) > 1:
          victim = max(running, key=lambda s: self.started_at[s])
          running.remove(victim)
          self.preempted += 1
          self.recomputed_tokens += int(drawn[victim])
          self.release(victim)
          victims.append(victim)
          self.preempted_last[g] = True
        elif not self.let_go_prompts(prefills, g):
          raise self.dry(len(need), g, len(running))
        need = self._growth(slot_work, drawn, running, steps)
      for (s, j), page in zip(need, pool.allocate(len(need))):
        self.held[s].append(page)
        self.covered[s] = j + 1
        added.append((s, j, page))
    return added, sorted(victims, key=lambda s: -self.started_at[s])

  def release(self, s: int) -> None:
    """Slot `s`'s sample lets go of its pages."""
    self.pools[self.shard(s)].release(self.held[s])
    self.held[s] = []
    self.covered[s] = 0

  def drop_prompt(self, prefill, prompt_id: int) -> None:
    """`prefill` lets go of `prompt_id`'s shared pages, on every shard (no more of its samples wait)."""
    for key in [k for k in prefill.pages if k[0] == prompt_id]:
      self.pools[key[1]].release(prefill.pages.pop(key))

  def let_go_prompts(self, prefills, g: int) -> bool:
    """The prefills let go of their shared prompt pages on shard g (their waiting samples will write them
    again); whether any were held."""
    held = False
    for prefill in {id(p): p for p in prefills.values()}.values():
      for key in [k for k in prefill.pages if k[1] == g]:
        self.pools[g].release(prefill.pages.pop(key))
        held = True
    return held

  def resize(self, busy_slots: list[int], width: int) -> np.ndarray:
    """Moves the busy slots' pages into a width of `width` slots, each to the first slots of its own shard
    there (its pages are that shard's). Returns the old slot of each new one [width] (the old width where
    none: an empty slot)."""
    old, per = len(self.held), width // self.G
    rows_N = np.full(width, old, np.int32)
    for g in range(self.G):
      mine = [s for s in busy_slots if self.shard(s) == g]
      rows_N[g * per:g * per + len(mine)] = mine
    take = lambda x, fill: [x[r] if r < old else fill() for r in rows_N]
    self.held = take(self.held, list)
    self.covered = np.array(take(self.covered, lambda: 0), np.int32)
    self.started_at = np.array(take(self.started_at, lambda: 0), np.int64)
    return rows_N

  # --- reporting ----------------------------------------------------------------------------------

  def stats(self) -> dict:
    return dict(kv_pages=self.e.kv_pages, kv_shards=self.G, kv_pages_used=sum(p.used for p in self.pools),
                kv_pages_peak=max(p.peak for p in self.pools), kv_pages_peak_shards=[p.peak for p in self.pools],
                prompt_pages=self.prompt_pages, prompt_pages_shared=self.prompt_pages_shared,
                preempted=self.preempted, recomputed_tokens=self.recomputed_tokens,
                **(dict(prefix_cache_hits=self.prefix_hits, prefix_cache_pages=sum(len(p.cached) for p in self.pools),
                        prefix_cache_evicted=sum(p.evicted for p in self.pools)) if self.prefix_cache else {}))

  def dry(self, need: int, g: int, running: int) -> errors.ConfigError:
    """The pool cannot hold what it must: one sample alone on its shard (`Engine` refuses a pool smaller
    than one sample's pages, so this names a pool that cannot hold the samples it was sized for)."""
    e, pool = self.e, self.pools[g]
    return errors.ConfigError(
        f"rollout.kv_pages={pool.num_pages}: the page pool of batch shard {g} ran dry ({running} samples there "
        f"hold {pool.used} pages of {e.page_size} tokens, {need} more needed, none left to pre-empt): one "
        f"sample of {e.P} + {e.C} tokens needs {e.pages_per_sample} pages and the null page")
