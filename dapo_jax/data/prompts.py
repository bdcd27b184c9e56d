"""Prompt datasets in the DAPO-Math row schema, a built-in arithmetic task, and a resumable,
per-host sharded prompt iterator. Host-side NumPy; no jax.

Row schema (verl's RL parquet format, as DAPO-Math-17k ships):
  {"data_source": str, "prompt": [{"role": "user", "content": str}], "ability": str,
   "reward_model": {"ground_truth": str, "style": str}, "extra_info": {...}}
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import threading
import zlib
from typing import Callable, Sequence

import numpy as np

from dapo_jax.data import images as images_lib
from dapo_jax.errors import DataError  # noqa: F401 (data.prompts.DataError, as callers name it)

DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".')


@dataclasses.dataclass(frozen=True)
class Example:
  messages: tuple[dict, ...]   # the chat, ending with the user turn
  ground_truth: str
  data_source: str = "math_dapo"
  index: int = 0               # row number in its file (or generator index)
  images: tuple[bytes, ...] = ()  # encoded images, one per `images.IMAGE_MARK` in the messages, in order
  source: str = ""             # the file it was read from ("" for a generated task)


# --- files -------------------------------------------------------------------------------------

def read_rows(path: str) -> list[dict]:
  if not os.path.exists(path):
    raise DataError(f"dataset file {path!r} does not exist")
  try:
    if path.endswith(".parquet"):
      import pyarrow.parquet as pq
      return pq.read_table(path).to_pylist()
    if path.endswith((".jsonl", ".json")):
      rows = []
      with open(path) as f:
        for i, line in enumerate(f):
          if line.strip():
            try:
              rows.append(json.loads(line))
            except json.JSONDecodeError as e:
              raise DataError(f"{path}: row {i}: not valid JSON ({e})") from None
      return rows
  except DataError:
    raise
  except Exception as e:  # Corrupt parquet, permissions, ...
    raise DataError(f"dataset file {path!r} cannot be read: {type(e).__name__}: {e}") from None
  raise DataError(f"dataset file {path!r}: unknown format (expected .parquet or .jsonl)")


def _parse_row(row: dict, path: str, i: int, prompt_template: str | None, pan_and_scan: bool = False
               ) -> Example | None:
  """One row -> Example; None when the ground truth is missing (the caller decides)."""
  if not isinstance(row, dict):
    raise DataError(f"{path}: row {i}: expected an object with 'prompt' and 'reward_model', "
                    f"got {type(row).__name__}")
  prompt = row.get("prompt")
  if isinstance(prompt, str):
    prompt = [{"role": "user", "content": prompt}]
  if (not isinstance(prompt, (list, tuple)) or not prompt
      or not all(isinstance(m, dict) and "content" in m for m in prompt)):
    raise DataError(f"{path}: row {i}: field 'prompt' must be a non-empty list of "
                    f"{{'role', 'content'}} messages, got {type(prompt).__name__}")
  for j, m in enumerate(prompt):
    if not isinstance(m["content"], str) or not isinstance(m.get("role") or "user", str):
      raise DataError(f"{path}: row {i}: field 'prompt[{j}]' needs a string 'content' and 'role', got "
                      f"content {type(m['content']).__name__}, role {type(m.get('role')).__name__}")
  rm = row.get("reward_model")
  gt = rm.get("ground_truth") if isinstance(rm, dict) else row.get("ground_truth")
  if gt is None or (isinstance(gt, str) and not gt.strip()):
    return None
  messages = tuple({"role": m.get("role") or "user", "content": m["content"]} for m in prompt)
  if prompt_template:
    last = messages[-1]
    messages = messages[:-1] + ({"role": last["role"], "content": prompt_template.format(problem=last["content"])},)
  images = _row_images(row, path, i)
  if images or images_lib.count_marks(messages):
    images_lib.check_marks(messages, len(images), f"{path}: row {i}")
  if pan_and_scan and images:
    messages, images = images_lib.pan_and_scan(messages, images, f"{path}: row {i}: images")
  return Example(messages=messages, ground_truth=str(gt), data_source=str(row.get("data_source") or "math_dapo"),
                 index=i, images=images, source=path)


def _row_images(row: dict, path: str, i: int) -> tuple[bytes, ...]:
  """A row's `images` column (verl's convention: bytes, paths or {"bytes" | "path": ...}), each read and checked."""
  entries = row.get("images")
  if entries is None:
    return ()
  if not isinstance(entries, (list, tuple)):
    raise DataError(f"{path}: row {i}: field 'images' must be a list, got {type(entries).__name__}")
  base = os.path.dirname(os.path.abspath(path))
  return tuple(images_lib.read_entry(e, base, f"{path}: row {i}: images[{j}]") for j, e in enumerate(entries))


def load_file(path: str, missing_answer: str = "error", prompt_template: str | None = None,
              check: Callable[[Example], None] | None = None, pan_and_scan: bool = False) -> list[Example]:
  """All examples of a parquet/jsonl file in the DAPO-Math schema.

  check: raises a ValueError for an example the run could never use (a reward's
  `check_ground_truth`, an environment's `check_example`). missing_answer: "error" fails naming the
  row without a ground truth or with an unusable one; "skip" drops such rows and logs how many.
  pan_and_scan: each row's images and marks through `images.pan_and_scan` (Gemma 3's crops).
  """
  rows = read_rows(path)
  if not rows:
    raise DataError(f"dataset file {path!r} has no rows")
  out, skipped = [], collections.Counter()
  for i, row in enumerate(rows):
    ex, kind, why = (_parse_row(row, path, i, prompt_template, pan_and_scan), "no ground truth",
                     " (field 'reward_model.ground_truth')")
    if ex is not None and check is not None:
      try:
        check(ex)
      except ValueError as e:
        ex, kind, why = None, "an unusable ground truth", f": {e}"
    if ex is None:
      if missing_answer == "skip":
        skipped[kind] += 1
        continue
      raise DataError(f"{path}: row {i}: {kind}{why}; set --config.data.missing_answer=skip to skip such rows")
    out.append(ex)
  for what, n in skipped.items():
    logging.warning("%s: skipped %d rows with %s", path, n, what)
  if not out:
    raise DataError(f"dataset file {path!r}: every row was skipped ({dict(skipped)})")
  return out


# --- the built-in arithmetic task ------------------------------------------------------------

ARITH_INSTRUCTION = "{problem} End with: Answer: <number>"


def arith_problem(rng: np.random.Generator, digits: int, ops: str, digits_b: int = 0) -> tuple[str, int, str]:
  op = ops[rng.integers(len(ops))]
  span = lambda d: (10 ** (d - 1) if d > 1 else 0, 10 ** d)
  a, b = int(rng.integers(*span(digits))), int(rng.integers(*span(digits_b or digits)))
  if op == "-" and b > a:
    a, b = b, a  # Non-negative results keep the task about carrying, not signs.
  value = {"+": a + b, "-": a - b, "*": a * b}[op]
  return f"{a}{op}{b}", value, op


def in_heldout(text: str, fraction: float) -> bool:
  """Deterministic split by problem text, so train and held-out never share a problem."""
  return (zlib.crc32(text.encode()) % 10_000) < fraction * 10_000


def arith_examples(n: int, *, split: str = "train", seed: int = 0, digits: int = 2, ops: str = "+",
                   heldout_fraction: float = 0.1, template: str = ARITH_INSTRUCTION, digits_b: int = 0,
                   fewshot: int = 0) -> list[Example]:
  """`n` arithmetic problems ("What is 47+38?") of one split, deterministic by seed.

  digits_b: digits of the second operand (0 = digits). fewshot: worked examples (from the
  training split) put in the chat before the question, for models that must learn the format.
  """
  if split not in ("train", "heldout"):
    raise ValueError(f"split={split!r}; expected 'train' or 'heldout'")
  shots = _arith_shots(fewshot, seed=seed, digits=digits, ops=ops, heldout_fraction=heldout_fraction,
                       template=template, digits_b=digits_b)
  rng = np.random.default_rng([seed, digits, len(ops), 0 if split == "train" else 1] + ([digits_b] if digits_b else []))
  out, seen, tries = [], set(), 0
  while len(out) < n:
    tries += 1
    if tries > 100 * n + 10_000:
      raise DataError(f"arith: cannot draw {n} distinct {split} problems with digits={digits} ops={ops!r}")
    text, value, _ = arith_problem(rng, digits, ops, digits_b)
    if in_heldout(text, heldout_fraction) != (split == "heldout"):
      continue
    if split == "heldout":  # Held-out problems are distinct; training draws may repeat.
      if text in seen:
        continue
      seen.add(text)
    problem = f"What is {text}?"
    out.append(Example(messages=shots + ({"role": "user", "content": template.format(problem=problem)},),
                       ground_truth=str(value), data_source="arith", index=len(out)))
  return out


def _arith_shots(fewshot: int, **task) -> tuple[dict, ...]:
  """The worked examples (user question, assistant answer) put before each question."""
  shots: tuple[dict, ...] = ()
  if fewshot:
    task = dict(task, seed=task["seed"] + 10_000)
    for ex in arith_examples(fewshot, split="train", **task):
      expr = ex.messages[0]["content"].split("What is ")[1].split("?")[0]
      shots += (ex.messages[0], {"role": "assistant", "content": f"{expr} = {ex.ground_truth}.\nAnswer: "
                                                                 f"{ex.ground_truth}"})
  return shots


def arith_prompt(question: str, *, seed: int = 0, digits: int = 2, ops: str = "+", heldout_fraction: float = 0.1,
                 template: str = ARITH_INSTRUCTION, digits_b: int = 0, fewshot: int = 0) -> Example:
  """A question typed by a person ("What is 38+46?") as the arithmetic task's training prompts put
  it: the same instruction template and worked examples (no ground truth)."""
  shots = _arith_shots(fewshot, seed=seed, digits=digits, ops=ops, heldout_fraction=heldout_fraction,
                       template=template, digits_b=digits_b)
  return Example(messages=shots + ({"role": "user", "content": template.format(problem=question)},),
                 ground_truth="", data_source="arith")


def arith_solution(ex: Example, style: str = "steps") -> str:
  """The reference completion used by the SFT warm start.

  "direct": just the answer line. "steps": column addition written out digit by digit, right
  to left with carries ("7+8=15, 4+3+1=8."), then the answer line; each step is a one-digit fact,
  which a small model learns far faster than the whole sum at once. "column": the same steps in
  words, each with the digit written and the carry ("ones 7+8=15 write 5 carry 1; tens ..."),
  about twice as long. "mixed": "steps" or "column" by a hash of the problem, half each: a warm
  start that writes either, for a budget only the short form fits (configs/ablation.py:task=arith_long).
  """
  if style == "direct":
    return f"Answer: {ex.ground_truth}"
  expr = ex.messages[-1]["content"].split("What is ")[1].split("?")[0]
  if style == "mixed":
    style = "column" if zlib.crc32(("style:" + expr).encode()) % 2 else "steps"
  if style == "tool":  # The first turn of a calculator episode (envs.tasks): the call, as the template writes it.
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>' % expr
  if "+" not in expr:
    return f"Answer: {ex.ground_truth}"
  a, b = expr.split("+")
  da, db = a[::-1], b[::-1]
  steps, carry = [], 0
  for i in range(max(len(da), len(db))):
    x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
    s = x + y + carry
    step = f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={s}"
    carry = s // 10
    if style == "column":
      step = f"{_COLUMNS[min(i, len(_COLUMNS) - 1)]} {step} write {s % 10}" + (f" carry {carry}" if carry else "")
    steps.append(step)
  return ("; " if style == "column" else ", ").join(steps) + f". Answer: {ex.ground_truth}"


_COLUMNS = ("ones", "tens", "hundreds", "thousands", "higher")


# --- the iterator ------------------------------------------------------------------------------

class PromptIterator:
  """Endless shuffled epochs over examples; each host reads its own shard of every batch.

  State is two integers (epoch, position) so a restored run continues with the same prompts.
  """

  def __init__(self, examples: Sequence[Example], seed: int = 0, shuffle: bool = True,
               process_index: int = 0, process_count: int = 1):
    if not examples:
      raise DataError("no examples to iterate over")
    self.examples, self.seed, self.shuffle = list(examples), seed, shuffle
    self.process_index, self.process_count = process_index, process_count
    self.last_batch: tuple[list, list] = ([], [])  # the last `next_batch`: every process's prompts, this one's
    self.epoch, self.position = 0, 0

  def _order(self, epoch: int) -> np.ndarray:
    n = len(self.examples)
    return np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)

  def next_batch(self, global_size: int) -> list[Example]:
    """The next `global_size` examples of the global order; returns this host's contiguous shard."""
    if global_size % self.process_count:
      raise ValueError(f"batch of {global_size} prompts does not split over {self.process_count} hosts")
    picked = self.take(global_size)
    per_host = global_size // self.process_count
    self.last_batch = (picked, picked[self.process_index * per_host:(self.process_index + 1) * per_host])
    return self.last_batch[1]

  def take(self, n: int) -> list[Example]:
    """The next `n` examples of the global order, the same on every host (streaming: every host
    decides on every prompt)."""
    picked = []
    while len(picked) < n:
      order = self._order(self.epoch)
      take = min(n - len(picked), len(order) - self.position)
      picked += [self.examples[i] for i in order[self.position:self.position + take]]
      self.position += take
      if self.position == len(order):
        self.epoch, self.position = self.epoch + 1, 0
    return picked

  def rewind(self, n: int) -> None:
    """Steps back `n` examples of the global order: the next `take` returns them again, in order
    (prompts a rollout step admitted but did not need)."""
    position = self.epoch * len(self.examples) + self.position - n
    if n < 0 or position < 0:
      raise ValueError(f"cannot rewind {n} examples from epoch {self.epoch}, position {self.position}")
    self.epoch, self.position = divmod(position, len(self.examples))

  def state(self) -> dict:
    return {"epoch": self.epoch, "position": self.position}

  def restore(self, state: dict) -> None:
    if "epoch" not in state:
      raise DataError("the checkpoint's data position is of several mixed train files, this run reads them "
                      "pooled (data.train_weights changed)")
    self.epoch, self.position = int(state["epoch"]), int(state["position"])


