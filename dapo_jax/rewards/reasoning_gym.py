"""The reasoning-gym reward: the task's own verifier (`score_answer`) on the model's <answer> (jax-free)."""
from __future__ import annotations

import json


def reasoning_gym(response: str, ground_truth: str) -> dict:
  """+1 for a fully correct answer, -1 for none, 2s - 1 for reasoning-gym's partial score s in [0, 1]."""
  import reasoning_gym as rg
  from reasoning_gym.utils import extract_answer
  item = json.loads(ground_truth)
  pred = extract_answer(response)
  s = float(rg.get_score_answer_fn(item["metadata"]["source_dataset"])(pred, item)) if pred is not None else 0.0
  return {"score": 2.0 * s - 1.0, "acc": s == 1.0, "pred": "[INVALID]" if pred is None else pred}
