"""Reward clients: a process pool that runs any reward function (named by import path) with a
per-call timeout, a reward server over HTTP, and weighted combinations of rewards.

Nothing here evaluates model text as code, and nothing imports jax at module level (`rm:DIR` imports
the reward model when it is asked for).
"""
from __future__ import annotations

import concurrent.futures as cf
import importlib
import io
import logging
import math
import multiprocessing as mp
import numbers
import os
import re
import sys
import threading
import time
from typing import Callable, Sequence

from dapo_jax import errors

RewardFn = Callable[[str, str], dict]

# --- reward functions by import path, in a pool ------------------------------------------------

class RewardConfigError(errors.UserError, ValueError):
  pass


def resolve(path: str) -> RewardFn:
  """'package.module:function' -> the function; fails at start-up with the path in the message."""
  if ":" not in path:
    raise RewardConfigError(f"reward function {path!r} must look like 'package.module:function'")
  module_name, fn_name = path.split(":", 1)
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise RewardConfigError(f"reward function {path!r}: cannot import module {module_name!r} ({e})") from None
  fn = getattr(module, fn_name, None)
  if not callable(fn):
    raise RewardConfigError(f"reward function {path!r}: module {module_name!r} has no function {fn_name!r}")
  return fn


FAILURE = {"score": -1.0, "acc": False, "pred": "[REWARD_ERROR]"}
_STARTUP_TIMEOUT_S = 300.0
_POLL_S = 0.05  # How often the pool looks for calls that started or ran out of time.
_MAX_SCORE = 3.0e38  # Scores reach the advantages as float32: a larger one would become inf there.
_MAX_PRED = 1000     # characters of `pred` kept (it is logged with samples)
_MAX_MESSAGE = 300   # characters of a reward function's error message kept
_MAX_PRINT = 16384   # characters a worker may print per call; the rest is dropped (one note says so)
_MAX_STALLS = 3      # pools in a row that broke before any call started: the rest of the batch fails


class RewardValueError(ValueError):
  """A reward function returned something that is not a score (not finite, not a number, no 'score')."""


class RewardFunctionError(RuntimeError):
  """A reward function raised; carries its type and the start of its message (always picklable)."""


class _CappedStream(io.TextIOBase):
  """A worker's stdout/stderr: passes the first `_MAX_PRINT` characters of each call through."""

  def __init__(self, stream):
    self.stream, self.left = stream, _MAX_PRINT

  def writable(self) -> bool:
    return True

  def write(self, text: str) -> int:
    if self.left > 0:
      part = text[:self.left]
      self.left -= len(part)
      self.stream.write(part)
      if self.left <= 0:
        self.stream.write(f"\n[reward worker: output beyond {_MAX_PRINT} characters of this call dropped]\n")
    return len(text)

  def flush(self) -> None:
    self.stream.flush()


# In a worker: where it reports the moment each call starts (set by `_init_worker`).
_started_queue = None


def _init_worker(started_queue, parent_pid: int) -> None:
  global _started_queue
  _started_queue = started_queue
  sys.stdout, sys.stderr = _CappedStream(sys.stdout), _CappedStream(sys.stderr)
  # The parent's pid as the parent saw it: a worker that starts after its parent was killed has
  # already been re-parented, and its own getppid() would name the new parent.
  threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True, name="parent-watch").start()


def _exit_with_parent(parent_pid: int, poll_s: float = 1.0) -> None:
  """Ends this worker once the process that started it is gone (killed with SIGKILL, it never shuts its
  pool down): an orphaned worker is re-parented, and would otherwise wait on its queue for ever."""
  while os.getppid() == parent_pid:
    time.sleep(poll_s)
  os._exit(0)


def _warm_up(path: str) -> None:
  resolve(path)
  time.sleep(0.05)  # Keep this worker busy so the next warm-up task starts another one.


def _score(x) -> float:
  """A finite float within float32's range, or RewardValueError naming what it got."""
  if isinstance(x, (str, bytes)) or not (isinstance(x, numbers.Real) or getattr(x, "shape", None) == ()):
    raise RewardValueError(f"score {str(x)[:80]!r} is a {type(x).__name__}, not a number")
  v = float(x)
  if not math.isfinite(v) or abs(v) > _MAX_SCORE:
    raise RewardValueError(f"score {v!r} is not a finite float32 number")
  return v


