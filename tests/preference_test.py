"""Preference pairs: TRL's schema, the arithmetic pair generator, tokenised pair batches."""
import json
import subprocess
import sys

import numpy as np
import pytest

from dapo_jax import rewards
from dapo_jax.data import preference
from dapo_jax.data import prompts as data
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.data.prompts import DataError

USER = [{"role": "user", "content": "What is 2+3?"}]


def write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_standard_conversational_and_implicit_prompt_rows(tmp_path):
  rows = [
      {"prompt": "What is 2+3?", "chosen": "Answer: 5", "rejected": "Answer: 6"},
      {"prompt": USER, "chosen": [{"role": "assistant", "content": "Answer: 5"}],
       "rejected": [{"role": "assistant", "content": "Answer: 6"}], "ground_truth": 5, "error": "digit"},
      {"chosen": USER + [{"role": "assistant", "content": "Answer: 5"}],
       "rejected": USER + [{"role": "assistant", "content": "Answer: 6"}]},
  ]
  pairs = preference.load_pairs(write_jsonl(tmp_path / "p.jsonl", rows))
  for p in pairs:
    assert p.prompt == tuple(USER) and (p.chosen, p.rejected) == ("Answer: 5", "Answer: 6")
  assert [p.index for p in pairs] == [0, 1, 2] and pairs[1].ground_truth == "5" and pairs[0].ground_truth is None
  assert (pairs[1].error, pairs[0].error) == ("digit", None)
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.Table.from_pylist(rows[:1]), str(tmp_path / "p.parquet"))
  assert preference.load_pairs(str(tmp_path / "p.parquet"))[0] == pairs[0]


