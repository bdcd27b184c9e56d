"""Datasets: the real AIME-2024 parquet, schema errors, the arithmetic task, the iterator."""
import json
import os

import pytest

from dapo_jax import data, rewards

AIME = os.path.join(os.path.dirname(__file__), "data", "aime-2024.parquet")  # 30 problems x 32, 30 KB


def test_aime_parquet_loads_with_prompts_and_answers():
  examples = data.load_file(AIME)
  assert len(examples) == 960
  problems = {ex.messages[0]["content"] for ex in examples}
  assert len(problems) == 30  # 30 problems x 32 copies
  assert len({ex.ground_truth for ex in examples}) == 29
  first = examples[0]
  assert first.messages[0]["role"] == "user"
  assert first.messages[0]["content"].startswith("Solve the following math problem step by step.")
  assert "|z|=4" in first.messages[0]["content"] and first.ground_truth == "540"
  # The prompts carry the DAPO instruction verbatim.
  raw = "Find the largest possible real part"
  assert first.messages[0]["content"] == data.DAPO_INSTRUCTION.format(problem=first.messages[0]["content"].split(
      "\n\n")[1])
  assert raw in first.messages[0]["content"]
  assert rewards.math_dapo("...\nAnswer: 540", first.ground_truth)["acc"]


def write_jsonl(path, rows):
  with open(path, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")


def row(gt="3", content="1+2?"):
  return {"data_source": "math_dapo", "prompt": [{"role": "user", "content": content}], "ability": "MATH",
          "reward_model": {"ground_truth": gt, "style": "rule"}, "extra_info": {"index": 0}}


def test_missing_answer_fails_naming_row_or_is_skipped(tmp_path):
  path = str(tmp_path / "d.jsonl")
  write_jsonl(path, [row(), row(gt=None), row(gt="5")])
  with pytest.raises(data.DataError, match=r"d\.jsonl: row 1: no ground truth"):
    data.load_file(path)
  assert [ex.ground_truth for ex in data.load_file(path, missing_answer="skip")] == ["3", "5"]


def test_bad_files(tmp_path):
  with pytest.raises(data.DataError, match="does not exist"):
    data.load_file(str(tmp_path / "nope.parquet"))
  bad = tmp_path / "bad.parquet"
  bad.write_bytes(b"not parquet")
  with pytest.raises(data.DataError, match=r"bad\.parquet.*cannot be read"):
    data.load_file(str(bad))
  path = str(tmp_path / "schema.jsonl")
  write_jsonl(path, [row(), {"question": "x", "reward_model": {"ground_truth": "1"}}])
  with pytest.raises(data.DataError, match=r"schema\.jsonl: row 1: field 'prompt'"):
    data.load_file(path)
  (tmp_path / "broken.jsonl").write_text('{"prompt": [\n')
  with pytest.raises(data.DataError, match=r"broken\.jsonl: row 0: not valid JSON"):
    data.load_file(str(tmp_path / "broken.jsonl"))


def test_prompt_template_applied(tmp_path):
  path = str(tmp_path / "d.jsonl")
  write_jsonl(path, [row(content="What is 2+2?")])
  ex = data.load_file(path, prompt_template=data.DAPO_INSTRUCTION)[0]
  assert ex.messages[0]["content"].startswith("Solve the following") and "What is 2+2?" in ex.messages[0]["content"]


def test_arith_is_deterministic_and_splits_are_disjoint():
  a = data.arith_examples(300, seed=1)
  b = data.arith_examples(300, seed=1)
  assert a == b
  held = data.arith_examples(100, split="heldout", seed=1)
  train_problems = {ex.messages[0]["content"] for ex in data.arith_examples(3000, seed=1)}
  held_problems = {ex.messages[0]["content"] for ex in held}
  assert len(held_problems) == 100 and not train_problems & held_problems
  for ex in a[:50]:
    expr = ex.messages[0]["content"].split("What is ")[1].split("?")[0]
    x, y = expr.split("+")
    assert int(ex.ground_truth) == int(x) + int(y)


def test_iterator_resumes_and_shards():
  examples = data.arith_examples(10, seed=0)
  it = data.PromptIterator(examples, seed=3)
  first = [it.next_batch(4) for _ in range(2)]
  state = it.state()
  rest = [it.next_batch(4) for _ in range(3)]   # crosses an epoch boundary
  it2 = data.PromptIterator(examples, seed=3)
  it2.restore(state)
  assert [it2.next_batch(4) for _ in range(3)] == rest
  # Two hosts each take their half of the same global batch.
  hosts = [data.PromptIterator(examples, seed=3, process_index=i, process_count=2) for i in range(2)]
  whole = data.PromptIterator(examples, seed=3).next_batch(4)
  assert hosts[0].next_batch(4) + hosts[1].next_batch(4) == whole
  assert first[0] != first[1]
  epoch0 = [ex.index for ex in first[0] + first[1] + rest[0][:2]]
  assert sorted(epoch0) == list(range(10))   # every example once per epoch