_deferred = threading.local()


@contextlib.contextmanager
def deferred_watch():
  """Scores made inside (on this thread) reach the watchers (`watch_scores`, the rollout dumps) only when
  the yielded list's calls are made. A streamed step scores groups past the prefix it consumes as a race with its
  end decides; it reports only the consumed ones, in prompt order, so that what the watchers saw is a
  function of the seed and the data (a resumed run's pools are the uninterrupted run's)."""
  _deferred.calls = calls = []
  try:
    yield calls
  finally:
    _deferred.calls = None


def report(call: Callable[[], object]) -> None:
  """A watcher's record of a group just scored: made now, or, under `deferred_watch`, when the step that
  scored the group reports it."""
  calls = getattr(_deferred, "calls", None)
  if calls is None:
    call()
  else:
    calls.append(call)


def watch_scores(rollout, record, last_batch: Callable[[], tuple] | None = None) -> None:
  """Calls `record(examples, acc_QG, valid_QG)` with every group `rollout.score` scores from now on (under
  `deferred_watch`: when the step reports it). With several processes each scores its share of a batch
  that all of them drew (`last_batch()`: (the batch, this process's share), `next_batch`); such groups are
  recorded with every process's, gathered, so that every process records the same (a streamed step
  scores every group on every process already)."""
  score = rollout.score

  def scored(examples, samples, G, *args, **kw):
    out = score(examples, samples, G, *args, **kw)
    acc = np.asarray(out["acc"], bool)
    valid = np.ones_like(acc) if out.get("valid") is None else np.asarray(out["valid"], bool)
    every, share = last_batch() if last_batch is not None else ((), ())
    if len(every) > len(share) == len(examples) and all(a is b for a, b in zip(examples, share)):
      from dapo_jax import sharding  # noqa: PLC0415 - a collective, in the lockstep every process scores in
      examples, acc, valid = every, sharding.gather_hosts(acc), sharding.gather_hosts(valid)
    report(lambda: record(examples, acc, valid))
    return out
  rollout.score = scored


