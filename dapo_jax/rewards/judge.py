"""A judge reward (LLM-as-judge): each response is put to a language model behind any OpenAI-compatible
chat endpoint (`launch.serve`, vLLM, a hosted API) in a rubric, and the judge's answer is parsed into a
score.

    reward.fn = "judge:http://127.0.0.1:8000/v1"        (or an entry of reward.fns, weighted)

The rubric (`reward.judge_rubric`: a file, or RUBRIC) is filled with {prompt}, {response} and
{ground_truth}; the first group of `reward.judge_pattern` in the judge's answer is the score, divided
by `reward.judge_max_score` (so 0..1 for a rubric that asks for 0..max), and `acc` is score >= 0.5.
The judge decodes greedily. Requests go `reward.workers` at a time (the endpoint batches concurrent
requests), each bounded by `reward.timeout_s`; one that times out, fails, or whose answer does not
parse scores as `FAILURE` and is counted (`reward/timeouts`, `reward/errors`), and the run goes on.
`pred` keeps the score and the start of the judge's answer, so the rollout dumps hold every request's
score and what the judge said. The endpoint's token is read from the environment variable
`reward.judge_token_env`, never from a config file. Nothing the judge answers is run.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import logging
import math
import os
import re
import socket
import urllib.error
import urllib.request
from typing import Sequence

FAILURE = {"score": -1.0, "acc": False, "pred": "[REWARD_ERROR]"}  # = clients.FAILURE (no import circle)
SCHEME = "judge:"
RUBRIC = """You are grading a response to a problem.

Problem:
{prompt}

Reference answer: {ground_truth}

Response:
{response}

