"""Episodes on the engine: environments answer between policy turns, in worker threads.

    slot decodes a turn ─► its end-of-turn ─► EpisodeDriver.submit: env.step(text) in a worker
         ▲                                       (the other slots keep decoding)
         └── the observation's tokens ◄──────── ready(): (observation tokens | None and the reward)

The engine asks `ready()` between decode rounds and, while environments work, returns from a
round every `poll_steps` tokens to ask again. A slot waiting for its environment keeps its row
and its KV cache; it continues with the observation's tokens appended (`envs.render`), so no
earlier token is ever re-tokenised. An environment that raises, times out or answers something
that is not an observation ends its episode, and is counted: an infrastructure failure, by default
masked out of the loss and of its group's statistics (`env_error`). An episode cut by its budgets
(turns, tokens) is the policy's doing: it scores `failure_score` and stays in the loss.

Environments are built per episode from the example they play (`reset(example)` is a function of
the example: the prompt every sample of a group shares comes from it). An environment belongs to
one episode, numbered over the driver's life (never a reused (prompt id, sample) key): a reset or a
step that outlives `timeout_s` ends its episode, and the environment is closed when that call
returns, never used again.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import itertools
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
  failure_score: float = -1.0     # the reward of an episode cut by its budgets (and of failures with "score")
  # An environment that raised, timed out or answered garbage: "mask" = its row leaves the loss and its
  # group's statistics (the group's advantages as if it were absent); "score" = failure_score, trained on.
  env_error: str = "mask"
  poll_steps: int = 8             # decode steps between looks at the environments while they work
  # True: the reference loop of turn-synchronous systems, for benchmarks: no slot continues until
  # every busy slot's turn has ended and every environment has answered (the batch idles meanwhile).
  barrier: bool = False
  # Tokens that end a turn as its end-of-turn does but belong to its text (a tool call's closing tag,
  # e.g. Qwen's "</tool_call>"): the environment reads them, and the observation then opens with the
  # template's end of the assistant turn. The sampler must stop on them too (its eos_ids).
  turn_stop_ids: tuple[int, ...] = ()


ENV_ERRORS = ("mask", "score")


def failure(why: str, score: float, masked: bool = False) -> dict:
  """The reward of an episode that did not end by its environment's verdict; `masked`: an infrastructure
  failure that leaves the loss (`Rollout.score` reads "masked")."""
  return {"score": score, "acc": False, "pred": f"[{why}]"} | ({"masked": True} if masked else {})


def response_budget(max_prompt_len: int, turn_tokens: int, max_turns: int, max_episode_tokens: int = 0) -> int:
  """The tokens of an episode after its prompt (policy turns and observations): max_episode_tokens
  (the whole context) less the prompt, or max_turns x turn_tokens when it is 0. The sampler's
  max_new_tokens, and the length the soft overlong penalty measures an episode's response against."""
  return (max_episode_tokens or max_prompt_len + max_turns * turn_tokens) - max_prompt_len


def check_text_only(tokens: list[int], image_token_id: int | None) -> None:
  """Observations are text: the engine feeds their tokens one per decode step, as text. An image
  placeholder among them (its text in a tool's output) would be an image slot to every pass that
  places images, with no image: a ValueError, which ends the episode as the environment's failure."""
  if image_token_id is not None and image_token_id in tokens:
    raise ValueError(f"the observation holds the image placeholder (token {image_token_id}): observations "
                     "carry text only; images enter through the prompt")


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


@dataclasses.dataclass
class _Episode:
  """One episode's environment and what it plays. `over`: the episode has ended (its reward is
  given); `busy`: a worker is in its reset or step. Whoever sees it over and not busy closes it."""
  eid: int
  example: Any
  tools: list | None
  env: env_lib.Env | None = None
  busy: bool = False
  over: bool = False


