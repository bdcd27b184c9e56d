"""reasoning-gym (pip install reasoning-gym) as a data task: `data.task="reasoning_gym"`.

Items come from the package's own generators (`reasoning_gym.create_dataset(name, size, seed, **settings)`),
deterministic by seed. Item i of a generator is drawn from Random(seed + i), so seeds s and s + 1 share
all but one item: the held-out set is drawn from seed + 10^9 (no index range of a training set reaches
it), and every training item whose question also appears there is dropped (small generators repeat
questions), so the two splits never share an item. Each example's ground truth is
the item itself as JSON, which `dapo_jax.rewards:reasoning_gym` hands to the task's own verifier
(`score_answer`). The model answers inside <answer>...</answer>, the format the package's
`extract_answer` reads.
"""
from __future__ import annotations

import itertools
import json

from dapo_jax.data.prompts import DataError, Example

INSTRUCTION = "{question}\nGive your final answer inside <answer></answer> tags, e.g. <answer>42</answer>."
HELDOUT_SEED_OFFSET = 10**9  # held-out items: Random(seed + 10^9 + i)
SHOT_SEED_OFFSET = 2 * 10**9  # worked examples before each question (`fewshot`): Random(seed + 2*10^9 + i)


def _generate(task: str, size: int, seed: int, settings: dict) -> list[dict]:
  try:
    import reasoning_gym
    from reasoning_gym.factory import DATASETS
  except ImportError:
    raise DataError("data.task='reasoning_gym' needs the reasoning-gym package: pip install reasoning-gym") from None
  if task not in DATASETS:
    raise DataError(f"data.rg_tasks: unknown reasoning-gym task {task!r}; e.g. {sorted(DATASETS)[:8]}")
  try:
    ds = reasoning_gym.create_dataset(task, size=size, seed=seed, **settings)
  except (TypeError, ValueError, AssertionError) as e:
    raise DataError(f"data.rg_settings for {task!r}: {settings} rejected by reasoning-gym ({e})") from None
  return [ds[i] for i in range(size)]


def example(item: dict, index: int, template: str = INSTRUCTION, shots: tuple[dict, ...] = ()) -> Example:
  return Example(messages=shots + ({"role": "user", "content": template.format(question=item["question"])},),
                 ground_truth=json.dumps(item), data_source="reasoning_gym", index=index)


def worked_examples(tasks: tuple[str, ...], fewshot: int, *, seed: int = 0, settings: dict | None = None,
                    template: str = INSTRUCTION, exclude: frozenset = frozenset()) -> tuple[dict, ...]:
  """`fewshot` (user question, assistant answer) pairs, taken from the tasks in turn from their own
  seed: the answer format shown to a model that does not follow the instruction alone. The answer is
  "<answer>X</answer>", after the item's expression worked out ("4 + 7 = 11") where the item has one
  (chain_sum, basic_arithmetic): small models answer far better having written the sum first.
  Questions in `exclude` (the held-out set) are skipped."""
  settings, shots = settings or {}, ()
  per_task = [[it for it in _generate(t, 4 * fewshot + 8, seed + SHOT_SEED_OFFSET, settings.get(t, {}))
               if it["question"] not in exclude] for t in tasks]
  for it in [it for row in zip(*per_task) for it in row][:fewshot]:
    shots += ({"role": "user", "content": template.format(question=it["question"])},
              {"role": "assistant", "content": _worked_answer(it)})
  return shots


def _worked_answer(item: dict) -> str:
  expression = (item.get("metadata") or {}).get("expression")
  worked = f"{expression} = {item['answer']}\n" if isinstance(expression, str) else ""
  return f"{worked}<answer>{item['answer']}</answer>"


def examples(tasks: tuple[str, ...], num_train: int, num_eval: int, *, seed: int = 0,
             settings: dict | None = None, template: str = INSTRUCTION,
             fewshot: int = 0) -> tuple[list[Example], list[Example]]:
  """(train, held-out): `num_train` (less those also held out) and `num_eval` items per task, taken
  from the tasks in turn;
  `settings` maps a task name to its generator's keyword arguments; `fewshot` worked examples
  (`worked_examples`) open every prompt of both splits."""
  if not tasks:
    raise DataError("data.rg_tasks is empty; name reasoning-gym tasks, e.g. ('chain_sum',)")
  settings = settings or {}
  unknown = [k for k in settings if k not in tasks]
  if unknown:
    raise DataError(f"data.rg_settings names {unknown[0]!r}, which is not in data.rg_tasks={tuple(tasks)}")
  train, heldout = [], []
  for task in tasks:
    kw = settings.get(task, {})
    held = _generate(task, num_eval, seed + HELDOUT_SEED_OFFSET, kw)
    seen = {it["question"] for it in held}
    heldout.append(held)
    train.append([it for it in _generate(task, num_train, seed, kw) if it["question"] not in seen])
  mix = lambda per_task: [it for row in itertools.zip_longest(*per_task) for it in row if it is not None]
  shots = _shots(tasks, fewshot, heldout, seed, settings, template)
  return ([example(it, i, template, shots) for i, it in enumerate(mix(train))],
          [example(it, i, template, shots) for i, it in enumerate(mix(heldout))])


def shots(tasks: tuple[str, ...], fewshot: int, num_eval: int, *, seed: int = 0, settings: dict | None = None,
          template: str = INSTRUCTION) -> tuple[dict, ...]:
  """The worked examples `examples` puts before every question (for a question typed by a person)."""
  settings = settings or {}
  heldout = [_generate(t, num_eval, seed + HELDOUT_SEED_OFFSET, settings.get(t, {})) for t in tasks] if fewshot else []
  return _shots(tasks, fewshot, heldout, seed, settings, template)


def _shots(tasks, fewshot, heldout, seed, settings, template) -> tuple[dict, ...]:
  if not fewshot:
    return ()
  return worked_examples(tasks, fewshot, seed=seed, settings=settings, template=template,
                         exclude=frozenset(it["question"] for held in heldout for it in held))
