"""A reward-model server over HTTP: POST /score {"prompts": [...], "responses": [...]} -> {"scores": [...]}.

Any `score_fn(prompts, responses) -> list[float]` can be served. Concurrent requests are batched into
one `score_fn` call by a batcher thread (up to `max_batch` responses, waiting at most `max_wait_ms`
for more after the first), so an accelerator-backed scorer sees large batches. The server binds to
127.0.0.1 unless told otherwise; on any other address it requires a shared token, which requests
carry as `Authorization: Bearer <token>`. Standard library only; nothing here imports jax.
"""
from __future__ import annotations

import hmac
import http.server
import json
import logging
import math
import os
import queue
import threading
import time
from typing import Callable, Sequence

from dapo_jax.rewards import clients as rewards

ScoreFn = Callable[[Sequence[str], Sequence[str]], Sequence[float]]
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
TOKEN_ENV = "DAPO_RM_TOKEN"
MAX_BODY_BYTES = 64 << 20


class ServerConfigError(rewards.RewardConfigError):
  """A server that cannot start as configured (e.g. a public address without a token)."""


class _Job:
  def __init__(self, prompts: list[str], responses: list[str]):
    self.prompts, self.responses = prompts, responses
    self.done = threading.Event()
    self.scores: list[float] | None = None
    self.error: str | None = None


class Batcher:
  """Collects jobs from many request threads and scores them together in one thread."""

  def __init__(self, score_fn: ScoreFn, max_batch: int = 64, max_wait_ms: float = 10.0):
    if max_batch < 1:
      raise ServerConfigError(f"max_batch={max_batch} must be >= 1")
    self.score_fn, self.max_batch, self.max_wait_s = score_fn, max_batch, max_wait_ms / 1000.0
    self.calls = 0            # score_fn calls so far
    self.batch_sizes: list[int] = []
    self._queue: queue.Queue[_Job | None] = queue.Queue()
    self._thread = threading.Thread(target=self._run, name="rm-batcher", daemon=True)
    self._thread.start()

  def submit(self, prompts: list[str], responses: list[str], timeout_s: float | None = None) -> list[float]:
    job = _Job(prompts, responses)
    self._queue.put(job)
    if not job.done.wait(timeout_s):
      raise TimeoutError(f"scoring did not finish within {timeout_s}s")
    if job.error is not None:
      raise RuntimeError(job.error)
    return job.scores  # type: ignore[return-value]

  def close(self) -> None:
    self._queue.put(None)
    self._thread.join(timeout=5)

  def _run(self) -> None:
    while True:
      job = self._queue.get()
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
        jobs.append(nxt)
        n += len(nxt.responses)
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
      error = None
    except Exception as e:  # The scorer failed: every request of the batch gets a 500, the server lives on.
      logging.warning("score_fn failed on a batch of %d: %s: %s", len(responses), type(e).__name__, e)
      scores, error = [], f"{type(e).__name__}: {e}"
    start = 0
    for j in jobs:
      if error is None:
        j.scores = scores[start:start + len(j.responses)]
      j.error = error
      start += len(j.responses)
      j.done.set()


def _handler(server: "RMServer"):
  class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # Per-request lines go to debug logging, not stderr.
      logging.debug("rm_server: " + fmt, *args)

    def _reply(self, code: int, body: dict) -> None:
      data = json.dumps(body).encode()
      self.send_response(code)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)

    def _authorised(self) -> bool:
      if server.token is None:
        return True
      got = self.headers.get("Authorization", "")
      return hmac.compare_digest(got.encode(), f"Bearer {server.token}".encode())

    def do_GET(self):
      if self.path.rstrip("/") == "/health":
        return self._reply(200, {"status": "ok"})
      self._reply(404, {"error": f"no route {self.path}; POST /score or GET /health"})

    def do_POST(self):
      if self.path.rstrip("/") != "/score":
        return self._reply(404, {"error": f"no route {self.path}; POST /score"})
      if not self._authorised():
        return self._reply(401, {"error": "missing or wrong 'Authorization: Bearer <token>'"})
      try:
        length = int(self.headers.get("Content-Length", "-1"))
      except ValueError:
        length = -1
      if length < 0:
        return self._reply(411, {"error": "Content-Length required"})
      if length > MAX_BODY_BYTES:
        return self._reply(413, {"error": f"request of {length} bytes exceeds {MAX_BODY_BYTES}"})
      try:
        body = json.loads(self.rfile.read(length))
        prompts, responses = body["prompts"], body["responses"]
        if not (isinstance(prompts, list) and isinstance(responses, list)
                and all(isinstance(s, str) for s in prompts + responses)):
          raise ValueError("'prompts' and 'responses' must be lists of strings")
        if len(prompts) != len(responses):
          raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
      except (ValueError, KeyError, TypeError) as e:
        return self._reply(400, {"error": f"bad request: {type(e).__name__}: {e}"})
      if not responses:
        return self._reply(200, {"scores": []})
      try:
        scores = server.batcher.submit(prompts, responses, server.request_timeout_s)
      except (RuntimeError, TimeoutError) as e:
        return self._reply(500, {"error": str(e)})
      self._reply(200, {"scores": [s if math.isfinite(s) else None for s in scores]})

  return Handler


class _HTTPServer(http.server.ThreadingHTTPServer):
  daemon_threads = True

  def handle_error(self, request, client_address):
    import sys
    e = sys.exc_info()[1]
    if isinstance(e, (BrokenPipeError, ConnectionResetError)):  # The client gave up (its timeout).
      logging.debug("rm_server: client %s went away: %s", client_address, e)
    else:
      logging.warning("rm_server: request from %s failed: %s: %s", client_address, type(e).__name__, e)


class RMServer:
  """The HTTP reward-model server; a context manager (`start()` serves in a thread, `close()` stops)."""

  def __init__(self, score_fn: ScoreFn, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
               max_batch: int = 64, max_wait_ms: float = 10.0, request_timeout_s: float = 600.0):
    token = token or os.environ.get(TOKEN_ENV) or None
    if host not in LOCAL_HOSTS and not token:
      raise ServerConfigError(f"refusing to serve on {host!r} without a token: pass --token or set {TOKEN_ENV} "
                              "(only 127.0.0.1 / localhost may go without one)")
    self.token, self.request_timeout_s = token, request_timeout_s
    self.batcher = Batcher(score_fn, max_batch, max_wait_ms)
    try:
      self.httpd = _HTTPServer((host, port), _handler(self))
    except OSError as e:
      self.batcher.close()
      raise ServerConfigError(f"cannot bind {host}:{port}: {e}") from None
    self._thread: threading.Thread | None = None

  @property
  def url(self) -> str:
    host, port = self.httpd.server_address[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

  def serve_forever(self) -> None:
    self.httpd.serve_forever()

  def start(self) -> "RMServer":
    self._thread = threading.Thread(target=self.httpd.serve_forever, name="rm-server", daemon=True)
    self._thread.start()
    return self

  def close(self) -> None:
    if self._thread is not None:
      self.httpd.shutdown()
      self._thread.join(timeout=5)
    self.httpd.server_close()
    self.batcher.close()

  def __enter__(self) -> "RMServer":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.close()


def load_scorer(spec: str, model_dir: str | None) -> ScoreFn:
  """'package.module:factory' -> factory(model_dir): the score_fn a server runs."""
  return rewards.resolve(spec)(model_dir)
