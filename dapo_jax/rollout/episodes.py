"""Episodes on the engine: environments answer between policy turns, in worker threads.

    slot decodes a turn ─► its end-of-turn ─► EpisodeDriver.submit: env.step(text) in a worker
         ▲                                       (the other slots keep decoding)
         └── the observation's tokens ◄──────── ready(): (observation tokens | None and the reward)

The engine asks `ready()` between decode rounds and, while environments work, returns from a
round every `poll_steps` tokens to ask again. A slot waiting for its environment keeps its row
and its KV cache; it continues with the observation's tokens appended (`envs.render`), so no
earlier token is ever re-tokenised. An environment that raises, times out or answers something
that is not an observation ends its episode with the failure reward, and is counted.

Environments are built per episode from the example they play (`reset(example)` is a function of
the example: the prompt every sample of a group shares comes from it).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import math
import threading
import time
from typing import Any, Callable

from dapo_jax.envs import base as env_lib
from dapo_jax.envs import render

Key = tuple[int, int]  # (prompt id, sample)


@dataclasses.dataclass(frozen=True)
class EpisodeConfig:
  max_turns: int = 4              # policy turns per episode; an observation after the last cuts it
  timeout_s: float = 30.0         # one environment step (reset included in the first)
  workers: int = 8                # environment steps running at once
  failure_score: float = -1.0     # the reward of an episode whose environment failed or was cut
  poll_steps: int = 8             # decode steps between looks at the environments while they work
  # True: the reference loop of turn-synchronous systems, for benchmarks: no slot continues until
  # every busy slot's turn has ended and every environment has answered (the batch idles meanwhile).
  barrier: bool = False
  # Tokens that end a turn as its end-of-turn does but belong to its text (a tool call's closing tag,
  # e.g. Qwen's "</tool_call>"): the environment reads them, and the observation then opens with the
  # template's end of the assistant turn. The sampler must stop on them too (its eos_ids).
  turn_stop_ids: tuple[int, ...] = ()


def failure(why: str, score: float) -> dict:
  return {"score": score, "acc": False, "pred": f"[{why}]"}


def check_reward(reward) -> dict:
  """An environment's final reward as {"score", "acc", "pred"} (a number is a score)."""
  if isinstance(reward, bool) or reward is None:
    raise ValueError(f"the final reward must be a number or {{'score', 'acc', 'pred'}}, got {reward!r}")
  if isinstance(reward, (int, float)):
    reward = {"score": float(reward), "acc": reward > 0, "pred": ""}
  if not isinstance(reward, dict) or "score" not in reward:
    raise ValueError(f"the final reward must be a number or {{'score', 'acc', 'pred'}}, got {reward!r:.80}")
  score = float(reward["score"])
  if not math.isfinite(score):
    raise ValueError(f"the final reward's score is {score}")
  return {"score": score, "acc": bool(reward.get("acc", score > 0)), "pred": str(reward.get("pred", ""))}


def unpack_step(out) -> tuple[list[dict] | None, dict | None, dict]:
  """(observation, reward, info) from what `Env.step` returned (a StepResult or a 3-tuple), checked."""
  if isinstance(out, env_lib.StepResult):
    obs, reward, info = out.observation, out.reward, out.info
  elif isinstance(out, tuple) and len(out) == 3:
    obs, reward, info = out
  else:
    raise ValueError(f"Env.step must return (observation, reward, info) or a StepResult, got {type(out).__name__}")
  if obs is None:
    return None, check_reward(reward), dict(info or {})
  return render.check_messages(obs), None, dict(info or {})