class MixedIterator:
  """Prompts from several sources (train files) in fixed shares, as `PromptIterator` serves one.

  The i-th prompt of the stream comes from source k with probability `weights[k]` (normalised): the
  sources of the stream are drawn in blocks of `BLOCK` from a generator seeded by (seed, block), so
  they depend on the seed and the position alone, and rewinding n prompts gives back each source's own.
  Each source is its own `PromptIterator` (shuffled epochs, its own seed). State: the stream's
  position and each source's (epoch, position), so a restored run continues with the same prompts.
  Watching a rollout (`watch`), it counts each rollout step's scored groups by source (`metrics`:
  data/source/<name>/groups and /acc, every group the step consumed, kept by dynamic sampling or not).
  """
  BLOCK = 4096

  def __init__(self, sources: Sequence[Sequence[Example]], weights: Sequence[float], seed: int = 0,
               process_index: int = 0, process_count: int = 1, names: Sequence[str] = ()):
    if len(sources) != len(weights) or not sources:
      raise DataError(f"{len(sources)} sources for {len(weights)} weights")
    w = np.asarray(weights, np.float64)
    if not np.all(np.isfinite(w)) or np.any(w <= 0):
      raise DataError(f"the sources' weights {tuple(weights)} must be positive numbers")
    self.p = w / w.sum()
    self.iters = [PromptIterator(s, seed=seed + 1009 * k) for k, s in enumerate(sources)]
    self.seed, self.process_index, self.process_count = seed, process_index, process_count
    self.last_batch: tuple[list, list] = ([], [])  # the last `next_batch`: every process's prompts, this one's
    self.drawn = 0
    self._blocks: dict[int, np.ndarray] = {}
    self.names = list(names) or [f"source{k}" for k in range(len(sources))]
    self._name_of = {ex.source: n for part, n in zip(sources, self.names) for ex in part[:1]}
    self.at_step(0)

  # --- what each source's prompts scored -------------------------------------------------------------
  def at_step(self, step: int) -> None:
    """Rollout step `step` draws next: its counts start at zero."""
    del step
    self._groups = dict.fromkeys(self.names, 0)
    self._acc = {n: [0.0, 0] for n in self.names}  # correct samples, samples

  def record(self, examples: Sequence[Example], acc_QG, valid_QG=None) -> None:
    """Scored groups' outcomes, by the source each prompt came from."""
    acc = np.asarray(acc_QG, bool)
    valid = np.ones_like(acc) if valid_QG is None else np.asarray(valid_QG, bool)
    for ex, a, v in zip(examples, acc, valid):
      name = self._name_of.get(ex.source)
      if name is not None:
        self._groups[name] += 1
        self._acc[name][0] += float(a[v].sum())
        self._acc[name][1] += int(v.sum())

  def watch(self, rollout, last_batch: Callable[[], tuple] | None = None) -> None:
    """Records the groups `rollout.score` scores (training rollouts, every group, kept or dropped);
    `last_batch`: what the last batch drew (`watch_scores`), when a wrapper draws the batches."""
    watch_scores(rollout, self.record, last_batch or (lambda: self.last_batch))

  def metrics(self) -> dict:
    """This step's scored groups and the accuracy of their samples, by source."""
    out = {}
    for n in self.names:
      out[f"data/source/{n}/groups"] = self._groups[n]
      right, samples = self._acc[n]
      if samples:
        out[f"data/source/{n}/acc"] = right / samples
    return out

  # --- the stream ---------------------------------------------------------------------------------

  def source(self, i: int) -> int:
    """The source of the stream's i-th prompt."""
    b = i // self.BLOCK
    if b not in self._blocks:
      if len(self._blocks) > 8:
        self._blocks.clear()
      self._blocks[b] = np.random.default_rng([self.seed, 7919, b]).choice(len(self.p), size=self.BLOCK, p=self.p)
    return int(self._blocks[b][i % self.BLOCK])

  next_batch = PromptIterator.next_batch  # This host's shard of the next `global_size` of the stream.

  def take(self, n: int) -> list[Example]:
    picked = [self.iters[self.source(i)].take(1)[0] for i in range(self.drawn, self.drawn + n)]
    self.drawn += n
    return picked

  def rewind(self, n: int) -> None:
    if n < 0 or n > self.drawn:
      raise ValueError(f"cannot rewind {n} prompts of the {self.drawn} drawn")
    for i in range(self.drawn - n, self.drawn):
      self.iters[self.source(i)].rewind(1)
    self.drawn -= n

  def state(self) -> dict:
    return {"drawn": self.drawn, "sources": [it.state() for it in self.iters]}

  def restore(self, state: dict) -> None:
    if "sources" not in state or len(state["sources"]) != len(self.iters):
      raise DataError(f"a data position of {len(state.get('sources', ()))} sources, this run mixes "
                      f"{len(self.iters)} (data.train_files / data.train_weights changed)")
    self.drawn = int(state["drawn"])
    for it, st in zip(self.iters, state["sources"]):
      it.restore(st)