_MAX_PARTS = 16  # numeric entries of a result kept beside its score (`dapo.gdpo_reward_keys` reads them)


def checked(out) -> dict:
  """A reward function's result as {"score": float, "acc": bool, "pred": str} and its other numeric
  entries as floats (a score's components, e.g. {"format": 1.0, "accuracy": 0.0}, at most 16): a
  number or a dict with a finite "score"; anything else raises RewardValueError (the sample is then
  a failure)."""
  if not isinstance(out, dict):
    if out is None or isinstance(out, (str, bytes, list, tuple)):
      raise RewardValueError(f"returned {str(out)[:80]!r} ({type(out).__name__}), expected a number or a "
                             "dict with a 'score'")
    v = _score(out)
    return {"score": v, "acc": v > 0, "pred": ""}
  if "score" not in out:
    raise RewardValueError(f"returned a dict without 'score' (keys {sorted(map(str, out))[:8]})")
  v = _score(out["score"])
  acc = out.get("acc")
  if isinstance(acc, (str, bytes)) or (acc is not None and not isinstance(acc, numbers.Number)
                                       and getattr(acc, "shape", None) != ()):
    raise RewardValueError(f"acc {str(acc)[:80]!r} is a {type(acc).__name__}, not a bool")
  parts = {k: float(x) for k, x in out.items() if isinstance(k, str) and k not in ("score", "acc", "pred")
           and isinstance(x, numbers.Real) and math.isfinite(x)}
  if len(parts) > _MAX_PARTS:
    raise RewardValueError(f"returned {len(parts)} numeric entries besides 'score'; at most {_MAX_PARTS} are kept")
  return {**parts, "score": v, "acc": v > 0 if acc is None else bool(acc),
          "pred": str(out.get("pred", ""))[:_MAX_PRED]}


def _call(call_id: int, path: str, response: str, ground_truth: str) -> dict:
  if _started_queue is not None:  # CLOCK_MONOTONIC is system-wide, so the parent can compare.
    _started_queue.put((call_id, time.monotonic()))  # A SimpleQueue: written before the call runs.
  for stream in (sys.stdout, sys.stderr):
    if isinstance(stream, _CappedStream):
      stream.left = _MAX_PRINT
  try:
    out = resolve(path)(response, ground_truth)
  except Exception as e:  # Sent back as a short, picklable error (some exceptions do not unpickle).
    raise RewardFunctionError(f"{type(e).__name__}: {str(e)[:_MAX_MESSAGE]}") from None
  return checked(out)


