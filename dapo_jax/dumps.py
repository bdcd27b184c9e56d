"""Every rollout and held-out sample of a run on disk, for reading later (verl's `rollout_data_dir`
and `validation_data_dir`, TRL's `log_completions`):

  WORKDIR/rollouts/step_<N>.jsonl.gz        the rollouts sampled for rollout step N (1-based, as
                                            metrics.jsonl counts): every scored group, kept or dropped
  WORKDIR/rollouts/eval_step_<N>.jsonl.gz   the held-out samples of the evaluation logged at step N

One JSON object per response: `prompt` (the question: the last user turn), `response`, `ground_truth`,
`score` (the reward, overlong penalty included), `acc`, `pred`, `length` (tokens), `truncated` (no
EOS within the budget), `kept` (dynamic sampling's filter let the group through; surplus kept
groups may still go unused), `masked` (an episode whose environment failed: out of the loss and of
its group's statistics, `rollout.env_error`), `source` (the train file, for rows read from files),
`parts` (the reward's components that `dapo.gdpo_reward_keys` names, by name),
`group` and `sample` (its prompt's number in the step and its index
in the group), `step` and `policy_step` (the rollout step whose parameters sampled it: the number
of rollout steps trained before). Held-out rows have no `length`, `truncated` or `kept` (the
evaluator scores texts). Read one with `zcat WORKDIR/rollouts/step_1.jsonl.gz | head` or
`read()`.

The recorder wraps the rollout's own scoring (`Rollout.score` for training, `Rollout.call_reward`
for evaluations) on the one `Rollout` instance it is given, so both dynamic-sampling paths and the
evaluator are seen without a hook in each. With several processes, process 0 writes the rows it scored.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import os
import threading

import numpy as np

from dapo_jax.data import prompts as data_lib

DIRNAME = "rollouts"


def path(workdir: str, step: int, kind: str = "step") -> str:
  """WORKDIR/rollouts/step_<N>.jsonl.gz (kind="step") or eval_step_<N>.jsonl.gz (kind="eval")."""
  return os.path.join(workdir, DIRNAME, f"{'eval_step' if kind == 'eval' else 'step'}_{step}.jsonl.gz")


def read(file: str) -> list[dict]:
  with gzip.open(file, "rt") as f:
    return [json.loads(line) for line in f if line.strip()]


def _num(x):
  x = x.item() if hasattr(x, "item") else x
  return x if not isinstance(x, float) or np.isfinite(x) else str(x)


class RolloutRecorder:
  """Records what `rollout` scores while `recording(kind, step)` is open, and writes it at its end."""

  def __init__(self, workdir: str, rollout, *, filter_groups: bool, enabled: bool = True):
    self.workdir, self.rollout, self.filter_groups, self.enabled = workdir, rollout, filter_groups, enabled
    self.rows: list[dict] | None = None
    self.kind, self.groups = None, 0
    self._lock = threading.Lock()  # streaming scores in a reward thread
    score, call_reward = rollout.score, rollout.call_reward

    def recorded_score(examples, samples, G, rewards=None):
      out = score(examples, samples, G, rewards)

      def rows():
        if self.rows is not None and self.kind == "step":
          self._train_rows(examples, samples, G, out)
      data_lib.report(rows)  # A streamed step's: of the groups it consumed, in prompt order.
      return out

    def recorded_call_reward(texts, examples, reward=None):
      out = call_reward(texts, examples, reward)
      if self.rows is not None and self.kind == "eval":
        self._eval_rows(texts, examples, out)
      return out

    rollout.score, rollout.call_reward = recorded_score, recorded_call_reward

  @contextlib.contextmanager
  def recording(self, kind: str, step: int, policy_step: int, file: str | None = None):
    """Records while open; writes `file` (default `path(workdir, step, kind)`) when it closes
    (nothing if disabled)."""
    if not self.enabled:
      yield
      return
    self.rows, self.kind, self.groups, self.step, self.policy_step = [], kind, 0, step, policy_step
    try:
      yield
      self.write(file or path(self.workdir, step, kind), self.rows)
    finally:
      self.rows, self.kind = None, None

  def _train_rows(self, examples, samples, G, out) -> None:
    from dapo_jax.rollout import dynamic_sampling  # noqa: PLC0415 (rollout imports nothing of this)
    valid = out.get("valid")
    kept = dynamic_sampling.keep_groups(out["filter"], valid) if self.filter_groups else np.ones(len(examples), bool)
    keys = self.rollout.cfg.gdpo_reward_keys
    rows = []
    for b, text in enumerate(out["texts"]):
      q, g = divmod(b, G)
      rows.append({"prompt": examples[q].messages[-1]["content"], "response": text,
                   "ground_truth": examples[q].ground_truth, "score": _num(out["score"][q, g]),
                   "acc": bool(out["acc"][q, g]), "pred": out["pred"][b], "length": int(samples.length_B[b]),
                   "truncated": bool(samples.truncated_B[b]), "kept": bool(kept[q]), "sample": g,
                   "masked": valid is not None and not bool(valid[q, g])})
      if examples[q].source:  # The train file it came from (several files, mixed: data.train_weights).
        rows[-1]["source"] = examples[q].source
      if keys:
        rows[-1]["parts"] = {k: float(v) for k, v in zip(keys, out["parts"][q, g])}
    with self._lock:
      for i, r in enumerate(rows):
        r["group"] = self.groups + i // G
      self.groups += len(examples)
      self.rows += [dict(r, step=self.step, policy_step=self.policy_step) for r in rows]

  def _eval_rows(self, texts, examples, out) -> None:
    last = None
    for text, ex, res in zip(texts, examples, out):
      if ex is not last:
        self.groups, sample, last = self.groups + 1, 0, ex
      self.rows.append({"prompt": ex.messages[-1]["content"], "response": text, "ground_truth": ex.ground_truth,
                        "score": _num(res["score"]), "acc": bool(res["acc"]), "pred": res["pred"],
                        "group": self.groups - 1, "sample": sample, "step": self.step,
                        "policy_step": self.policy_step})
      sample += 1

  @staticmethod
  def write(file: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(file)), exist_ok=True)
    with gzip.open(file + ".tmp", "wt") as f:
      for r in rows:
        f.write(json.dumps(r) + "\n")
    os.replace(file + ".tmp", file)
