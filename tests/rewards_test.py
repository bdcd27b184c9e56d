"""DAPO-Math scorer parity (DAPO_SPEC §4.3 table), overlong shaping (§3.2), and the reward pool."""
import time

import pytest

from dapo_jax import rewards

PLUS = ["Answer: 540", "answer:540", "ANSWER :  540  ", "Answer: $540$", "Answer: \\boxed{540}",
        "Answer: $\\boxed{540}$", "Answer: x = 540", "Answer: 540 degrees", "Final Answer: 540"]


@pytest.mark.parametrize("tail", PLUS)
def test_correct_formats(tail):
  out = rewards.math_dapo("Some reasoning.\n" + tail, "540")
  assert out == {"score": 1.0, "acc": True, "pred": "540"}


@pytest.mark.parametrize("response,gt,pred", [
    ("Answer: 1,000", "1000", "1000"),
    ("Answer: -3", "-3", "-3"),
])
def test_correct_other(response, gt, pred):
  assert rewards.math_dapo(response, gt) == {"score": 1.0, "acc": True, "pred": pred}


@pytest.mark.parametrize("response,pred", [
    ("Answer: 540.", "540."),             # trailing period
    ("**Answer:** 540", "**540"),         # markdown bold
    ("Answer: **540**", "**540**"),
    ("Answer: \\(540\\)", "\\(540\\)"),
    ("Answer: 0540", "0540"),             # leading zero
    ("The answer is \\boxed{540}", "[INVALID]"),
])
def test_brittle_formats_score_minus_one(response, pred):
  assert rewards.math_dapo(response, "540") == {"score": -1.0, "acc": False, "pred": pred}


def test_answer_outside_last_300_chars():
  response = "Answer: 540\n" + "x" * 300
  assert rewards.math_dapo(response, "540")["score"] == -1.0
  assert rewards.math_dapo("Answer: 540\n" + "x" * 287, "540")["score"] == 1.0  # 300 chars exactly


def test_last_match_wins():
  assert rewards.math_dapo("Answer: 12\nwait, no.\nAnswer: 540", "540")["acc"]
  assert not rewards.math_dapo("Answer: 540\nAnswer: 12", "540")["acc"]


@pytest.mark.parametrize("length,value", [(16384, 0.0), (16385, -1 / 4096), (18432, -0.5),
                                          (20479, -4095 / 4096), (20480, -1.0), (100, 0.0)])
def test_overlong_penalty_values(length, value):
  assert rewards.overlong_penalty(length, 20480, 4096, 1.0) == pytest.approx(value, abs=1e-12)


def test_overlong_penalty_floor_and_factor():
  assert rewards.overlong_penalty(30000, 20480, 4096, 1.0) == -1.0
  assert rewards.overlong_penalty(18432, 20480, 4096, 0.5) == pytest.approx(-0.25)
  assert rewards.overlong_penalty(20480, 20480, 0, 1.0) == 0.0  # buffer off


def test_resolve_errors():
  assert rewards.resolve("dapo_jax.rewards:math_dapo") is rewards.math_dapo
  with pytest.raises(rewards.RewardConfigError, match="no_such_module"):
    rewards.resolve("no_such_module:f")
  with pytest.raises(rewards.RewardConfigError, match="has no function 'nope'"):
    rewards.resolve("dapo_jax.rewards:nope")
  with pytest.raises(rewards.RewardConfigError, match="package.module:function"):
    rewards.resolve("dapo_jax.rewards.math_dapo")


def test_pool_scores_in_workers():
  pool = rewards.RewardPool("dapo_jax.rewards:math_dapo", timeout_s=30)
  try:
    out = pool(["Answer: 5", "Answer: 6", "nothing"], ["5", "5", "5"])
  finally:
    pool.close()
  assert [o["score"] for o in out] == [1.0, -1.0, -1.0]


def test_pool_survives_raising_and_hanging_functions():
  pool = rewards.RewardPool("dapo_jax.testing:raising_reward", timeout_s=30)
  try:
    out = pool(["a", "b"], ["1", "1"])
  finally:
    pool.close()
  assert out == [rewards.FAILURE, rewards.FAILURE] and pool.errors == 2

  pool = rewards.RewardPool("dapo_jax.testing:hanging_reward", timeout_s=1.0, workers=2)
  t0 = time.monotonic()
  try:
    out = pool(["a", "b", "c"], ["1", "1", "1"])
  finally:
    pool.close()
  assert out == [rewards.FAILURE] * 3 and pool.timeouts == 3
  assert time.monotonic() - t0 < 20  # Bounded by timeouts, not by the hang.


def test_pool_times_out_only_calls_that_ran_for_the_timeout():
  """Calls queued behind hung ones are not timeouts: each call gets timeout_s of its own run time.

  With 2 workers both hung, the pool's executor already lists the third call as running (it sits in
  the workers' call queue); it must be re-queued after the hung workers are replaced, and score +1.
  """
  pool = rewards.RewardPool("dapo_jax.testing:hang_on_request", timeout_s=1.0, workers=2)
  responses = ["hang", "hang", "ok", "ok", "ok"]
  t0 = time.monotonic()
  try:
    out = pool(responses, ["1"] * 5)
  finally:
    pool.close()
  assert out[:2] == [rewards.FAILURE] * 2
  assert out[2:] == [{"score": 1.0, "acc": True, "pred": "ok"}] * 3
  assert pool.timeouts == 2 and pool.errors == 0
  assert time.monotonic() - t0 < 30


def test_pool_slow_calls_behind_a_hang_are_not_timed_out():
  """A call that runs for less than timeout_s is never cut, even when it waited longer than that."""
  pool = rewards.RewardPool("dapo_jax.testing:hang_on_request", timeout_s=1.0, workers=1)
  try:
    out = pool(["hang", "ok", "hang", "ok"], ["1"] * 4)
  finally:
    pool.close()
  assert [o["score"] for o in out] == [-1.0, 1.0, -1.0, 1.0] and pool.timeouts == 2


def test_pool_survives_a_function_that_kills_its_worker():
  """A dead worker breaks the executor: the call that ran fails, the queued ones run in a new pool."""
  pool = rewards.RewardPool("dapo_jax.testing:exit_on_request", timeout_s=30, workers=1)
  try:
    out = pool(["ok", "exit", "ok", "ok"], ["1"] * 4)
    again = pool(["ok"], ["1"])
  finally:
    pool.close()
  ok = {"score": 1.0, "acc": True, "pred": "ok"}
  assert out == [ok, rewards.FAILURE, ok, ok] and again == [ok]
  assert pool.errors == 1 and pool.timeouts == 0