class RewardPool:
  """Scores responses in worker processes with a per-call timeout.

  A function that raises or runs for longer than the timeout yields `FAILURE` for that sample,
  which is counted (`errors`, `timeouts`) and logged with the sample's index; training never
  stops. The timeout counts from the moment a worker starts the call (workers report it), not from
  submission: the executor lists queued calls as running, so they cannot be told apart otherwise.
  A hung worker cannot be interrupted, so after a timeout the pool's processes are killed and
  replaced, and the calls that had not finished are run again.
  """

  def __init__(self, fn_path: str, timeout_s: float = 10.0, workers: int = 2):
    resolve(fn_path)  # Fail now, not at step 100.
    self.fn_path, self.timeout_s, self.workers = fn_path, timeout_s, workers
    self.errors = self.timeouts = 0
    self._pool: cf.ProcessPoolExecutor | None = None
    self._started = None  # The current pool's start-report queue.

  def _executor(self) -> cf.ProcessPoolExecutor:
    if self._pool is None:  # spawn: forking a process that runs XLA threads is unsafe.
      ctx = mp.get_context("spawn")
      self._started = ctx.SimpleQueue()
      self._pool = cf.ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_init_worker,
                                          initargs=(self._started, os.getpid()))
      # Start every worker and import the reward module before any call is timed: a slow
      # start-up on a loaded machine must not count against the per-call timeout.
      warm = [self._pool.submit(_warm_up, self.fn_path) for _ in range(self.workers)]
      cf.wait(warm, timeout=_STARTUP_TIMEOUT_S)
    return self._pool

  def _kill(self) -> None:
    if self._pool is not None:
      for p in list(getattr(self._pool, "_processes", {}).values()):
        p.kill()
      # Join the pool's management thread now: left running, it races the interpreter's exit hook
      # over the pool's wake-up pipe ("Exception ignored ... Bad file descriptor" at exit).
      self._pool.shutdown(wait=True, cancel_futures=True)
      self._pool = None
      self._started.close()
      self._started = None

  def close(self) -> None:
    self._kill()

  def _drain_starts(self, started: dict) -> None:
    while not self._started.empty():
      call_id, t = self._started.get()
      started[call_id] = t

  def __call__(self, responses: Sequence[str], ground_truths: Sequence[str]) -> list[dict]:
    results: list[dict | None] = [None] * len(responses)
    # Calls that were running when a worker died: the culprit or a bystander on another worker. Each
    # runs again alone; if its worker dies again, it was the culprit and fails.
    suspects: set[int] = set()
    stalls = 0  # Pools in a row that broke before any call reported its start.
    while True:
      todo = [i for i, r in enumerate(results) if r is None]
      if not todo:
        break
      if stalls >= _MAX_STALLS:  # Workers die before running anything (killed from outside, say).
        logging.warning("reward %s: its worker processes died %d times in a row before running a call; "
                        "%d samples scored as failures", self.fn_path, stalls, len(todo))
        for i in todo:
          results[i] = dict(FAILURE)
        self.errors += len(todo)
        break
      alone = [i for i in todo if i in suspects][:1]
      pool = self._executor()
      futures = {}
      for i in alone or todo:
        try:
          futures[pool.submit(_call, i, self.fn_path, responses[i], ground_truths[i])] = i
        except cf.process.BrokenProcessPool:  # A worker died meanwhile: the submitted calls say which.
          break
      if not futures:
        self._kill()
        stalls += 1
        continue
      pending = set(futures)
      started: dict[int, float] = {}  # Sample index -> when its worker started it (monotonic).
      while pending:
        self._drain_starts(started)
        running = [started[futures[f]] for f in pending if futures[f] in started]
        wait_s = min([t + self.timeout_s for t in running], default=float("inf")) - time.monotonic()
        finished, pending = cf.wait(pending, timeout=min(max(wait_s, 0.0), _POLL_S),
                                    return_when=cf.FIRST_COMPLETED)
        self._drain_starts(started)
        broken = False
        for fut in finished:
          i = futures[fut]
          try:
            results[i] = fut.result()
          except Exception as e:  # The function raised or returned no score, or a worker process died.
            if isinstance(e, cf.process.BrokenProcessPool):
              broken = True  # Every unfinished call fails with it; those that had not started run again.
              if i not in started:
                continue
              if not alone:  # Not yet known to be the culprit: run it again, alone.
                suspects.add(i)
                continue
              e = RuntimeError(f"its worker process died ({type(e).__name__})")
            self.errors += 1
            logging.warning("reward %s failed on sample %d: %s: %s", self.fn_path, i, type(e).__name__,
                            str(e)[:_MAX_MESSAGE])
            results[i] = dict(FAILURE)
        if broken:
          stalls = 0 if started else stalls + 1
          self._kill()
          break
        now = time.monotonic()
        expired = [futures[f] for f in pending if futures[f] in started and now - started[futures[f]] >= self.timeout_s]
        if expired:
          for i in expired:
            self.timeouts += 1
            logging.warning("reward %s timed out after %.1fs on sample %d", self.fn_path, self.timeout_s, i)
            results[i] = dict(FAILURE)
          # A hung worker cannot be interrupted: replace the pool; unfinished calls run again.
          self._kill()
          break
      else:
        stalls = 0
    return results  # type: ignore[return-value]


# --- a reward model over HTTP, and weighted combinations ----------------------------------------

