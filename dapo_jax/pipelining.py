"""Rollouts ahead of the update (`rollout.max_staleness=S`, docs/async.md): the groups of steps up to
k+S are generated in a background thread by the policy before update k while update k runs on the
main thread; S=1 is one-step-off.

JAX releases the GIL while its programs run, so the rollout's host work (scoring, batching, admission)
and its device programs interleave with the update's. The train step donates the state's buffers, so
the rollout reads its own copy of the params (`snapshot`), taken before the update is dispatched.

Versions: the params at the start of rollout step k are version k (k updates applied). A row sampled
by version v and trained at step k has staleness k - v (`staleness`).
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def snapshot(params):
  """A copy of `params` in new buffers (same shardings) that survives the train step's donation."""
  return jax.tree.map(jnp.copy, params)


def stamp(groups, version: int, carried_are_older: bool = True):
  """Stamps `groups`' unstamped rows (version -1) with `version`; with `carried_are_older`,
  carried-over rows with `version - 1` (unstamped ones come from a checkpoint written before the loop
  stamped its carry as it made it, `stamp_collected`). In place; returns groups."""
  if groups is not None:
    fresh_QG = groups.version_QG < 0
    sampled_QG = np.where(groups.carried_Q[:, None] & carried_are_older, version - 1, version)
    groups.version_QG = np.where(fresh_QG, sampled_QG, groups.version_QG).astype(np.int32)
  return groups


def staleness(groups, step: int) -> np.ndarray:
  """int32 [Q, G]: policy versions between each row's sampler and the policy that trains at `step`."""
  return (step - groups.version_QG).astype(np.int32)


def mark_stale(groups, step: int, decoupled: bool):
  """Flags rows sampled before `step` as behaviour rows (π_old = their sampler's log-probs, as
  carried groups are) unless `decoupled`: then π_old is this step's policy (AReaL's proximal one)
  and the sampler's log-probs reach the loss only through `dapo.rollout_correction`. In place."""
  if groups is not None and not decoupled:
    groups.carried_Q = groups.carried_Q | (groups.version_QG < step).any(1)
  return groups


@dataclasses.dataclass
class _Queued:
  step: int                                   # the rollout step it samples for
  future: concurrent.futures.Future | None = None
  before: object = None                       # what `start`'s `before` returned as the rollout began


class Prefetch:
  """Rollouts queued ahead of the loop, run one after the other on one worker thread, in the order
  they were started: `start(step, fn)`, then `result()` for the oldest.

  One worker, because successive rollouts share the engine, the data stream, the keep rate and the
  carried groups: rollout j+1 reads them as rollout j leaves them. `start`'s `before` runs on the
  worker as the rollout begins (e.g. the data position before it), so a stop can drop every rollout
  queued and keep the state before the oldest (`drain`).

  `in_order`: `start` runs the rollout at once on the calling thread instead. Several JAX processes
  must issue the same device programs in the same order, which a thread racing the update cannot
  promise; run in order, the rollout of step j still samples by the params it was given (the same
  samples, staleness and losses as the threaded one), only without the overlap.
  """

  def __init__(self, in_order: bool = False):
    self.in_order = in_order
    self._pool = None if in_order else concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                             thread_name_prefix="rollout")
    self._queue: collections.deque[_Queued] = collections.deque()

  @property
  def pending(self) -> bool:
    return bool(self._queue)

  @property
  def step(self) -> int | None:
    """The rollout step the oldest pending result is for."""
    return self._queue[0].step if self._queue else None

  @property
  def last_step(self) -> int | None:
    """The rollout step queued last."""
    return self._queue[-1].step if self._queue else None

  @property
  def running(self) -> bool:
    """The oldest rollout queued has not finished yet."""
    return bool(self._queue) and not self._queue[0].future.done()

  def start(self, step: int, fn, before=None) -> None:
    assert self.last_step is None or step == self.last_step + 1, (self.last_step, step)
    item = _Queued(step)

    def job():
      if before is not None:
        item.before = before()
      return fn()

    if self.in_order:
      item.future = concurrent.futures.Future()
      try:
        item.future.set_result(job())
      except Exception as e:  # noqa: BLE001 (re-raised by `result`, as the thread's would be)
        item.future.set_exception(e)
    else:
      item.future = self._pool.submit(job)
    self._queue.append(item)

  def wait(self) -> None:
    """Blocks until every queued rollout is done (results kept), e.g. before an evaluation that
    shares their engine."""
    concurrent.futures.wait([q.future for q in self._queue])

  def result(self):
    """The oldest pending rollout's result (waiting for it); re-raises its exception."""
    return self._queue.popleft().future.result()

  def drain(self):
    """Drops every queued rollout (letting each finish: they share the engine and reward workers) and
    returns what `before` returned as the oldest began; None when nothing was queued."""
    if not self._queue:
      return None
    self.wait()
    before = self._queue[0].before
    self._queue.clear()
    return before

  def close(self) -> None:
    self.drain()
    if self._pool is not None:
      self._pool.shutdown(wait=True)


def bound_carry(carry, step: int, max_lag: int):
  """The carried groups that may still be trained at `step`: those sampled at most `max_lag` versions
  before it (unstamped ones, version -1, are taken as one version old); (carry or None, groups dropped)."""
  if carry is None or not len(carry):
    return carry, 0
  version_Q = np.where(carry.version_QG < 0, step - 1, carry.version_QG).min(1)
  fresh = np.flatnonzero(step - version_Q <= max_lag)
  dropped = len(carry) - len(fresh)
  if not dropped:
    return carry, 0
  return (carry.take(fresh) if len(fresh) else None), dropped


def stamp_collected(collected, carry, version: int):
  """Stamps `DAPO.collect`'s (groups, stats, info) and the surplus it carries to the next step, all
  sampled by `version` (so a group carried over for several steps keeps its true version)."""
  stamp(collected[0], version)
  stamp(carry, version, carried_are_older=False)
  return collected


def schedule_seconds(rollout_s, train_s, max_staleness: int) -> float:
  """The wall time of rollout steps whose rollouts take `rollout_s[k]` and whose training (π_old,
  update and the main thread's host work) takes `train_s[k]`, as `loop.DAPO` orders them when the
  two never slow each other down (disjoint devices, host work that fits beside both).

  Rollout j starts when rollout j-1 has ended (one engine) and the params that sample it exist:
  those of update max(j - S, 0) (queued as that update starts); update k starts when update k-1
  and rollout k have ended. S = 0 is the synchronous loop, the sum of both.
  """
  r, t = list(rollout_s), list(train_s)
  assert len(r) == len(t) and r, (len(r), len(t))
  if max_staleness == 0:
    return float(sum(r) + sum(t))
  rollout_end, update_start, update_end = [], [], []
  for k in range(len(r)):
    start = 0.0 if k == 0 else max(rollout_end[k - 1], update_start[max(k - max_staleness, 0)])
    rollout_end.append(start + r[k])
    update_start.append(max(update_end[k - 1] if k else 0.0, rollout_end[k]))
    update_end.append(update_start[k] + t[k])
  return float(update_end[-1])