@pytest.mark.parametrize("row, needle", [
    ({"prompt": "q", "rejected": "b"}, "row 1: no field 'chosen'"),
    ({"prompt": "q", "chosen": "a"}, "row 1: no field 'rejected'"),
    ({"prompt": "q", "chosen": "a", "rejected": ""}, "row 1: no field 'rejected'"),
    ({"prompt": "q", "chosen": 3, "rejected": "b"}, "row 1: field 'chosen' must be"),
    ({"chosen": "a", "rejected": "b"}, "row 1: no field 'prompt'"),
    ({"prompt": 5, "chosen": "a", "rejected": "b"}, "row 1: field 'prompt' must be"),
    ({"prompt": "q", "chosen": [{"role": "assistant", "content": "a"}] * 2, "rejected": "b"},
     "row 1: field 'chosen' has 2 turns"),
])
def test_bad_rows_name_file_and_row(tmp_path, row, needle):
  path = write_jsonl(tmp_path / "prefs.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}, row])
  with pytest.raises(DataError, match="prefs.jsonl: " + needle):
    preference.load_pairs(path)


def _steps(text):
  """(x, y, carry, written sum) of every step of a worked answer, and its final answer."""
  body, answer = text.split(". Answer: ")
  out = []
  for step in body.split(", "):
    terms, s = step.split("=")
    t = [int(v) for v in terms.split("+")]
    out.append((t[0], t[1], t[2] if len(t) > 2 else 0, int(s)))
  return out, answer


def test_arith_pairs_chosen_right_rejected_wrong():
  rows = preference.arith_pair_rows(350, split="train", seed=3, digits=3)
  assert {r["error"] for r in rows} == set(preference.ERROR_KINDS)
  for r in rows:
    chosen, rejected = r["chosen"][0]["content"], r["rejected"][0]["content"]
    assert rewards.math_dapo(chosen, r["ground_truth"])["acc"]
    assert not rewards.math_dapo(rejected, r["ground_truth"])["acc"]
    a, b = (int(v) for v in r["prompt"][-1]["content"].split("What is ")[1].split("?")[0].split("+"))
    if r["error"] == "digit":  # Same steps, different final answer of the same length.
      assert chosen.rsplit("Answer:", 1)[0] == rejected.rsplit("Answer:", 1)[0]
      assert len(rewards.math_dapo(rejected, "0")["pred"]) == len(r["ground_truth"])
    if r["error"] == "steps":   # the right steps with one left out or written twice; the answer follows them
      steps, answer = _steps(rejected)
      right_steps, _ = _steps(chosen)
      assert any(steps in (right_steps[:i] + right_steps[i + 1:], right_steps[:i + 1] + right_steps[i:])
                 for i in range(len(right_steps)))
      assert int(answer) == int(str(steps[-1][3]) + "".join(str(s % 10) for *_, s in reversed(steps[:-1])))
    if r["error"] == "truncated":
      assert chosen.startswith(rejected) and len(rejected) < len(chosen)
    if r["error"] in ("sum", "operand", "extra_carry"):
      # Checked column by column: exactly one step is wrong (its digits, its carry or its sum),
      # and every later carry and the answer follow what the steps wrote.
      steps, answer = _steps(rejected)
      right_steps, _ = _steps(chosen)
      assert len(steps) == len(right_steps)
      da, db = str(a)[::-1], str(b)[::-1]
      faults, carry = [], 0
      for i, (x, y, c, s) in enumerate(steps):
        fault = set()
        if (x, y) != (int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0):
          fault.add("operand")
        if c != carry:
          fault.add("extra_carry" if c == carry + 1 else "carry")
        if s != x + y + c:
          fault.add("sum")
          assert abs(s - (x + y + c)) <= 2
        faults.append(fault)
        carry = s // 10
      assert sorted(map(sorted, faults)) == sorted([[r["error"]]] + [[]] * (len(steps) - 1)), (r["prompt"], rejected)
      assert int(answer) == int(str(steps[-1][3]) + "".join(str(s % 10) for *_, s in reversed(steps[:-1])))
  # Hand-worked examples of every kind.
  ex = data.Example(messages=({"role": "user", "content": "What is 97+56? End"},), ground_truth="153")
  text, kind = preference.wrong_solution(ex, "carry", np.random.default_rng(0))
  assert (text, kind) == ("7+6=13, 9+5=14. Answer: 143", "carry")   # the carry forgotten: 143
  ex = data.Example(messages=({"role": "user", "content": "What is 52+82? End"},), ground_truth="134")
  assert preference.wrong_solution(ex, "carry", np.random.default_rng(0))[1] == "digit"  # no carry to forget
  # 23+96 = 119. A wrong units sum 3+6=10 carries into the tens: 2+9+1=12, answer 120, not 119.
  cols = [(3, 6), (2, 9)]
  assert preference.worked_sum(cols) == (["3+6=9", "2+9=11"], "119")
  assert preference.worked_sum(cols, sum_delta={0: 1}) == (["3+6=10", "2+9+1=12"], "120")
  # A carry from nowhere into the units: 3+6+1=10, then 2+9+1=12.
  assert preference.worked_sum(cols, extra_carry=0) == (["3+6+1=10", "2+9+1=12"], "120")
  assert preference.worked_sum(cols, extra_carry=1) == (["3+6=9", "2+9+1=12"], "129")
  for kind, seed in [("sum", 0), ("operand", 1), ("extra_carry", 2), ("steps", 3), ("truncated", 4)]:
    ex = data.Example(messages=({"role": "user", "content": "What is 23+96? End"},), ground_truth="119")
    text, got = preference.wrong_solution(ex, kind, np.random.default_rng(seed))
    assert got == kind and not rewards.math_dapo(text, "119")["acc"]
    if kind == "steps":   # one step written twice or left out; the answer is what the steps give
      assert text in ("3+6=9, 3+6=9, 2+9=11. Answer: 1199", "3+6=9, 2+9=11, 2+9=11. Answer: 1111",
                      "2+9=11. Answer: 11", "3+6=9. Answer: 9"), text
  # Held-out pairs never share a problem with training pairs.
  held = preference.arith_pair_rows(50, split="heldout", seed=3, digits=3)
  assert not {r["prompt"][-1]["content"] for r in held} & {r["prompt"][-1]["content"] for r in rows}


def test_prepare_cli_writes_a_file_read_back_like_any_dataset(tmp_path):
  out = tmp_path / "pairs" / "train.jsonl"
  res = subprocess.run([sys.executable, "-m", "launch.prepare", "arith_pairs", f"--out={out}", "--num=20"],
                       capture_output=True, text=True, timeout=120)
  assert res.returncode == 0, res.stderr
  pairs = preference.load_pairs(str(out))
  assert len(pairs) == 20 and all(p.ground_truth and p.chosen != p.rejected for p in pairs)


def test_pair_batch_layout(tiny_tokenizer_dir):
  tok = tokenizer_lib.load(tiny_tokenizer_dir)
  pairs = [preference.PreferencePair(tuple(USER), "Answer: 5", "Answer: 6 because 2+3 is 6"),
           preference.PreferencePair(({"role": "user", "content": "Hi there, what is 10+10?"},), "20", "21")]
  P, C = 40, 24
  b = preference.pair_batch(tok, pairs, P, C)
  assert b.tokens_BT.shape == (4, P + C) and b.num_pairs == 2
  for row, pair, text in [(0, 0, "Answer: 5"), (2, 0, "Answer: 6 because 2+3 is 6"), (1, 1, "20"), (3, 1, "21")]:
    prompt = tokenizer_lib.render(tok, pairs[pair].prompt)
    assert tok.decode(b.tokens_BT[row, :P][b.mask_BT[row, :P]]) == prompt    # left-padded prompt
    assert b.mask_BT[row, P - 1] and not b.mask_BT[row, 0]
    resp = b.tokens_BT[row, P:][b.response_mask_BC[row]]
    assert tok.decode(resp) == text + tok.eos_token and resp[-1] == tok.eos_token_id   # right-padded, EOS
    assert b.response_mask_BC[row, 0] and np.array_equal(b.mask_BT[row, P:], b.response_mask_BC[row])
  # Chosen and rejected rows share the prompt tokens.
  np.testing.assert_array_equal(b.tokens_BT[0, :P], b.tokens_BT[2, :P])
  short = preference.pair_batch(tok, pairs, P, 3)
  assert short.response_mask_BC.all() and tok.eos_token_id not in short.tokens_BT[0, P:]


def test_policy_pairs_pair_each_wrong_sample_with_a_right_one():
  exs = data.arith_examples(3, split="train", seed=0)
  gts = [ex.ground_truth for ex in exs]
  right = [f"Answer: {g}" for g in gts]
  wrong = [f"Answer: {int(g) + 1}" for g in gts]
  responses_QK = [[wrong[0], right[0], wrong[0], "Answer: 0"],   # 2 distinct wrong, 1 right
                  [wrong[1], wrong[1], wrong[1], wrong[1]],      # none right: the reference is chosen
                  [right[2], right[2], right[2], right[2]]]      # none wrong: no pair
  correct_QK = [[rewards.math_dapo(t, g)["acc"] for t in ts] for ts, g in zip(responses_QK, gts)]
  assert correct_QK[0] == [False, True, False, False]
  reference = [data.arith_solution(ex) for ex in exs]
  rows = preference.policy_pair_rows(exs, responses_QK, correct_QK, pairs_per_prompt=2, reference=reference)
  got = [(r["prompt"][-1]["content"], r["chosen"][0]["content"], r["rejected"][0]["content"]) for r in rows]
  assert got == [(exs[0].messages[-1]["content"], right[0], wrong[0]),
                 (exs[0].messages[-1]["content"], right[0], "Answer: 0"),
                 (exs[1].messages[-1]["content"], reference[1], wrong[1])]
  assert all(r["error"] == "policy" and r["ground_truth"] == gts[i] for r, i in zip(rows, (0, 0, 1)))
  # Without a reference, a prompt with no right sample gives no pair; at most pairs_per_prompt per prompt.
  rows = preference.policy_pair_rows(exs, responses_QK, correct_QK, pairs_per_prompt=1)
  assert [r["rejected"][0]["content"] for r in rows] == [wrong[0]]
  # The rows read back as TRL preference pairs.
  pairs = [preference.parse_row(r, "policy.jsonl", i) for i, r in enumerate(rows)]
  assert pairs[0].chosen == right[0] and pairs[0].error == "policy"
  # chosen="reference": the worked answer is every pair's chosen response, the rejected ones as before.
  rows = preference.policy_pair_rows(exs, responses_QK, correct_QK, pairs_per_prompt=2, reference=reference,
                                     chosen="reference")
  assert [(r["chosen"][0]["content"], r["rejected"][0]["content"]) for r in rows] == [
      (reference[0], wrong[0]), (reference[0], "Answer: 0"), (reference[1], wrong[1])]


@pytest.mark.slow  # A tiny model samples 4 x 4 answers (engine compile): ~20 s on 2 cores.
def test_prepare_policy_pairs_cli(tmp_path, tiny_tokenizer_dir):
  """`launch.prepare policy_pairs`: the model's own answers, rule-checked: every chosen answer is
  right, every rejected one wrong."""
  import jax

  from dapo_jax import testing
  from dapo_jax.hf import convert as hf
  from dapo_jax.model import transformer as model
  tok = tokenizer_lib.load(tiny_tokenizer_dir)
  cfg = testing.tiny_model_config(((len(tok) + 63) // 64) * 64)
  model_dir = str(tmp_path / "policy")
  hf.save(model_dir, cfg, jax.device_get(model.init_params(cfg, jax.random.key(0))), tokenizer=tok)
  out = tmp_path / "policy_pairs.jsonl"
  res = subprocess.run([sys.executable, "-m", "launch.prepare", "policy_pairs", f"--model_dir={model_dir}",
                        f"--out={out}", "--num=4", "--k=4", "--max_new_tokens=8"],
                       capture_output=True, text=True, timeout=300)
  assert res.returncode == 0, res.stderr
  pairs = preference.load_pairs(str(out))
  assert pairs and len(pairs) <= 8 and "4 problems x 4 samples" in res.stdout
  for p in pairs:
    assert rewards.math_dapo(p.chosen, p.ground_truth)["acc"]
    assert not rewards.math_dapo(p.rejected, p.ground_truth)["acc"]
    assert p.error == "policy" and p.rejected != p.chosen