class EpisodeDriver:
  """Runs one rollout's environments: `register` the examples, then the engine `submit`s turns."""

  def __init__(self, tok, make_env: Callable[[], env_lib.Env], cfg: EpisodeConfig, eos_ids=(),
               image_token_id: int | None = None):
    """`image_token_id`: a vision-language policy's image placeholder, which no observation may hold
    (`check_text_only`)."""
    if cfg.env_error not in ENV_ERRORS:
      raise ValueError(f"rollout.env_error={cfg.env_error!r}: expected one of {ENV_ERRORS}")
    self.tok, self.make_env, self.cfg, self.image_token_id = tok, make_env, cfg, image_token_id
    self.eos = set(eos_ids)
    # The text of every token that ends a policy turn: the template's end-of-turn is one of them.
    self.eos_texts = tuple(sorted({tok.decode([int(i)]) for i in self.eos} - {""}, key=len, reverse=True))
    self.examples: dict[int, Any] = {}
    self.tools: dict[int, list | None] = {}
    self.live: dict[Key, _Episode] = {}     # the episode each (prompt id, sample) key plays now
    self.ids = itertools.count()            # episode ids, unique over the driver's life
    self.calls: dict[Key, tuple[cf.Future, float, _Episode]] = {}   # running steps, their deadlines and episodes
    self.pool = cf.ThreadPoolExecutor(cfg.workers, thread_name_prefix="env")
    self.lock = threading.Lock()
    self.reset_metrics()
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
    """The example the episodes of `prompt_id` play from now on (an episode keeps the one it started with)."""
    self.examples[prompt_id] = example
    self.tools[prompt_id] = tools

  def _new_env(self) -> env_lib.Env:
    env = self.make_env()
    env.tokenizer = self.tok
    return env

  # --- turns -----------------------------------------------------------------------------------

  def submit(self, key: Key, turn_tokens, *, ended_by_eos: bool, turn: int) -> None:
    """The policy's turn `turn` of episode `key` ended with these tokens: its environment steps (the
    first turn starts a new episode, with a new environment, on the example registered for the key)."""
    tokens = [int(t) for t in turn_tokens]
    kept_end = ended_by_eos and tokens and tokens[-1] in self.cfg.turn_stop_ids  # Part of the turn's text.
    # A turn that ended on an end-of-turn token: the observation does not repeat the template's own.
    end = (self.tok.decode(tokens[-1:]),) + self.eos_texts if ended_by_eos and tokens and not kept_end else ()
    text = self.tok.decode(tokens[:-1] if ended_by_eos and not kept_end else tokens, skip_special_tokens=False)
    with self.lock:
      ep = self.live.get(key)
      old = ep if turn == 1 else None  # Left by a rollout that stopped before it ended (`abandon`).
      if turn == 1 or ep is None:
        ep = self.live[key] = _Episode(next(self.ids), self.examples[key[0]], self.tools.get(key[0]))
      ep.busy = True
    if old is not None:
      self._finish(old)  # Closed, never reused.
    self.counts["turns"] += 1
    fut = self.pool.submit(self._step, ep, text, end, ended_by_eos, turn)
    self.calls[key] = (fut, time.monotonic() + self.cfg.timeout_s, ep)

  def _step(self, ep: _Episode, text: str, end: tuple[str, ...], ended_by_eos: bool, turn: int):
    """In a worker: the environment's answer as (observation tokens or None, reward or None). An
    episode that ended meanwhile (its call timed out) gets no further call; its environment is closed."""
    try:
      if ep.over:  # Timed out while it waited for a worker.
        return None, None
      if ep.env is None:  # The episode's first turn: its environment starts.
        env = self._new_env()
        with self.lock:
          ep.env = env
        env.reset(ep.example)
      if ep.over:
        return None, None
      ep.env.turn_truncated = not ended_by_eos
      obs, reward, info = unpack_step(ep.env.step(text))
      with self.lock:
        if not ep.over:  # A late answer's numbers belong to no rollout.
          for k, v in info.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
              self.info_sums[k] = self.info_sums.get(k, 0.0) + float(v)
      if obs is None:
        return None, reward
      if turn >= self.cfg.max_turns or not ended_by_eos:  # No turn left, or this one overran its budget.
        return "cut", "max_turns" if turn >= self.cfg.max_turns else "turn_tokens"
      tokens = render.observation_tokens(self.tok, obs, ended_with=end, tools=ep.tools)
      check_text_only(tokens, self.image_token_id)
      return tokens, None
    finally:
      with self.lock:
        ep.busy = False
        stale = ep.over
      if stale:  # Ended while this call ran (a timeout): closed now that it returned.
        self._close(ep)

  def ready(self) -> list[tuple[Key, list[int] | None, dict | None]]:
    """Episodes whose environment answered (or failed) since the last call: (key, observation
    tokens or None when the episode ends, its reward when it ends)."""
    now = time.monotonic()
    out = []
    for key, (fut, deadline, ep) in list(self.calls.items()):
      if self.live.get(key) is not ep:  # An abandoned episode's call: no slot waits for it.
        del self.calls[key]
        continue
      if fut.done():
        del self.calls[key]
        try:
          obs, reward = fut.result()
        except Exception as e:  # An environment's bug ends its episode, not the run.
          self.counts["errors"] += 1
          self.last_error = f"{type(e).__name__}: {e}"
          logging.warning("environment %s failed on episode %d %s: %s", type(ep.env).__name__, ep.eid, key,
                          self.last_error)
          out.append((key, None, self._end(key, self._infrastructure("ENV_ERROR"))))
          continue
        if obs == "cut":
          out.append((key, None, self.cut(key, reward)))
        elif obs is None:
          out.append((key, None, self._end(key, reward)))
        else:
          out.append((key, obs, None))
      elif now > deadline:  # A hung reset or step: its thread is left to finish (and close); the episode ends.
        del self.calls[key]
        self.counts["timeouts"] += 1
        out.append((key, None, self._end(key, self._infrastructure("ENV_TIMEOUT"))))
    return out

  def _infrastructure(self, why: str) -> dict:
    """The reward of an episode whose environment failed (`env_error`)."""
    masked = self.cfg.env_error == "mask"
    self.counts["masked"] += masked
    return failure(why, self.cfg.failure_score, masked)

  def cut(self, key: Key, why: str) -> dict:
    """The reward of an episode cut by a budget (turns, tokens): the policy's failure, scored."""
    self.counts["cut"] += 1
    return self._end(key, failure(why.upper(), self.cfg.failure_score))

  def _end(self, key: Key, reward) -> dict:
    with self.lock:
      ep = self.live.pop(key, None)
    if ep is not None:
      self._finish(ep)
    self.counts["episodes"] += 1
    return reward

  def _finish(self, ep: _Episode) -> None:
    """Ends `ep`: its environment is closed now, or by the call still running in it when that returns."""
    with self.lock:
      ep.over = True
      idle = not ep.busy
    if idle:
      self._close(ep)

  def _close(self, ep: _Episode) -> None:
    with self.lock:
      env, ep.env = ep.env, None
    if env is not None:
      try:
        env.close()
      except Exception as e:  # Closing is best effort: the episode's reward stands.
        logging.warning("environment close failed: %s", e)

  def wait(self) -> None:
    """Blocks until some environment step ends or times out."""
    if not self.calls:
      return
    deadline = min(d for _, d, _ in self.calls.values())
    cf.wait([f for f, _, _ in self.calls.values()], timeout=max(deadline - time.monotonic(), 0.0) + 1e-3,
            return_when=cf.FIRST_COMPLETED)

  def wait_all(self) -> None:
    """Blocks until every running environment step ends or times out."""
    while self.calls:
      self.wait()
      if (all(f.done() for f, _, _ in self.calls.values())
          or time.monotonic() > min(d for _, d, _ in self.calls.values())):
        return

  @property
  def poll_steps(self) -> int:
    return self.cfg.poll_steps

  def reset_metrics(self) -> None:
    """Starts the counts `metrics` reports afresh (each rollout step, each evaluation)."""
    self.counts = {"errors": 0, "timeouts": 0, "masked": 0, "cut": 0, "episodes": 0, "turns": 0}
    with self.lock:
      self.info_sums: dict[str, float] = {}

  def metrics(self, prefix: str = "env/") -> dict:
    """What the episodes ended since `reset_metrics` saw: errors, timeouts, the rows masked for them,
    cuts, turns per episode, and the environments' `info` numbers summed."""
    n = max(self.counts["episodes"], 1)
    out = {f"{prefix}{k}": self.counts[k] for k in ("errors", "timeouts", "masked", "cut")}
    out[f"{prefix}turns_per_episode"] = self.counts["turns"] / n
    with self.lock:
      out |= {f"{prefix}{k}": v for k, v in self.info_sums.items()}
    return out

  def abandon(self) -> None:
    """Ends every episode still running, unscored (a rollout step that stopped before they ended: its
    session and their rows are dropped): their environments are closed, now or when their calls return."""
    with self.lock:
      eps, self.live = list(self.live.values()), {}
    self.calls.clear()
    for ep in eps:
      self._finish(ep)

  def close(self) -> None:
    self.pool.shutdown(wait=False, cancel_futures=True)
    self.abandon()