Is the response's final answer correct and its reasoning sound? Reply with one line, "Score: N",
N from 0 (wrong) to 10 (correct)."""
_PRED_CHARS = 200      # characters of the judge's answer kept in `pred`
_MAX_REPLY = 8 << 20   # bytes of a reply read at most (an answer is a few hundred)


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
  """How a judge reward asks and reads its judge (the `reward` section's judge_* fields)."""
  judge_model: str = ""          # the endpoint's model name ("" = the first one its /v1/models lists)
  judge_rubric: str = ""         # a file holding the rubric ({prompt}, {response}, {ground_truth}); "" = RUBRIC
  judge_pattern: str = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"   # its first group in the answer is the score
  judge_max_score: float = 10.0  # the score is divided by it (the rubric's scale)
  judge_max_tokens: int = 32     # the judge's answer, in tokens
  judge_token_env: str = "DAPO_JUDGE_TOKEN"   # the environment variable holding the endpoint's token, if any
  timeout_s: float = 10.0        # one request
  workers: int = 2               # requests in flight


class JudgeError(ValueError):
  """The judge answered, but not a score (named by its answer's start)."""


def parse_score(text: str, pattern: str, max_score: float) -> float:
  """The judge's score in `text`: the pattern's first group / `max_score`. Raises JudgeError."""
  m = re.search(pattern, text)
  if m is None:
    raise JudgeError(f"no score in the judge's answer {text[:_PRED_CHARS]!r}")
  try:
    value = float(m.group(1))
  except (IndexError, ValueError):
    raise JudgeError(f"the judge's score {m.group(0)!r} is not a number") from None
  if not math.isfinite(value):
    raise JudgeError(f"the judge's score {value} is not finite")
  return value / max_score


class JudgeReward:
  """`judge:URL`: the reward of each response, as the judge at URL (an OpenAI-compatible /v1) grades it."""

  needs_prompts = True  # The rubric shows the judge the problem.

  def __init__(self, url: str, cfg: JudgeConfig = JudgeConfig(), retries: int = 1):
    self.url = url.removeprefix(SCHEME).rstrip("/")
    if not self.url.startswith(("http://", "https://")):
      raise ValueError(f"reward {url!r}: expected judge:http(s)://HOST:PORT/v1, an OpenAI-compatible endpoint")
    self.cfg, self.retries = cfg, retries
    self.rubric = RUBRIC
    if cfg.judge_rubric:
      with open(cfg.judge_rubric) as f:  # A missing file fails at start, named.
        self.rubric = f.read()
    try:
      self.rubric.format(prompt="", response="", ground_truth="")
    except (KeyError, IndexError, ValueError) as e:
      raise ValueError(f"reward.judge_rubric={cfg.judge_rubric!r}: the rubric may name only {{prompt}}, "
                       f"{{response}} and {{ground_truth}} (double other braces): {e!r}") from None
    re.compile(cfg.judge_pattern)
    self.token = os.environ.get(cfg.judge_token_env, "") if cfg.judge_token_env else ""
    self.model = cfg.judge_model
    self.errors = self.timeouts = 0
    self._pool = cf.ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="judge")

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)

  def _request(self, path: str, body: dict | None) -> dict:
    headers = {"Content-Type": "application/json"}
    if self.token:
      headers["Authorization"] = f"Bearer {self.token}"
    req = urllib.request.Request(self.url + path, data=None if body is None else json.dumps(body).encode(),
                                 headers=headers, method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as resp:
      raw = resp.read(_MAX_REPLY + 1)
    if len(raw) > _MAX_REPLY:
      raise JudgeError(f"a reply longer than {_MAX_REPLY} bytes")
    return json.loads(raw)

  def _model(self) -> str:
    if not self.model:
      models = self._request("/models", None).get("data") or []
      if not models:
        raise JudgeError(f"{self.url}/models lists no model")
      self.model = models[0]["id"]
    return self.model

  def _ask(self, text: str) -> str:
    reply = self._request("/chat/completions", {
        "model": self._model(), "messages": [{"role": "user", "content": text}], "temperature": 0.0,
        "max_tokens": self.cfg.judge_max_tokens})
    try:
      return reply["choices"][0]["message"]["content"] or ""
    except (KeyError, IndexError, TypeError):
      raise JudgeError(f"not a chat completion: {str(reply)[:_PRED_CHARS]!r}") from None

  def _grade(self, prompt: str, response: str, ground_truth: str) -> tuple[dict, str]:
    """(the result, "" or "timeout" or "error")."""
    text = self.rubric.format(prompt=prompt, response=response, ground_truth=ground_truth)
    for attempt in range(self.retries + 1):
      try:
        answer = self._ask(text)
        score = parse_score(answer, self.cfg.judge_pattern, self.cfg.judge_max_score)
        return {"score": score, "acc": score >= 0.5, "pred": f"{score:.3g} {answer[:_PRED_CHARS]!r}"}, ""
      except JudgeError as e:  # It answered, not a score: asking again (greedy) gives the same answer.
        return {**FAILURE, "pred": f"[JUDGE_UNPARSABLE] {e}"}, "error"
      except Exception as e:  # Down, slow, garbage: retried, then counted.
        timed_out = isinstance(e, (TimeoutError, socket.timeout)) or (
            isinstance(e, urllib.error.URLError) and isinstance(e.reason, (TimeoutError, socket.timeout)))
        if attempt == self.retries or (isinstance(e, urllib.error.HTTPError) and 400 <= e.code < 500):
          return {**FAILURE, "pred": f"[JUDGE_{'TIMEOUT' if timed_out else 'ERROR'}] {type(e).__name__}: "
                                     f"{str(e)[:_PRED_CHARS]}"}, "timeout" if timed_out else "error"
    raise AssertionError("unreachable")

  def __call__(self, responses: Sequence[str], ground_truths: Sequence[str],
               prompts: Sequence[str] | None = None) -> list[dict]:
    prompts = list(prompts) if prompts is not None else [""] * len(responses)
    if not len(prompts) == len(responses) == len(ground_truths):
      raise ValueError(f"{len(prompts)} prompts, {len(responses)} responses, {len(ground_truths)} answers")
    graded = list(self._pool.map(self._grade, prompts, responses, ground_truths))
    failed = [kind for _, kind in graded if kind]
    self.timeouts += failed.count("timeout")
    self.errors += failed.count("error")
    if failed:
      first = next(r["pred"] for r, kind in graded if kind)
      logging.warning("judge %s: %d of %d requests failed (%d timed out); the first: %s", self.url, len(failed),
                      len(graded), failed.count("timeout"), first)
    return [r for r, _ in graded]