class EpisodeDriver:
  """Runs one rollout's environments: `register` the examples, then the engine `submit`s turns."""

  def __init__(self, tok, make_env: Callable[[], env_lib.Env], cfg: EpisodeConfig, eos_ids=()):
    self.tok, self.make_env, self.cfg = tok, make_env, cfg
    self.eos = set(eos_ids)
    self.examples: dict[int, Any] = {}
    self.envs: dict[Key, env_lib.Env] = {}
    self.tools: dict[int, list | None] = {}
    self.calls: dict[Key, tuple[cf.Future, float]] = {}   # running steps and their deadlines
    self.done: list[tuple[Key, list[int] | None, dict | None]] = []
    self.pool = cf.ThreadPoolExecutor(cfg.workers, thread_name_prefix="env")
    self.lock = threading.Lock()
    self.counts = {"errors": 0, "timeouts": 0, "cut": 0, "episodes": 0, "turns": 0}
    self.info_sums: dict[str, float] = {}
    self.last_error = ""

  # --- prompts ---------------------------------------------------------------------------------

  def prompt(self, example) -> tuple[list[dict], list | None]:
    """The messages and tool schemas a group's prompt is rendered from (a fresh environment's reset)."""
    env = self._new_env()
    try:
      return env.reset(example), env.tools
    finally:
      env.close()

  def register(self, prompt_id: int, example, tools=None) -> None:
    self.examples[prompt_id] = example
    self.tools[prompt_id] = tools

  def _new_env(self) -> env_lib.Env:
    env = self.make_env()
    env.tokenizer = self.tok
    return env

  # --- turns -----------------------------------------------------------------------------------

  def submit(self, key: Key, turn_tokens, *, ended_by_eos: bool, turn: int) -> None:
    """The policy's turn `turn` of episode `key` ended with these tokens: its environment steps."""
    tokens = [int(t) for t in turn_tokens]
    kept_end = ended_by_eos and tokens and tokens[-1] in self.cfg.turn_stop_ids  # Part of the turn's text.
    end = self.tok.decode(tokens[-1:]) if ended_by_eos and tokens and not kept_end else ""
    text = self.tok.decode(tokens[:-1] if ended_by_eos and not kept_end else tokens, skip_special_tokens=False)
    self.counts["turns"] += 1
    fut = self.pool.submit(self._step, key, text, end, ended_by_eos, turn)
    self.calls[key] = (fut, time.monotonic() + self.cfg.timeout_s)

  def _step(self, key: Key, text: str, end: str, ended_by_eos: bool, turn: int):
    """In a worker: the environment's answer as (observation tokens or None, reward or None)."""
    env = self.envs.get(key)
    if env is None:  # The episode's first turn: its environment starts.
      env = self._new_env()
      env.reset(self.examples[key[0]])
      self.envs[key] = env
    obs, reward, info = unpack_step(env.step(text))
    with self.lock:
      for k, v in info.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
          self.info_sums[k] = self.info_sums.get(k, 0.0) + float(v)
    if obs is None:
      return None, reward
    if turn >= self.cfg.max_turns or not ended_by_eos:  # No turn left, or this one overran its budget.
      return "cut", "max_turns" if turn >= self.cfg.max_turns else "turn_tokens"
    return render.observation_tokens(self.tok, obs, ended_with=end, tools=self.tools.get(key[0])), None

  def ready(self) -> list[tuple[Key, list[int] | None, dict | None]]:
    """Episodes whose environment answered (or failed) since the last call: (key, observation
    tokens or None when the episode ends, its reward when it ends)."""
    now = time.monotonic()
    out = []
    for key, (fut, deadline) in list(self.calls.items()):
      if fut.done():
        del self.calls[key]
        try:
          obs, reward = fut.result()
        except Exception as e:  # An environment's bug ends its episode, not the run.
          self.counts["errors"] += 1
          self.last_error = f"{type(e).__name__}: {e}"
          logging.warning("environment %s failed on episode %s: %s", type(self.envs.get(key)).__name__, key,
                          self.last_error)
          out.append((key, None, self._end(key, "ENV_ERROR")))
          continue
        if obs == "cut":
          out.append((key, None, self.cut(key, reward)))
        elif obs is None:
          out.append((key, None, self._end(key, reward)))
        else:
          out.append((key, obs, None))
      elif now > deadline:  # A hung step: its thread is left to finish; the episode ends.
        del self.calls[key]
        self.counts["timeouts"] += 1
        out.append((key, None, self._end(key, "ENV_TIMEOUT")))
    return out

  def cut(self, key: Key, why: str) -> dict:
    """The reward of an episode cut by a budget (turns, tokens)."""
    self.counts["cut"] += 1
    return self._end(key, failure(why.upper(), self.cfg.failure_score))

  def _end(self, key: Key, reward) -> dict:
    if isinstance(reward, str):
      reward = failure(reward, self.cfg.failure_score)
    env = self.envs.pop(key, None)
    if env is not None:
      try:
        env.close()
      except Exception as e:  # Closing is best effort: the episode's reward stands.
        logging.warning("environment close failed: %s", e)
    self.counts["episodes"] += 1
    return reward

  def wait(self) -> None:
    """Blocks until some environment step ends or times out."""
    if not self.calls:
      return
    deadline = min(d for _, d in self.calls.values())
    cf.wait([f for f, _ in self.calls.values()], timeout=max(deadline - time.monotonic(), 0.0) + 1e-3,
            return_when=cf.FIRST_COMPLETED)

  def wait_all(self) -> None:
    """Blocks until every running environment step ends or times out."""
    while self.calls:
      self.wait()
      if all(f.done() for f, _ in self.calls.values()) or time.monotonic() > min(d for _, d in self.calls.values()):
        return

  @property
  def poll_steps(self) -> int:
    return self.cfg.poll_steps

  def metrics(self) -> dict:
    n = max(self.counts["episodes"], 1)
    out = {"env/errors": self.counts["errors"], "env/timeouts": self.counts["timeouts"],
           "env/cut": self.counts["cut"], "env/turns_per_episode": self.counts["turns"] / n}
    out |= {f"env/{k}": v for k, v in self.info_sums.items()}
    return out

  def close(self) -> None:
    self.pool.shutdown(wait=False, cancel_futures=True)
    for env in self.envs.values():
      try:
        env.close()
      except Exception:  # noqa: BLE001 (best effort at shutdown)
        pass
    self.envs.clear()
