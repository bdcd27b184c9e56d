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


def example(item: dict, index: int, template: str = INSTRUCTION) -> Example:
  return Example(messages=({"role": "user", "content": template.format(question=item["question"])},),
                 ground_truth=json.dumps(item), data_source="reasoning_gym", index=index)


def examples(tasks: tuple[str, ...], num_train: int, num_eval: int, *, seed: int = 0,
             settings: dict | None = None, template: str = INSTRUCTION) -> tuple[list[Example], list[Example]]:
  """(train, held-out): `num_train` (less those also held out) and `num_eval` items per task, taken
  from the tasks in turn;
  `settings` maps a task name to its generator's keyword arguments."""
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
  return ([example(it, i, template) for i, it in enumerate(mix(train))],
          [example(it, i, template) for i, it in enumerate(mix(heldout))])
