"""A reward-model server over HTTP: POST /score {"prompts": [...], "responses": [...]} -> {"scores": [...]}.

Any `score_fn(prompts, responses) -> list[float]` can be served. Concurrent requests are batched into
one `score_fn` call by a batcher thread (up to `max_batch` responses, waiting at most `max_wait_ms`
for more after the first), so an accelerator-backed scorer sees large batches; a request larger than
`max_batch` is scored in parts, so the scorer never sees more. It runs on FastAPI +
uvicorn with the plumbing the policy server uses (`serve.http`: the bind rule, the bearer token, the
body cap, error objects {"error": {"message", "type", "param", "code"}}); `pip install -e ".[serve]"`.
The server binds to 127.0.0.1 unless told otherwise; on any other address it requires a shared token,
which requests carry as `Authorization: Bearer <token>`. Nothing here imports jax.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import math
import os
import queue
import threading
import time
from typing import Callable, Sequence

import fastapi
import pydantic

from dapo_jax.rewards import clients as rewards
from dapo_jax.serve import http

ScoreFn = Callable[[Sequence[str], Sequence[str]], Sequence[float]]
LOCAL_HOSTS = http.LOCAL_HOSTS
TOKEN_ENV = "DAPO_RM_TOKEN"
MAX_BODY_BYTES = http.MAX_BODY_BYTES


class ServerConfigError(rewards.RewardConfigError, http.ServerConfigError):
  """A server that cannot start as configured (e.g. a public address without a token)."""


class ScorerFailed(RuntimeError):
  """The scorer raised (or miscounted) on a batch; `error_id` names the log line with the cause."""

  def __init__(self, error_id: str):
    super().__init__(f"the scorer failed ({error_id})")
    self.error_id = error_id


class _Job:
  def __init__(self, prompts: list[str], responses: list[str]):
    self.prompts, self.responses = prompts, responses
    self.future: cf.Future[list[float]] = cf.Future()  # ScorerFailed if the scorer fails


class Batcher:
  """Collects jobs from many requests and scores them together in one thread."""

  def __init__(self, score_fn: ScoreFn, max_batch: int = 64, max_wait_ms: float = 10.0):
    if max_batch < 1:
      raise ServerConfigError(f"max_batch={max_batch} must be >= 1")
    self.score_fn, self.max_batch, self.max_wait_s = score_fn, max_batch, max_wait_ms / 1000.0
    self.calls = 0            # score_fn calls so far
    self.batch_sizes: list[int] = []
    self._queue: queue.Queue[_Job | None] = queue.Queue()
    self._thread = threading.Thread(target=self._run, name="rm-batcher", daemon=True)
    self._thread.start()

  def enqueue(self, prompts: list[str], responses: list[str]) -> cf.Future:
    """Queues a request's responses, in parts of at most `max_batch`; the future holds their scores
    (or a part's failure, which cancels the other parts). Cancelling it drops the parts whose batch
    has not started."""
    parts = [_Job(prompts[i:i + self.max_batch], responses[i:i + self.max_batch])
             for i in range(0, len(responses), self.max_batch)]
    if len(parts) == 1:
      self._queue.put(parts[0])
      return parts[0].future
    whole: cf.Future[list[float]] = cf.Future()
    left, lock = [len(parts)], threading.Lock()

    def part_done(part: cf.Future) -> None:
      with lock:
        if whole.done():
          return
        if not part.cancelled() and part.exception() is not None:
          whole.set_exception(part.exception())
        else:
          left[0] -= 1
          if left[0]:
            return
          whole.set_result([x for p in parts for x in p.future.result()])
      for p in parts:  # (After a failure: the others are not scored.)
        p.future.cancel()

    def whole_done(_) -> None:
      if whole.cancelled():
        for p in parts:
          p.future.cancel()

    if not parts:
      whole.set_result([])
    whole.add_done_callback(whole_done)
    for p in parts:
      p.future.add_done_callback(part_done)
      self._queue.put(p)
    return whole

  def submit(self, prompts: list[str], responses: list[str], timeout_s: float | None = None) -> list[float]:
    future = self.enqueue(prompts, responses)
    try:
      return future.result(timeout_s)
    except cf.TimeoutError:
      future.cancel()
      raise TimeoutError(f"scoring did not finish within {timeout_s}s") from None

  def close(self) -> None:
    self._queue.put(None)
    self._thread.join(timeout=5)

  def _run(self) -> None:
    held = None  # A job that did not fit the last batch: it opens the next.
    while True:
      job = held if held is not None else self._queue.get()
      held = None
      if job is None:
        return
      jobs, n = [job], len(job.responses)
      deadline = time.monotonic() + self.max_wait_s
      while n < self.max_batch:
        try:
          nxt = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
          break
        if nxt is None:
          self._queue.put(None)  # Finish this batch, then stop.
          break
        if n + len(nxt.responses) > self.max_batch:
          held = nxt
          break
        jobs.append(nxt)
        n += len(nxt.responses)
      # A request that gave up (its timeout) cancelled its future: it is not scored.
      jobs = [j for j in jobs if j.future.set_running_or_notify_cancel()]
      if jobs:
        self._score(jobs)

  def _score(self, jobs: list[_Job]) -> None:
    prompts = [p for j in jobs for p in j.prompts]
    responses = [r for j in jobs for r in j.responses]
    self.calls += 1
    self.batch_sizes.append(len(responses))
    try:
      scores = [float(s) for s in self.score_fn(prompts, responses)]
      if len(scores) != len(responses):
        raise ValueError(f"score_fn returned {len(scores)} scores for {len(responses)} responses")
    except Exception:  # The scorer failed: every request of the batch gets a 500 naming an id, the server lives on.
      eid = http.error_id()
      logging.warning("score_fn failed on a batch of %d (%s)", len(responses), eid, exc_info=True)
      for j in jobs:
        j.future.set_exception(ScorerFailed(eid))
      return
    start = 0
    for j in jobs:
      j.future.set_result(scores[start:start + len(j.responses)])
      start += len(j.responses)


class ScoreRequest(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(strict=True, extra="ignore")
  prompts: list[str]
  responses: list[str]


def make_app(batcher: Batcher, token: str | None, request_timeout_s: float = 600.0,
             max_body_bytes: int = http.Limits.max_body_bytes) -> fastapi.FastAPI:
  """The ASGI app: POST /score and GET /health, with `serve.http`'s token, body cap and error objects."""
  app = http.new_app("dapo_jax reward model", token, max_body_bytes)

  @app.post("/score")
  async def score(request: fastapi.Request):
    # The body is read and checked here rather than by a typed parameter, so that any Content-Type
    # is taken (as the standard-library server took it) and a bad body is a 400 naming the field.
    body = await request.body()  # Capped as it arrives (`http.new_app`), chunked or not.
    try:
      req = ScoreRequest.model_validate_json(body)
    except pydantic.ValidationError as e:
      err = e.errors()[0]
      field = ".".join(str(x) for x in err.get("loc", ())) or None
      raise http.APIError(400, f"bad request: {field or 'body'}: {err.get('msg', 'invalid')}", param=field) from None
    if len(req.prompts) != len(req.responses):
      raise http.APIError(400, f"bad request: {len(req.prompts)} prompts for {len(req.responses)} responses",
                          param="responses")
    if not req.responses:
      return {"scores": []}
    # The batcher's future is awaited, not waited on in a thread: the event loop keeps serving, and
    # every request in flight can join the same batch (no thread pool caps how many wait at once).
    future = batcher.enqueue(req.prompts, req.responses)
    try:
      scores = await asyncio.wait_for(asyncio.wrap_future(future), request_timeout_s)
    except asyncio.TimeoutError:
      raise http.APIError(500, f"scoring did not finish within {request_timeout_s}s", code="timeout") from None
    except ScorerFailed as e:
      raise http.internal_error("the scorer failed on this request's batch", e.error_id, "scorer_failed") from None
    return {"scores": [s if math.isfinite(s) else None for s in scores]}

  return app


class RMServer:
  """The HTTP reward-model server within `limits` (`http.Limits`); a context manager (`start()`
  serves in a thread, `close()` stops)."""

  def __init__(self, score_fn: ScoreFn, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
               max_batch: int = 64, max_wait_ms: float = 10.0, request_timeout_s: float = 600.0,
               limits: http.Limits = http.Limits()):
    token = token or os.environ.get(TOKEN_ENV) or None
    try:
      http.check_bind(host, token, TOKEN_ENV)
    except http.ServerConfigError as e:
      raise ServerConfigError(str(e)) from None
    self.token, self.request_timeout_s = token, request_timeout_s
    self.batcher = Batcher(score_fn, max_batch, max_wait_ms)
    try:
      app = make_app(self.batcher, token, request_timeout_s, limits.max_body_bytes)
      self.server = http.Server(app, host, port, name="rm-server", limits=limits)
    except http.ServerConfigError as e:
      self.batcher.close()
      raise ServerConfigError(str(e)) from None

  @property
  def url(self) -> str:
    return self.server.url

  def serve_forever(self) -> None:
    self.server.serve_forever()

  def start(self) -> "RMServer":
    self.server.start()
    return self

  def close(self) -> None:
    self.server.close()
    self.batcher.close()

  def __enter__(self) -> "RMServer":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.close()


def load_scorer(spec: str, model_dir: str | None) -> ScoreFn:
  """'package.module:factory' -> factory(model_dir): the score_fn a server runs."""
  return rewards.resolve(spec)(model_dir)