class HTTPReward:
  """Scores responses with a reward-model server (`launch.serve_rm`): `reward.fn=http://HOST:PORT`.

  The same interface as `RewardPool`: call it with responses and ground truths (and the prompts, which
  a reward model needs), get {"score", "acc", "pred"} dicts; acc is score > acc_threshold. A server
  that is down, slow or answers garbage is retried `retries` times with backoff, then that chunk's
  samples get `FAILURE`, counted in `errors` or `timeouts`: training never stops on it. 4xx replies
  (bad token, bad request) are not retried.
  """

  def __init__(self, url: str, timeout_s: float = 30.0, retries: int = 2, token: str | None = None,
               batch_size: int = 256, acc_threshold: float = 0.0, backoff_s: float = 0.5):
    import os
    if not url.startswith(("http://", "https://")):
      raise RewardConfigError(f"reward server {url!r} must be an http:// or https:// URL")
    self.url = url.rstrip("/") + ("" if url.rstrip("/").endswith("/score") else "/score")
    self.timeout_s, self.retries, self.batch_size = timeout_s, retries, batch_size
    self.acc_threshold, self.backoff_s = acc_threshold, backoff_s
    self.token = token or os.environ.get("DAPO_RM_TOKEN") or None
    self.errors = self.timeouts = 0

  needs_prompts = True  # A reward model judges the response against its prompt.
  max_reply_bytes = 64 << 20  # A reply beyond this is garbage (a score is a few bytes).

  def close(self) -> None:
    pass

  def _post(self, prompts: list[str], responses: list[str]) -> list[float]:
    import json
    import urllib.request
    body = json.dumps({"prompts": prompts, "responses": responses}).encode()
    headers = {"Content-Type": "application/json"}
    if self.token:
      headers["Authorization"] = f"Bearer {self.token}"
    req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
      raw = resp.read(self.max_reply_bytes + 1)
    if len(raw) > self.max_reply_bytes:
      raise ValueError(f"malformed reply: longer than {self.max_reply_bytes} bytes for {len(responses)} scores")
    reply = json.loads(raw)
    scores = reply.get("scores") if isinstance(reply, dict) else None
    if not isinstance(scores, list) or len(scores) != len(responses):
      raise ValueError(f"malformed reply: expected {len(responses)} scores, got {str(reply)[:200]!r}")
    out = []
    for s in scores:
      if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
        raise ValueError(f"malformed reply: score {s!r} is not a finite number")
      out.append(float(s))
    return out

  def _chunk(self, prompts: list[str], responses: list[str], first: int) -> list[dict]:
    import socket
    import urllib.error
    for attempt in range(self.retries + 1):
      try:
        scores = self._post(prompts, responses)
        return [{"score": s, "acc": s > self.acc_threshold, "pred": f"{s:.4g}"} for s in scores]
      except Exception as e:  # Down, slow, garbage: retried, then counted.
        timed_out = isinstance(e, (TimeoutError, socket.timeout)) or (
            isinstance(e, urllib.error.URLError) and isinstance(e.reason, (TimeoutError, socket.timeout)))
        client_error = isinstance(e, urllib.error.HTTPError) and 400 <= e.code < 500
        if attempt == self.retries or client_error:
          if timed_out:
            self.timeouts += len(responses)
          else:
            self.errors += len(responses)
          logging.warning("reward server %s failed on samples %d..%d after %d attempts: %s: %s", self.url, first,
                          first + len(responses) - 1, attempt + 1, type(e).__name__, e)
          return [dict(FAILURE) for _ in responses]
        time.sleep(self.backoff_s * 2 ** attempt)
    raise AssertionError("unreachable")

  def __call__(self, responses: Sequence[str], ground_truths: Sequence[str],
               prompts: Sequence[str] | None = None) -> list[dict]:
    del ground_truths  # A reward model judges the response against the prompt alone.
    prompts = list(prompts) if prompts is not None else [""] * len(responses)
    if len(prompts) != len(responses):
      raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
    out: list[dict] = []
    for i in range(0, len(responses), self.batch_size):
      out += self._chunk(prompts[i:i + self.batch_size], list(responses[i:i + self.batch_size]), i)
    return out


def combine(parts: Sequence[Sequence[dict]], weights: Sequence[float], acc_from: int = 0) -> list[dict]:
  """Weighted sum of several rewards' results for the same samples: score = Σ_k w_k·score_k.

  acc and pred come from part `acc_from` (e.g. the rule check, when an RM score is mixed in); each
  part's other numeric entries are kept (where two parts name one, the earlier part's).
  """
  if len(parts) != len(weights) or not parts:
    raise ValueError(f"{len(parts)} reward results for {len(weights)} weights")
  if len({len(p) for p in parts}) != 1:
    raise ValueError(f"reward results of different lengths: {[len(p) for p in parts]}")
  out = []
  for i in range(len(parts[0])):
    ref = parts[acc_from][i]
    score = float(sum(w * p[i]["score"] for w, p in zip(weights, parts)))
    # Each part is finite; their weighted sum is kept within float32's range too (the advantages').
    extra = {k: x for p in reversed(parts) for k, x in p[i].items() if k not in ("score", "acc", "pred")}
    out.append({**extra, "score": max(-_MAX_SCORE, min(_MAX_SCORE, score)),
                "acc": bool(ref["acc"]), "pred": str(ref.get("pred", ""))})
  return out


