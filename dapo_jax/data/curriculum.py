"""Difficulty pools over the prompt stream (`data.curriculum`, prime-rl's pools): a prompt whose last
group came back all right (solved) or all wrong (out of reach for now) is set aside for
`data.revisit_after` rollout steps. The stream skips it until then; after that it comes back on its next
turn in the stream and is judged again. Dynamic sampling would otherwise generate its G samples only to
drop the group; set aside, those samples go to prompts that can teach something. With
`data.curriculum_streak` = K > 1 a prompt is set aside only after K such groups in a row, all of one
kind: one all-wrong group is also what a problem solved one time in five gives 17% of the time
(0.8^8 for G = 8), K in a row far less often (docs/results.md measures what each choice costs).

`Curriculum` wraps a prompt iterator (`PromptIterator`, `MixedIterator`) and serves its calls (`take`,
`next_batch`, `rewind`, `state`, `restore`). The loop says which rollout step draws (`at_step`); the
rollout's scoring reports every group the step consumed, kept or dropped (`watch`; a streamed step
reports them as it ends, not the groups it scored past what it consumed). A prompt is known by its
train file and its text, so the same problem twice in a file is one prompt. Everything it decides follows
from the seed and the outcomes, and its state (the pools) is checkpointed with the stream's position, so
a resumed run draws what the uninterrupted one would. With several processes every process draws the
whole batch and keeps its share (`next_batch`); each scores its share's groups, and the outcomes are
gathered (`watch_scores`), so that every process keeps the same pools.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from dapo_jax.data.prompts import DataError, Example, watch_scores


def key(ex: Example) -> str:
  """A prompt's identity in the pools: its file and its question."""
  return f"{ex.source}\x00{ex.messages[-1]['content']}"


class Curriculum:
  """A prompt stream that skips the prompts set aside (see the module docstring)."""

  def __init__(self, base, revisit_after: int, size: int, aside: str = "both", streak: int = 1):
    if revisit_after < 1:
      raise DataError(f"data.revisit_after={revisit_after}: expected a number of rollout steps >= 1")
    if streak < 1:
      raise DataError(f"data.curriculum_streak={streak}: expected a number of groups >= 1")
    if aside not in ("both", "solved", "unsolved"):
      raise DataError(f"data.curriculum_aside={aside!r}: expected 'both', 'solved' or 'unsolved'")
    self.base, self.revisit_after, self.size, self.aside, self.streak = base, revisit_after, size, aside, streak
    self.until: dict[str, int] = {}  # prompt key -> the first rollout step that may draw it again
    self.runs: dict[str, list] = {}  # prompt key -> [its last outcome ("solved" / "unsolved"), groups in a row]
    self.step = 0
    self._trail: list[int] = []      # base draws behind each prompt returned this step (for rewind)
    self.last_batch: tuple[list, list] = ([], [])  # the last `next_batch`: every process's prompts, this one's
    self.skipped = self.set_aside = self.early = 0  # this step's counts (`metrics`)

  # --- the stream ---------------------------------------------------------------------------------

  def at_step(self, step: int) -> None:
    """Rollout step `step` draws next: prompts set aside until then come back."""
    self.step = step
    if hasattr(self.base, "at_step"):  # Mixed sources count their groups per step.
      self.base.at_step(step)
    self.until = {k: s for k, s in self.until.items() if s > step}
    self._trail.clear()
    self.skipped = self.set_aside = self.early = 0

  def take(self, n: int) -> list[Example]:
    out = []
    for _ in range(n):
      draws = 0
      while True:
        ex = self.base.take(1)[0]
        draws += 1
        if self.until.get(key(ex), 0) <= self.step:
          break
        if draws > self.size:  # A whole epoch set aside: serve it rather than stall.
          self.early += 1
          break
        self.skipped += 1
      out.append(ex)
      self._trail.append(draws)
    return out

  def next_batch(self, global_size: int) -> list[Example]:
    count = getattr(self.base, "process_count", 1)
    if global_size % count:
      raise ValueError(f"batch of {global_size} prompts does not split over {count} hosts")
    picked = self.take(global_size)
    per_host = global_size // count
    index = getattr(self.base, "process_index", 0)
    self.last_batch = (picked, picked[index * per_host:(index + 1) * per_host])
    return self.last_batch[1]

  def rewind(self, n: int) -> None:
    """Steps back the last `n` prompts returned this step, and the prompts skipped before each."""
    if n < 0 or n > len(self._trail):
      raise ValueError(f"cannot rewind {n} prompts: {len(self._trail)} were drawn this step")
    if n:
      self.base.rewind(sum(self._trail[-n:]))
      del self._trail[-n:]

  def state(self) -> dict:
    runs = {"runs": dict(self.runs)} if self.streak > 1 else {}
    return {"base": self.base.state(), "until": dict(self.until)} | runs

  def restore(self, state: dict) -> None:
    if "until" not in state:
      raise DataError("the checkpoint's data position has no curriculum pools (data.curriculum changed)")
    self.base.restore(state["base"])
    self.until = {str(k): int(s) for k, s in state["until"].items()}
    if self.streak > 1 and "runs" not in state:
      raise DataError("the checkpoint's data position has no curriculum streaks (data.curriculum_streak changed)")
    self.runs = {str(k): [str(o), int(n)] for k, (o, n) in state.get("runs", {}).items()}

  # --- outcomes -----------------------------------------------------------------------------------

  def record(self, examples: Sequence[Example], acc_QG, valid_QG=None) -> None:
    """Each scored group's outcome: all right or all wrong (only the one `aside` names, if it names one),
    the `streak`-th such group of its prompt in a row, sets its prompt aside; any other brings it in."""
    acc = np.asarray(acc_QG, bool)
    valid = np.ones_like(acc) if valid_QG is None else np.asarray(valid_QG, bool)
    for ex, a, v in zip(examples, acc, valid):
      if not v.any():
        continue
      solved, unsolved = a[v].all(), not a[v].any()
      row = 1
      if self.streak > 1:  # The outcomes in a row: kept for prompts whose last group was all one way.
        outcome = "solved" if solved else "unsolved" if unsolved else None
        last, count = self.runs.pop(key(ex), (None, 0))
        row = count + 1 if outcome == last else 1
        if outcome is not None:
          self.runs[key(ex)] = [outcome, row]
      if row >= self.streak and ((solved and self.aside != "unsolved") or (unsolved and self.aside != "solved")):
        self.until[key(ex)] = self.step + self.revisit_after + 1
        self.set_aside += 1
      else:
        self.until.pop(key(ex), None)

  def watch(self, rollout) -> None:
    """Records the groups `rollout.score` scores (training rollouts, every group, kept or dropped)."""
    watch_scores(rollout, self.record, lambda: self.last_batch)
    if hasattr(self.base, "watch"):  # Mixed sources count them by source: this stream drew them.
      self.base.watch(rollout, lambda: self.last_batch)

  def metrics(self) -> dict:
    """This step's: prompts skipped (set aside), groups set aside, prompts served early, pool size
    (and the mixed sources' metrics)."""
    base = self.base.metrics() if hasattr(self.base, "metrics") else {}
    return base | {"data/curriculum_skipped": self.skipped, "data/curriculum_set_aside": self.set_aside,
                   "data/curriculum_early": self.early, "data/curriculum_pool": len(self.until)}
