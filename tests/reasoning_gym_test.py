"""reasoning-gym as data (`data.task="reasoning_gym"`) and reward (`dapo_jax.rewards:reasoning_gym`): the
items and scores are those of calling reasoning-gym directly; the held-out split shares no item with
training; an unknown task fails in one line naming the field."""
import json

import pytest

from configs import common
from dapo_jax import builders, rewards
from dapo_jax.data import prompts
from dapo_jax.data import reasoning_gym as rg_data

rg = pytest.importorskip("reasoning_gym")
SETTINGS = {"chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}}


def _cfg(**data):
  c = common.base()
  c.data.update({**dict(task="reasoning_gym", rg_tasks=("chain_sum", "basic_arithmetic"), rg_num_train=50,
                        num_eval=20, rg_settings=json.dumps(SETTINGS)), **data})
  c.seed = 3
  return c


def test_items_are_reasoning_gyms_own():
  train, heldout = builders.datasets(_cfg())
  ref_train = {t: rg.create_dataset(t, size=50, seed=3, **SETTINGS.get(t, {})) for t in ("chain_sum", "basic_arithmetic")}
  ref_held = {t: rg.create_dataset(t, size=20, seed=3 + 10**9, **SETTINGS.get(t, {})) for t in ("chain_sum", "basic_arithmetic")}
  assert len(heldout) == 40
  assert [json.loads(ex.ground_truth) for ex in heldout[0::2]] == json.loads(json.dumps(list(ref_held["chain_sum"])))
  assert [json.loads(ex.ground_truth) for ex in heldout[1::2]] == json.loads(
      json.dumps(list(ref_held["basic_arithmetic"])))
  train_items = [json.loads(ex.ground_truth) for ex in train]
  ref_items = json.loads(json.dumps([it for ds in ref_train.values() for it in ds]))
  assert all(it in ref_items for it in train_items) and len(train_items) == 100
  assert heldout[0].messages[-1]["content"] == rg_data.INSTRUCTION.format(question=ref_held["chain_sum"][0]["question"])


def test_heldout_split_is_disjoint():
  train, heldout = rg_data.examples(("chain_sum",), 500, 200, seed=0,
                                    settings={"chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 1}})
  # 1-digit pairs: few distinct questions, so the seeds collide and the collisions are dropped from training.
  assert len(train) < 500
  assert not {json.loads(e.ground_truth)["question"] for e in train} & {json.loads(e.ground_truth)["question"]
                                                                        for e in heldout}


def test_scores_are_the_verifiers():
  _, heldout = rg_data.examples(("chain_sum", "basic_arithmetic"), 10, 10, seed=0)
  for ex in heldout:
    item = json.loads(ex.ground_truth)
    score_fn = rg.get_score_answer_fn(item["metadata"]["source_dataset"])
    for answer in (item["answer"], "7", "-1"):
      got = rewards.reasoning_gym(f"Let me think.\n<answer>{answer}</answer>", ex.ground_truth)
      s = score_fn(answer, item)
      assert got == {"score": 2 * s - 1, "acc": s == 1.0, "pred": answer}
    assert rewards.reasoning_gym("no tags " + item["answer"], ex.ground_truth)["acc"] is False


def test_reward_runs_in_the_pool():
  _, heldout = rg_data.examples(("chain_sum",), 4, 4, seed=1)
  fn = rewards.make_reward("dapo_jax.rewards:reasoning_gym", workers=1, timeout_s=30.0)
  try:
    items = [json.loads(ex.ground_truth) for ex in heldout]
    out = fn([f"<answer>{it['answer']}</answer>" for it in items], [ex.ground_truth for ex in heldout])
  finally:
    fn.close()
  assert [o["acc"] for o in out] == [True] * 4


def test_unknown_task_names_the_field():
  with pytest.raises(prompts.DataError, match=r"data\.rg_tasks: unknown reasoning-gym task 'chain_summ'") as e:
    builders.datasets(_cfg(rg_tasks=("chain_summ",), rg_settings=""))
  assert "\n" not in str(e.value)


def test_worked_examples_open_every_prompt_and_are_never_held_out():
  settings = {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
  train, heldout = rg_data.examples(("chain_sum",), 60, 40, seed=2, settings=settings, fewshot=3,
                                    template=common.RG_INSTRUCTION)
  shots = heldout[0].messages[:-1]
  assert len(shots) == 6 and all(ex.messages[:-1] == shots for ex in train + heldout)
  # The shots are reasoning-gym's own items of their seed (less any held-out question), answered with
  # the item's expression worked out, then its answer in tags.
  held_questions = {json.loads(ex.ground_truth)["question"] for ex in heldout}
  drawn = rg.create_dataset("chain_sum", size=20, seed=2 + rg_data.SHOT_SEED_OFFSET, **settings["chain_sum"])
  ref = [it for it in drawn if it["question"] not in held_questions][:3]
  assert [m["content"] for m in shots[0::2]] == [common.RG_INSTRUCTION.format(question=it["question"]) for it in ref]
  assert [m["content"] for m in shots[1::2]] == [f"{it['metadata']['expression']} = {it['answer']}\n"
                                                 f"<answer>{it['answer']}</answer>" for it in ref]
  assert not {m["content"] for m in shots[0::2]} & {ex.messages[-1]["content"] for ex in heldout}
  # What the model is shown is what the verifier accepts.
  for it, m in zip(ref, shots[1::2]):
    assert rewards.reasoning_gym(m["content"], json.dumps(it))["acc"] is True


def test_fewshot_reaches_the_data_through_the_config():
  train, heldout = builders.datasets(_cfg(fewshot=2))
  assert len(heldout[0].messages) == 5 and heldout[0].messages[:4] == train[0].messages[:4]


def test_a_typed_question_gets_the_training_prompts_worked_examples():
  cfg = _cfg(fewshot=2, prompt_template=common.RG_INSTRUCTION)
  _, heldout = builders.datasets(cfg)
  typed = builders.user_prompt(cfg, "What is 2 + 2?")
  assert typed.messages[:-1] == heldout[0].messages[:-1] and len(typed.messages) == 5
  assert typed.messages[-1]["content"] == common.RG_INSTRUCTION.format(question="What is 2 + 2?")
