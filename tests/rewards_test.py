"""DAPO-Math scorer parity (verl's math_dapo.compute_score), overlong shaping (paper Eq. 13, verl's DAPO
reward manager), and the reward pool."""
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


# --- rewards that misbehave inside the pool -------------------------------------------------------
# The pool's workers import these by path (`HERE:misbehaving`), as they would a user's module.
HERE = __name__
OK = {"score": 1.0, "acc": True, "pred": ""}


class _NeedsArgs(Exception):
  def __init__(self, a, b):  # Unpickles without its arguments: a pool must not choke on it.
    super().__init__(f"{a} {b}")


def misbehaving(response: str, ground_truth: str):
  """Each response names one way a user's reward function can go wrong."""
  import ctypes
  import os
  import time

  import numpy as np
  bad = {"nan": {"score": float("nan"), "acc": True}, "inf": {"score": float("inf")},
         "-inf": {"score": -float("inf")}, "huge": 1e39, "str": {"score": "1.0"}, "none": None,
         "list": [1.0], "nokey": {"acc": True}, "badacc": {"score": 1.0, "acc": "yes"}, "text": "1.0"}
  if response in bad:
    return bad[response]
  if response == "raise_big":
    raise ValueError("x" * 1_000_000)
  if response == "unpicklable":
    raise _NeedsArgs(1, 2)
  if response == "np":
    return {"score": np.float32(0.5), "acc": np.bool_(True)}
  if response == "bigpred":
    return {"score": 1.0, "pred": "p" * 1_000_000}
  if response == "print":
    print("x" * 5_000_000, flush=True)
  if response == "slow":
    time.sleep(1.0)
  if response == "exit":
    os._exit(3)
  if response == "segv":
    ctypes.string_at(0)  # A segmentation fault in the worker.
  return 1.0


BAD = ["nan", "inf", "-inf", "huge", "str", "none", "list", "nokey", "badacc", "text", "raise_big", "unpicklable"]


def test_pool_scores_bad_values_and_errors_as_counted_failures(caplog):
  """Non-finite, out-of-float32 and non-numeric scores, missing keys, unpicklable or huge errors: each
  sample is a FAILURE counted in `errors`, logged in one short line; good samples around them score."""
  pool = rewards.RewardPool(f"{HERE}:misbehaving", timeout_s=30, workers=2)
  try:
    out = pool(["ok"] + BAD + ["np", "bigpred"], [""] * (len(BAD) + 3))
  finally:
    pool.close()
  assert out[0] == OK and out[1:-2] == [rewards.FAILURE] * len(BAD)
  assert out[-2] == {"score": 0.5, "acc": True, "pred": ""}
  assert out[-1]["score"] == 1.0 and len(out[-1]["pred"]) == 1000
  assert pool.errors == len(BAD) and pool.timeouts == 0
  assert "score nan is not a finite float32 number" in caplog.text and "without 'score'" in caplog.text
  assert max(len(r.getMessage()) for r in caplog.records) < 1000


def test_pool_caps_what_a_worker_prints(capfd):
  pool = rewards.RewardPool(f"{HERE}:misbehaving", timeout_s=30, workers=1)
  try:
    out = pool(["print", "ok"], ["", ""])
  finally:
    pool.close()
  assert out == [OK, OK]
  printed = capfd.readouterr().out
  assert 16_000 < len(printed) < 20_000 and "output beyond 16384 characters of this call dropped" in printed


@pytest.mark.parametrize("death", ["exit", "segv"])
def test_pool_blames_only_the_call_whose_worker_died(death):
  """A worker that dies (os._exit, a segfault) fails its own sample; a call that was running on the
  other worker at that moment runs again alone and scores."""
  pool = rewards.RewardPool(f"{HERE}:misbehaving", timeout_s=30, workers=2)
  try:
    out = pool(["slow", death, "ok", "ok"], [""] * 4)
    again = pool(["ok"], [""])
  finally:
    pool.close()
  assert out == [OK, rewards.FAILURE, OK, OK] and again == [OK]
  assert pool.errors == 1 and pool.timeouts == 0


def test_non_finite_weight_is_refused():
  with pytest.raises(rewards.RewardConfigError, match=r"'nan\*dapo_jax.rewards:math_dapo': weight nan"):
    rewards.parse_weighted(["nan*dapo_jax.rewards:math_dapo"])


@pytest.mark.slow  # ~20 s: builds a whole run.
def test_a_nan_reward_is_counted_and_the_run_goes_on(tmp_path):
  """`testing.nan_reward` (mixed acc, NaN scores) used to reach the advantages and stop the
  run after max_bad_steps; now every sample is a counted failure and every metric is finite."""
  import math

  from configs import dapo_qwen2_5_32b
  from dapo_jax import builders
  cfg = dapo_qwen2_5_32b.get_config("runlocal")
  cfg.reward.update(fn="dapo_jax.testing:nan_reward", workers=1)
  cfg.dapo.max_gen_batches = 1
  with builders.dapo(cfg, str(tmp_path)) as run:
    m, _ = run.step(0)
  assert m["reward/errors"] > 0 and "actor/pg_loss" not in m
  assert all(math.isfinite(v) for v in m.values() if isinstance(v, (int, float))), m


def test_a_pools_workers_end_when_the_process_that_started_them_is_killed(tmp_path):
  """kill -9 of a run never shuts its reward pool down: its workers notice their parent is gone and
  exit (within a few seconds) instead of waiting on their queue for ever."""
  import os
  import signal
  import subprocess
  import sys
  import time
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  script = ("import os, sys, time\n"
            "from dapo_jax import rewards\n"
            "pool = rewards.RewardPool('dapo_jax.rewards:math_dapo', timeout_s=30, workers=2)\n"
            "pool._executor()\n"
            "print(' '.join(str(p) for p in pool._executor()._processes), flush=True)\n"
            "time.sleep(600)\n")
  run = subprocess.Popen([sys.executable, "-c", script], cwd=root, env=dict(os.environ, PYTHONPATH=root),
                         stdout=subprocess.PIPE, text=True)
  workers = [int(p) for p in run.stdout.readline().split()]
  assert len(workers) == 2 and all(os.path.exists(f"/proc/{p}") for p in workers)
  os.kill(run.pid, signal.SIGKILL)
  run.wait(timeout=30)
  deadline = time.time() + 20
  alive = lambda p: os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"
  while any(alive(p) for p in workers) and time.time() < deadline:
    time.sleep(0.2)
  assert not any(alive(p) for p in workers), [p for p in workers if alive(p)]
