"""Held-out metrics against hand-counted samples."""
import types

import jax

from dapo_jax import evaluate


def test_majority_vote_by_hand():
  assert evaluate.majority_correct([False, True, True, False], ["3", "5", "5", "4"])
  assert not evaluate.majority_correct([True, False, False], ["5", "4", "4"])
  # A tie goes to the prediction seen first.
  assert evaluate.majority_correct([True, False], ["5", "4"])
  assert not evaluate.majority_correct([False, True], ["4", "5"])


class FakeRollout:
  """Generates nothing: `decode` yields one prediction per row, scored against the ground truth."""

  cfg = types.SimpleNamespace(engine="static")

  def __init__(self, answers):
    self.answers = answers  # prompt text -> k predicted answers
    self.reward = lambda texts, gts: [{"acc": t == g, "pred": t, "score": float(t == g)} for t, g in zip(texts, gts)]

  def call_reward(self, texts, examples, reward=None):  # As Rollout.call_reward: `reward` or the rollout's.
    return (reward or self.reward)(texts, [ex.ground_truth for ex in examples])

  def generate(self, params, examples, k, key, sampler_cfg):
    return [a for ex in examples for a in self.answers[ex.messages[0]["content"]][:k]]

  def decode(self, samples):
    return samples


def test_mean_best_and_majority_at_k_by_hand():
  from dapo_jax.data.prompts import Example
  exs = [Example(messages=[{"role": "user", "content": q}], ground_truth=gt) for q, gt in
         [("a", "1"), ("b", "2"), ("c", "3")]]
  answers = {"a": ["1", "0", "0", "1"], "b": ["0", "0", "9", "2"], "c": ["7", "7", "7", "7"]}
  ev = evaluate.Evaluator(FakeRollout(answers), exs, k=4, sampler_cfg=None, rows=2)
  m = ev.run(params=None, key=jax.random.key(0))
  assert m["val/acc/mean@4"] == (2 + 1 + 0) / 12
  assert m["val/acc/best@4"] == 2 / 3
  # maj: a -> "1" and "0" tie, "1" first: correct; b -> "0": wrong; c -> "7": wrong.
  assert m["val/acc/maj@4"] == 1 / 3


def test_identical_rows_are_one_problem_with_their_copies_as_samples():
  """AIME's layout: each problem repeated; k=1 over the copies gives avg/best/maj@copies per problem."""
  from dapo_jax.data.prompts import Example
  exs = [Example(messages=[{"role": "user", "content": q}], ground_truth=gt)
         for q, gt in [("a", "1"), ("b", "2")] for _ in range(3)]
  answers = {"a": ["1", "0", "1"], "b": ["0", "2", "3"]}
  ev = evaluate.Evaluator(FakeRollout(answers), exs, k=1, sampler_cfg=None, rows=2)
  m = ev.run(params=None, key=jax.random.key(0))
  assert ev.copies == [3, 3] and ev.sampled_rows == 6
  assert m == {"val/acc/mean@3": 3 / 6, "val/acc/best@3": 1.0, "val/acc/maj@3": 0.5}
