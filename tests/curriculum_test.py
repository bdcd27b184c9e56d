"""Difficulty pools over the prompt stream (`data.curriculum`): what is set aside, skipped and brought back,
rewinding over skipped prompts, the state a checkpoint keeps; and runs on a six-problem file whose
prompts recur every step: the pools act, and a run stopped and resumed draws what the uninterrupted
run draws."""
import json

import pytest

from configs import default
from dapo_jax import builders, dumps, metrics
from dapo_jax.data import curriculum
from dapo_jax.data import prompts as data_lib

EX = [data_lib.Example(messages=({"role": "user", "content": f"q{i}"},), ground_truth=str(i), source="f")
      for i in range(6)]


def stream(revisit_after=2, aside="both", streak=1):
  return curriculum.Curriculum(data_lib.PromptIterator(EX, shuffle=False), revisit_after, size=len(EX), aside=aside,
                               streak=streak)


def names(exs):
  return [ex.messages[0]["content"] for ex in exs]


def test_solved_and_unsolved_prompts_are_set_aside_then_come_back():
  c = stream(revisit_after=2)
  c.at_step(1)
  first = c.take(3)
  c.record(first, [[True, True], [True, False], [False, False]])  # q0 solved, q1 mixed, q2 out of reach
  assert names(c.take(3)) == ["q3", "q4", "q5"]
  assert c.metrics() == {"data/curriculum_skipped": 0, "data/curriculum_set_aside": 2, "data/curriculum_early": 0,
                         "data/curriculum_pool": 2}
  for step in (2, 3):  # Set aside for 2 steps: the next epochs skip q0 and q2.
    c.at_step(step)
    assert names(c.take(4)) == ["q1", "q3", "q4", "q5"] and c.metrics()["data/curriculum_skipped"] == 2
  c.at_step(4)  # Back: drawn, and judged again (mixed this time: stays in).
  back = c.take(3)
  assert names(back) == ["q0", "q1", "q2"]
  c.record(back[:1], [[True, False]])
  assert c.metrics()["data/curriculum_pool"] == 0


@pytest.mark.parametrize("aside,kept_out", [("solved", ["q0"]), ("unsolved", ["q2"])])
def test_only_the_named_outcome_sets_a_prompt_aside(aside, kept_out):
  """`data.curriculum_aside`: only solved (all right) or only unsolved (all wrong) groups set their
  prompt aside; the other kind brings it in, as a mixed group does."""
  c = stream(revisit_after=2, aside=aside)
  c.at_step(1)
  first = c.take(3)
  c.record(first, [[True, True], [True, False], [False, False]])  # q0 solved, q1 mixed, q2 out of reach
  assert c.metrics()["data/curriculum_set_aside"] == 1 and c.metrics()["data/curriculum_pool"] == 1
  c.take(3)
  c.at_step(2)
  assert names(c.take(5)) == [q for q in ("q0", "q1", "q2", "q3", "q4", "q5") if q not in kept_out]
  with pytest.raises(ValueError, match="data.curriculum_aside"):
    stream(aside="easy")


def test_a_streak_sets_a_prompt_aside_only_after_that_many_uniform_groups_in_a_row():
  """`data.curriculum_streak=2`: a prompt leaves the stream on its second all-wrong (or all-right) group in
  a row; a mixed group, or one of the other kind, starts the count again; the count is checkpointed."""
  c = stream(revisit_after=10, streak=2)
  outcomes = {"q0": [[False, False]] * 2, "q1": [[False, False], [True, False]], "q2": [[True, True], [False, False]],
              "q3": [[True, True]] * 2}
  for visit in range(2):
    c.at_step(visit + 1)
    exs = c.take(6)
    assert names(exs) == ["q0", "q1", "q2", "q3", "q4", "q5"]  # Nothing aside after the first visit.
    c.record(exs[:4], [outcomes[q][visit] for q in names(exs[:4])])
  assert c.metrics()["data/curriculum_set_aside"] == 2
  state = json.loads(json.dumps(c.state()))
  c.at_step(3)
  assert names(c.take(4)) == ["q1", "q2", "q4", "q5"]  # q0 (twice unsolved) and q3 (twice solved) aside.
  again = stream(revisit_after=10, streak=2)
  again.restore(state)
  again.at_step(3)
  again.record([EX[1], EX[2]], [[False, False], [False, False]])  # q1: mixed, unsolved; q2: solved, unsolved x 2.
  assert again.metrics()["data/curriculum_set_aside"] == 1
  assert sorted(again.state()["until"]) == [curriculum.key(EX[i]) for i in (0, 2, 3)]
  with pytest.raises(ValueError, match="data.curriculum_streak"):
    stream(streak=0)
  with pytest.raises(ValueError, match="curriculum streaks"):
    stream(streak=2).restore(stream().state())