def parse_weighted(items: Sequence[str]) -> list[tuple[str, float]]:
  """`reward.fns` entries, "SPEC" or "WEIGHT*SPEC" (e.g. "0.5*http://127.0.0.1:8000") -> (spec, weight)."""
  out = []
  for item in items:
    head, sep, tail = item.partition("*")
    if sep:
      try:
        weight = float(head)
      except ValueError:
        raise RewardConfigError(f"reward.fns entry {item!r}: expected WEIGHT*SPEC with a number WEIGHT") from None
      if not math.isfinite(weight):
        raise RewardConfigError(f"reward.fns entry {item!r}: weight {weight} is not a finite number")
      out.append((tail.strip(), weight))
    else:
      out.append((item.strip(), 1.0))
  if not out:
    raise RewardConfigError("reward.fns is empty")
  return out


def make_reward(spec: str, timeout_s: float = 10.0, workers: int = 2, judge=None, **http_kw):
  """One reward from its spec: an http(s):// URL is a reward server, rm:DIR a reward model scored in
  this process on the accelerator (`rewards.model.RMReward`), judge:URL a language model behind an
  OpenAI-compatible endpoint grading by a rubric (`rewards.judge`, configured by `judge`, a JudgeConfig),
  anything else a function path (a process pool)."""
  if spec.startswith("judge:"):
    from dapo_jax.rewards import judge as judge_lib  # noqa: PLC0415
    cfg = judge or judge_lib.JudgeConfig(timeout_s=timeout_s, workers=workers)
    try:
      return judge_lib.JudgeReward(spec, cfg)
    except (OSError, ValueError, re.error) as e:
      raise RewardConfigError(f"reward {spec!r}: {e}") from None
  if spec.startswith(("http://", "https://")):
    return HTTPReward(spec, timeout_s=timeout_s, **http_kw)
  if spec.startswith("rm:"):
    model_dir = spec[len("rm:"):]
    if not model_dir:
      raise RewardConfigError(f"reward {spec!r}: expected rm:DIR, a reward-model directory written by launch.rm")
    from dapo_jax.rewards import model  # noqa: PLC0415 (jax: only a run with a reward model imports it)
    return model.RMReward(model_dir)
  return RewardPool(spec, timeout_s, workers)


class CombinedReward:
  """Several rewards scored on the same samples and combined by `combine` (`reward.fns` with weights).

  acc comes from the first rule reward (a function path) when there is one, else from the first part;
  parts that judge against the prompt (`needs_prompts`: a server, a reward model) get the prompts;
  errors and timeouts are the sums of the parts'.
  """

  def __init__(self, fns: Sequence[tuple[str, float]], timeout_s: float = 10.0, workers: int = 2, judge=None,
               **http_kw):
    self.parts = [make_reward(spec, timeout_s, workers, judge, **http_kw) for spec, _ in fns]
    self.weights = [w for _, w in fns]
    rules = [k for k, p in enumerate(self.parts) if isinstance(p, RewardPool)]
    self.acc_from = rules[0] if rules else 0

  @property
  def needs_prompts(self) -> bool:
    return any(getattr(p, "needs_prompts", False) for p in self.parts)

  @property
  def errors(self) -> int:
    return sum(p.errors for p in self.parts)

  @property
  def timeouts(self) -> int:
    return sum(p.timeouts for p in self.parts)

  def close(self) -> None:
    for p in self.parts:
      p.close()

  def __call__(self, responses: Sequence[str], ground_truths: Sequence[str],
               prompts: Sequence[str] | None = None) -> list[dict]:
    results = [p(responses, ground_truths, prompts) if getattr(p, "needs_prompts", False)
               else p(responses, ground_truths) for p in self.parts]
    return combine(results, self.weights, self.acc_from)
