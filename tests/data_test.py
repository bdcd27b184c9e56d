"""Datasets: the real AIME-2024 parquet, schema errors, the arithmetic task, the iterator."""
import json
import os

import pytest

from dapo_jax import rewards
from dapo_jax.data import prompts as data

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


# --- every file format and option, and the iterator against a naive reference -----------------

def write_parquet(path, rows):
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.Table.from_pylist(rows), path)


ROWS = [row(gt="3", content="1+2?"),
        dict(row(gt="7", content="3+4?"), data_source="other"),
        row(gt=None, content="no answer"),
        row(gt="  ", content="blank answer"),
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "5+5?"}],
         "reward_model": {"ground_truth": "10"}}]


@pytest.mark.parametrize("ext", ["parquet", "jsonl", "json"])
def test_every_format_reads_the_same_examples(tmp_path, ext):
  path = str(tmp_path / f"d.{ext}")
  (write_parquet if ext == "parquet" else write_jsonl)(path, ROWS)
  with pytest.raises(data.DataError, match=rf"d\.{ext}: row 2: no ground truth"):
    data.load_file(path)
  got = data.load_file(path, missing_answer="skip")
  assert [(ex.index, ex.ground_truth, ex.data_source) for ex in got] == [
      (0, "3", "math_dapo"), (1, "7", "other"), (4, "10", "math_dapo")]  # Index: the row in the file.
  assert got[0].messages == ({"role": "user", "content": "1+2?"},)
  assert got[2].messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "5+5?"})
  # The template wraps the last (user) message only.
  t = data.load_file(path, missing_answer="skip", prompt_template="Q: {problem} A:")
  assert t[2].messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q: 5+5? A:"})
  assert [ex.messages[-1]["content"] for ex in t[:2]] == ["Q: 1+2? A:", "Q: 3+4? A:"]


def test_plain_prompt_and_top_level_answer(tmp_path):
  path = str(tmp_path / "plain.jsonl")
  (tmp_path / "plain.jsonl").write_text('{"prompt": "2+2?", "ground_truth": "4"}\n\n{"prompt": "1+1?", '
                                        '"ground_truth": 2}\n')
  got = data.load_file(path)
  assert [(ex.messages, ex.ground_truth, ex.index) for ex in got] == [
      (({"role": "user", "content": "2+2?"},), "4", 0), (({"role": "user", "content": "1+1?"},), "2", 1)]


def test_unknown_format_and_empty_file(tmp_path):
  (tmp_path / "d.csv").write_text("prompt,answer\n")
  with pytest.raises(data.DataError, match=r"d\.csv.*unknown format"):
    data.load_file(str(tmp_path / "d.csv"))
  (tmp_path / "e.jsonl").write_text("\n")
  with pytest.raises(data.DataError, match=r"e\.jsonl.*has no rows"):
    data.load_file(str(tmp_path / "e.jsonl"))
  with pytest.raises(data.DataError, match="no examples"):
    data.PromptIterator([])


def naive_stream(examples, seed, shuffle=True):
  """The global prompt order, epoch after epoch: a fresh permutation per epoch from (seed, epoch)."""
  import numpy as np
  epoch = 0
  while True:
    order = np.random.default_rng([seed, epoch]).permutation(len(examples)) if shuffle else range(len(examples))
    yield from (examples[i] for i in order)
    epoch += 1


@pytest.mark.parametrize("hosts", [1, 2, 3])
def test_iterator_against_naive_order_with_restore_and_shards(hosts):
  examples = data.arith_examples(7, seed=0)  # 7 prompts, batches of 6: every epoch boundary differs.
  stream = naive_stream(examples, seed=4)
  want = [[next(stream) for _ in range(6)] for _ in range(6)]
  its = [data.PromptIterator(examples, seed=4, process_index=i, process_count=hosts) for i in range(hosts)]
  got = []
  for step in range(6):
    if step == 3:  # Restore every host from its saved state into a fresh iterator (a resumed run).
      states = [it.state() for it in its]
      its = [data.PromptIterator(examples, seed=4, process_index=i, process_count=hosts) for i in range(hosts)]
      for it, st in zip(its, states):
        it.restore(st)
    shards = [it.next_batch(6) for it in its]
    assert all(len(s) == 6 // hosts for s in shards)
    got.append(sum(shards, []))
  assert got == want
  assert its[0].state() == {"epoch": 36 // 7, "position": 36 % 7}


def test_iterator_without_shuffle_and_bad_batch():
  examples = data.arith_examples(5, seed=0)
  it = data.PromptIterator(examples, shuffle=False)
  assert [ex.index for ex in it.next_batch(4) + it.next_batch(4)] == [e.index for e in examples + examples][:8]
  with pytest.raises(ValueError, match="does not split over 2 hosts"):
    data.PromptIterator(examples, process_count=2).next_batch(3)


def test_a_message_without_string_content_is_refused_naming_the_row(tmp_path):
  """Found by the fuzz test: {"content": null} passed as a message."""
  path = tmp_path / "d.jsonl"
  path.write_text(json.dumps({"data_source": "x", "prompt": [{"role": "user", "content": None}],
                              "reward_model": {"ground_truth": "1"}}) + "\n")
  with pytest.raises(data.DataError, match=r"d.jsonl: row 0: field 'prompt\[0\]' needs a string 'content'"):
    data.load_file(str(path))
