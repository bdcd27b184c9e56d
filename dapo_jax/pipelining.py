"""One-step-off rollouts (`rollout.max_staleness=1`, docs/async.md): step k+1's groups are generated
in a background thread by the policy before update k while update k runs on the main thread.

JAX releases the GIL while its programs run, so the rollout's host work (scoring, batching, admission)
and its device programs interleave with the update's. The train step donates the state's buffers, so
the rollout reads its own copy of the params (`snapshot`), taken before the update is dispatched.

Versions: the params at the start of rollout step k are version k (k updates applied). A row sampled
by version v and trained at step k has staleness k - v (`staleness`).
"""
from __future__ import annotations

import concurrent.futures

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


class Prefetch:
  """At most one rollout in flight on a worker thread: `start(fn, *args)`, then `result()`.

  `in_order`: `start` runs the rollout at once on the calling thread instead. Several JAX processes
  must issue the same device programs in the same order, which a thread racing the update cannot
  promise; run in order, the rollout of step k+1 still samples by the params before update k (the
  same samples, staleness and losses as the threaded one), only without the overlap.
  """

  def __init__(self, in_order: bool = False):
    self.in_order = in_order
    self._pool = None if in_order else concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                             thread_name_prefix="rollout")
    self._future = None
    self.step = None  # the rollout step the pending result is for

  @property
  def pending(self) -> bool:
    return self._future is not None

  @property
  def running(self) -> bool:
    """The rollout in flight has not finished yet."""
    return self._future is not None and not self._future.done()

  def start(self, step: int, fn, *args) -> None:
    assert self._future is None, "one rollout in flight at most"
    if self.in_order:
      future = concurrent.futures.Future()
      try:
        future.set_result(fn(*args))
      except Exception as e:  # noqa: BLE001 (re-raised by `result`, as the thread's would be)
        future.set_exception(e)
    else:
      future = self._pool.submit(fn, *args)
    self.step, self._future = step, future

  def wait(self) -> None:
    """Blocks until the rollout in flight is done (its result kept), e.g. before an evaluation that
    shares its engine."""
    if self._future is not None:
      concurrent.futures.wait([self._future])

  def result(self):
    """The pending rollout's result (waiting for it); re-raises its exception."""
    future, self._future = self._future, None
    return future.result()

  def close(self) -> None:
    if self._future is not None:  # Let the rollout finish: its engine and reward workers are shared.
      try:
        self._future.result()
      except Exception:  # noqa: BLE001 (it is being discarded)
        pass
      self._future = None
    if self._pool is not None:
      self._pool.shutdown(wait=True)


def stamp_collected(collected, carry, version: int):
  """Stamps `DAPO.collect`'s (groups, stats, info) and the surplus it carries to the next step, all
  sampled by `version` (so a group carried over for several steps keeps its true version)."""
  stamp(collected[0], version)
  stamp(carry, version, carried_are_older=False)
  return collected
