"""Requests from many clients on one engine: continuous batching across requests.

    request threads ──submit──► inbox ──► engine thread: add to the session, run a round,
                                          tell each request what its samples drew / that they ended

One thread owns the engine session (a long-lived `engine.Session`, never closed). A request's n
samples are queued like a rollout's group (one prefill); each round returns whenever a sample
ends and at least every `round_steps` tokens, so new requests join within a few tokens and
streams advance. Each sample's key is (seed, sample index): the same seed gives the same text
whatever else is in flight. The pool's width follows the load (grown at once, shrunk when the
busy rows fit half of it), so one client does not pay for 32 slots.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import random
import secrets
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from dapo_jax.rollout import engine as engine_lib
from dapo_jax.rollout import sampling
from dapo_jax.serve import scoring


class QueueFull(Exception):
  """More samples waiting than the server admits (an HTTP 429)."""


@dataclasses.dataclass
class Request:
  """One client's ask: n samples of one prompt. `on_event(kind, sample, tokens, logp)` hears, from
  the engine thread, kind "progress" (tokens drawn so far, when `progress`) and "end" (the sample's
  final tokens; tokens None and logp an error id, under which the log has the cause, when the engine
  failed)."""
  prompt_ids: list[int]
  n: int
  max_tokens: int
  temperature: float
  top_p: float
  on_event: Callable
  seed: int | None = None
  progress: bool = False    # streamed, or stop strings to watch
  images_MD: Any = None     # a vision-language policy's prompt: its image vectors (`serve.images`)
  rid: int = -1             # set by submit: the engine's prompt id
  open_samples: set = dataclasses.field(default_factory=set)   # samples not yet ended (engine thread)


@dataclasses.dataclass
class Ended:
  tokens: np.ndarray
  logp: np.ndarray
  truncated: bool            # no stop token within max_tokens


class Scheduler:
  """The engine thread. `submit` queues a request (thread-safe); `cancel` ends one early."""

  def __init__(self, engine: engine_lib.Engine, params, *, max_queue: int = 1024, compact: bool = False,
               gather_ms: float = 2.0, max_gather_ms: float = 10.0):
    """An idle engine that gets a request waits for more while they keep coming (each within
    `gather_ms` of the last, `max_gather_ms` at most) before its first round, so a burst of
    clients starts together instead of one by one."""
    if not engine.sampler_cfg.per_request or not engine.round_steps:
      raise ValueError("a serving engine needs a per_request sampler and round_steps > 0")
    self.engine, self.params, self.max_queue, self.compact = engine, params, max_queue, compact
    self.gather_s, self.max_gather_s = gather_ms / 1000, max_gather_ms / 1000
    self.inbox: queue.Queue = queue.Queue()
    self.requests: dict[int, Request] = {}
    self.pending = 0           # samples submitted and not yet ended
    self.served = 0            # samples ended
    self._lock = threading.Lock()
    self._next_id = 0
    self._stop = False
    self.session = self._new_session()
    self.scorer = scoring.Scorer(engine.model_cfg, engine.P + engine.C, mesh=engine.mesh)
    self._scores: list[tuple[list[list[int]], concurrent.futures.Future]] = []
    self._thread = threading.Thread(target=self._run, name="serve-engine", daemon=True)
    self._thread.start()

  def _new_session(self) -> engine_lib.Session:
    return self.engine.session(self.params, jax.random.key(0))

  def submit(self, req: Request) -> int:
    return self.submit_all([req])[0]

  def submit_all(self, reqs: list[Request]) -> list[int]:
    """Queues requests whole or not at all: their samples together are checked against the queue
    before any is admitted (QueueFull otherwise), so a client never holds a part it cannot use."""
    for req in reqs:
      if len(req.prompt_ids) > self.engine.P:
        raise ValueError(f"prompt of {len(req.prompt_ids)} tokens exceeds the server's {self.engine.P}")
    n = sum(req.n for req in reqs)
    with self._lock:
      if self.pending + n > self.max_queue:
        raise QueueFull(f"{self.pending} samples in flight and {n} asked for; the server admits {self.max_queue}")
      self.pending += n
      for req in reqs:
        req.rid, self._next_id = self._next_id, self._next_id + 1
    for req in reqs:
      self.inbox.put(("add", req))
    return [req.rid for req in reqs]

  def score(self, rows: list[list[int]]) -> concurrent.futures.Future:
    """Queues token rows for teacher-forced scoring (`scoring.Scorer`) on the engine thread, between
    decode rounds; the future holds one `scoring.Scores` per row (QueueFull when the queue is)."""
    with self._lock:
      if self.pending + len(rows) > self.max_queue:
        raise QueueFull(f"{self.pending} samples in flight and {len(rows)} rows to score; the server admits "
                        f"{self.max_queue}")
      self.pending += len(rows)
    future: concurrent.futures.Future = concurrent.futures.Future()
    self.inbox.put(("score", (rows, future)))
    return future

  def cancel(self, rid: int, sample: int | None = None) -> None:
    """Ends request `rid`'s samples (or one of them) early; each still gets its "end" event."""
    self.inbox.put(("cancel", (rid, sample)))

  def close(self) -> None:
    self._stop = True
    self.inbox.put(("stop", None))
    self._thread.join(timeout=30)

  # --- the engine thread -----------------------------------------------------------------------

  def _admit(self, block: bool) -> None:
    """Takes what the inbox holds; blocking (idle): the first item, then what follows it closely."""
    deadline = None
    while True:
      try:
        if block:
          kind, x = self.inbox.get()
          deadline = time.monotonic() + self.max_gather_s
          block = False
        elif deadline is not None:
          kind, x = self.inbox.get(timeout=max(min(self.gather_s, deadline - time.monotonic()), 0.0))
        else:
          kind, x = self.inbox.get_nowait()
      except queue.Empty:
        return
      if kind == "add":
        self.requests[x.rid] = x
        x.open_samples = set(range(x.n))
        key = x.seed if x.seed is not None else random.getrandbits(31)
        self.session.add([x.rid], np.asarray([x.prompt_ids], np.int32), np.ones((1, len(x.prompt_ids)), bool), x.n,
                         key_ids=[key % (1 << 31)], max_tokens=x.max_tokens, temperature=x.temperature, top_p=x.top_p,
                         images_QMD=None if x.images_MD is None else np.asarray(x.images_MD)[None])
      elif kind == "score":
        self._scores.append(x)
      elif kind == "cancel" and x[0] in self.requests:
        for g in self.session.cancel(*x):  # Never started: they end empty.
          self._end(x[0], g, Ended(np.zeros(0, np.int32), np.zeros(0, np.float32), truncated=False))
      elif kind == "stop":
        return

  def _fit_width(self) -> None:
    """Grows the pool at once to hold what waits, shrinks it once the busy rows fit half of it."""
    s, e = self.session, self.engine
    want = e.width_for(min(s.in_flight + len(s.queue), e.S))
    if want > s.width or 2 * want <= s.width:
      s._resize(want)

  def _round_steps(self) -> int:
    """Short rounds while a slot is free (new requests join at the next) or a client follows its
    tokens (streams, stop strings); with every slot busy and nobody watching, until a sample ends."""
    s = self.session
    watched = any(self.requests[w.prompt_id].progress for w in s.slot_work if w is not None)
    return self.engine.round_steps if watched or s.in_flight < s.width else self.engine.C

  def _run(self) -> None:
    while not self._stop:
      self._admit(block=not self.session.busy)
      if self._scores:
        self._run_scores()
      if self._stop or not self.session.busy:
        continue
      try:
        if self.compact:
          self._fit_width()
        ended = self.session.step(self._round_steps())
        for f in ended:
          self._end(f.prompt_id, f.sample, Ended(f.tokens_C[:f.length], f.logp_C[:f.length], f.truncated))
        if any(self.requests[w.prompt_id].progress for w in self.session.slot_work if w is not None):
          for (rid, g), (tokens, logp) in self.session.progress().items():
            if self.requests[rid].progress:
              self._tell(self.requests[rid], "progress", g, tokens, logp)
      except Exception:  # The engine failed: every request in flight gets the error's id; a fresh session.
        eid = f"err_{secrets.token_hex(6)}"
        logging.exception("serving engine round failed (%s)", eid)
        for rid, req in list(self.requests.items()):
          for g in sorted(req.open_samples):
            self._end(rid, g, None, error=eid)
        self.session = self._new_session()

  def _run_scores(self) -> None:
    """Scores every waiting job's rows in one call; a failure goes to each job's future with an id
    under which the log has the cause."""
    jobs, self._scores = self._scores, []
    rows = [row for job_rows, _ in jobs for row in job_rows]
    try:
      scores = self.scorer(self.params, rows)
    except Exception:  # noqa: BLE001
      eid = f"err_{secrets.token_hex(6)}"
      logging.exception("scoring failed (%s)", eid)
      scores, error = None, RuntimeError(eid)
    with self._lock:
      self.pending -= len(rows)
    start = 0
    for job_rows, future in jobs:
      if scores is None:
        future.set_exception(error)
      else:
        future.set_result(scores[start:start + len(job_rows)])
      start += len(job_rows)

  def _end(self, rid: int, g: int, ended: Ended | None, error: str | None = None) -> None:
    req = self.requests.get(rid)
    if req is None or g not in req.open_samples:
      return
    with self._lock:
      self.pending -= 1
      self.served += 1
    req.open_samples.discard(g)
    if not req.open_samples:
      del self.requests[rid]
    self._tell(req, "end", g, ended, error)

  @staticmethod
  def _tell(req: Request, *event) -> None:
    """Hands a request its event; a client that is gone (its event loop closed) is not the engine's
    problem."""
    try:
      req.on_event(*event)
    except Exception as e:  # noqa: BLE001
      logging.debug("request %d: event dropped (%s)", req.rid, e)


def serving_sampler(sampler_cfg: sampling.SamplerConfig) -> sampling.SamplerConfig:
  """A sampler whose rows carry their requests' temperature and top-p."""
  return dataclasses.replace(sampler_cfg, per_request=True)