def test_rewind_steps_back_over_the_skipped_prompts_and_the_state_round_trips():
  c = stream(revisit_after=5)
  c.at_step(1)
  c.record(EX[:3:2], [[True, True], [False, False]])  # q0 and q2 aside
  c.at_step(2)
  assert names(c.take(2)) == ["q1", "q3"]
  state = json.loads(json.dumps(c.state()))  # As a checkpoint holds it.
  ahead = names(c.take(3))
  assert ahead == ["q4", "q5", "q1"]  # The next epoch, q0 skipped again.
  c.rewind(3)
  assert names(c.take(3)) == ahead
  again = stream(revisit_after=5)
  again.restore(state)
  again.at_step(2)
  assert names(again.take(3)) == ahead
  with pytest.raises(ValueError, match="cannot rewind"):
    again.rewind(4)
  with pytest.raises(data_lib.DataError, match="data.curriculum changed"):
    stream().restore({"epoch": 0, "position": 0})


def test_a_stream_whose_every_prompt_is_aside_serves_rather_than_stalls():
  c = stream(revisit_after=3)
  c.at_step(1)
  c.record(EX, [[True, True]] * len(EX))
  c.at_step(2)
  assert len(c.take(2)) == 2 and c.metrics()["data/curriculum_early"] == 2


def write_rows(path, n):
  rows = [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": f"What is {i}+1?"}],
           "reward_model": {"ground_truth": str(i + 1), "style": "rule"}} for i in range(n)]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("streak", [1, 2])
def test_pools_act_and_a_resumed_run_draws_what_the_uninterrupted_one_draws(tmp_path, streak):
  train = write_rows(tmp_path / "six.jsonl", 6)

  def config(steps):
    cfg = default.get_config("runlocal")
    cfg.model.init = "random"
    cfg.reward.fn = "dapo_jax.testing:length_reward"
    cfg.data.update(task="file", train_files=(train,), eval_files=(train,), num_eval=2, curriculum=True,
                    revisit_after=1, curriculum_streak=streak)
    cfg.train.update(num_steps=steps, dump_rollouts_every=1, ckpt_every=1, keep_ckpts=10)
    return cfg

  builders.run(config(4), str(tmp_path / "straight"))
  builders.run(config(2), str(tmp_path / "stopped"))
  builders.run(config(4), str(tmp_path / "stopped"))  # Resumes after step 2.
  # The pools and the stream's position as each checkpoint holds them, and every metric of every step
  # (prompts admitted, samples, rewards, the pools' counts), are the uninterrupted run's.
  extra = lambda name, step: json.load(open(tmp_path / name / "checkpoints" / str(step) / "extra" / "metadata"))
  for step in (3, 4):
    assert extra("stopped", step)["data"] == extra("straight", step)["data"]
  recs = {name: metrics.read_jsonl(str(tmp_path / name / "metrics.jsonl")) for name in ("straight", "stopped")}
  for step in range(1, 5):
    same = lambda r: {k: v for k, v in r[step].items() if not k.startswith(("timing_s/", "perf/"))}
    assert same(recs["stopped"]) == same(recs["straight"]), step
  r = recs["straight"]
  if streak > 1:  # Four steps hold no second uniform group in a row here; the counts resumed exactly.
    assert extra("straight", 4)["data"]["runs"]
    return
  assert sum(r[s]["data/curriculum_set_aside"] for s in range(1, 5)) > 0 and extra("straight", 4)["data"]["until"]
  # A prompt aside after step k (its group all right or all wrong) is not drawn at step k + 1
  # (revisit_after=1), unless every prompt was aside.
  acted = 0
  for k in (1, 2, 3):
    aside = {key.split("\x00")[1] for key, until in extra("straight", k)["data"]["until"].items() if until > k}
    drawn = {row["prompt"] for row in dumps.read(dumps.path(str(tmp_path / "straight"), k + 1))}
    assert not (aside & drawn) or r[k + 1]["data/curriculum_early"] > 0, k
    acted += len(aside)
  assert acted
