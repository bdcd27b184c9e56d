"""Multi-turn games without tools: the environment answers as the user.

    rollout.env = "dapo_jax.envs.games:GuessNumberEnv"
    rollout.env_args = '{"max_guesses": 7}'

    user:       I am thinking of an integer from 1 to 100. ...
    assistant:  50
    user:       higher
    assistant:  75
    user:       lower         ... until the guess is right (score 1) or the guesses run out (score -1)
"""
from __future__ import annotations

import re

import numpy as np

from dapo_jax.data import prompts as data_lib
from dapo_jax.envs import base

_INTEGER = re.compile(r"-?\d+")

GUESS_INSTRUCTION = (
    "I am thinking of an integer from {low} to {high}. Guess it: answer each turn with one number. "
    "I will reply \"higher\" if my number is larger, \"lower\" if it is smaller. You have {max_guesses} guesses.")


def last_integer(text: str) -> int | None:
  """The last integer written in a turn (after any reasoning), or None."""
  text = text.rsplit("</think>", 1)[-1]
  found = _INTEGER.findall(text)
  return int(found[-1]) if found else None


class GuessNumberEnv(base.Env):
  """Guess the example's secret integer (`ground_truth`) with higher/lower hints.

  Right: score 1. `max_guesses` wrong turns (a turn without a number counts as one): score -1.
  A binary search over 1..100 needs at most 7 guesses."""

  def __init__(self, max_guesses: int = 7):
    if max_guesses < 1:
      raise ValueError(f"max_guesses={max_guesses} must be >= 1")
    self.max_guesses = max_guesses
    self.secret, self.guesses = None, 0

  def reset(self, example) -> list[dict]:
    self.secret = self._secret(example)
    self.guesses = 0
    return list(example.messages)

  def check_example(self, example) -> None:
    self._secret(example)

  @staticmethod
  def _secret(example) -> int:
    try:
      return int(str(example.ground_truth).strip())
    except ValueError:
      raise ValueError(f"GuessNumberEnv needs an integer ground truth, got {example.ground_truth!r}") from None

  def step(self, assistant_text: str) -> base.StepResult:
    guess = last_integer(assistant_text)
    self.guesses += 1
    info = {"guesses": 1}
    if guess == self.secret:
      return base.StepResult(None, {"score": 1.0, "acc": True, "pred": str(guess)}, info)
    if self.guesses >= self.max_guesses:
      return base.StepResult(None, {"score": -1.0, "acc": False, "pred": "" if guess is None else str(guess)}, info)
    if guess is None:
      reply = "Answer with one integer."
    else:
      reply = "higher" if self.secret > guess else "lower"
    return base.StepResult([{"role": "user", "content": reply}], None, info)


def guess_number_examples(n: int, seed: int, low: int = 1, high: int = 100,
                          max_guesses: int = 7) -> list[data_lib.Example]:
  """`n` games with secrets drawn uniformly from low..high, as prompt examples."""
  if low > high:
    raise ValueError(f"low={low} > high={high}")
  rng = np.random.default_rng(seed)
  prompt = GUESS_INSTRUCTION.format(low=low, high=high, max_guesses=max_guesses)
  return [data_lib.Example(messages=({"role": "user", "content": prompt},),
                           ground_truth=str(int(rng.integers(low, high + 1))), data_source="guess_number", index=i)
          for i in range(n)]
