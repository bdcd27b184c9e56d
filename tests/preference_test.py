"""Preference pairs: TRL's schema, the arithmetic pair generator, tokenised pair batches."""
import json
import subprocess
import sys

import numpy as np
import pytest

from dapo_jax import data, preference, rewards
from dapo_jax import tokenizer as tokenizer_lib
from dapo_jax.data import DataError

USER = [{"role": "user", "content": "What is 2+3?"}]


def write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_standard_conversational_and_implicit_prompt_rows(tmp_path):
  rows = [
      {"prompt": "What is 2+3?", "chosen": "Answer: 5", "rejected": "Answer: 6"},
      {"prompt": USER, "chosen": [{"role": "assistant", "content": "Answer: 5"}],
       "rejected": [{"role": "assistant", "content": "Answer: 6"}], "ground_truth": 5},
      {"chosen": USER + [{"role": "assistant", "content": "Answer: 5"}],
       "rejected": USER + [{"role": "assistant", "content": "Answer: 6"}]},
  ]
  pairs = preference.load_pairs(write_jsonl(tmp_path / "p.jsonl", rows))
  for p in pairs:
    assert p.prompt == tuple(USER) and (p.chosen, p.rejected) == ("Answer: 5", "Answer: 6")
  assert [p.index for p in pairs] == [0, 1, 2] and pairs[1].ground_truth == "5" and pairs[0].ground_truth is None
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


def test_arith_pairs_chosen_right_rejected_wrong():
  rows = preference.arith_pair_rows(200, split="train", seed=3, digits=3)
  kinds = {r["error"] for r in rows}
  assert kinds == {"carry", "digit"}
  for r in rows:
    chosen, rejected = r["chosen"][0]["content"], r["rejected"][0]["content"]
    assert rewards.math_dapo(chosen, r["ground_truth"])["acc"]
    assert not rewards.math_dapo(rejected, r["ground_truth"])["acc"]
    if r["error"] == "digit":  # Same steps, different final answer of the same length.
      assert chosen.rsplit("Answer:", 1)[0] == rejected.rsplit("Answer:", 1)[0]
      assert len(rewards.math_dapo(rejected, "0")["pred"]) == len(r["ground_truth"])
  # The carry error is the hand-worked one: 97+56 with the carry forgotten is 143.
  ex = data.Example(messages=({"role": "user", "content": "What is 97+56? End"},), ground_truth="153")
  text, kind = preference.wrong_solution(ex, "carry", np.random.default_rng(0))
  assert (text, kind) == ("7+6=13, 9+5=14. Answer: 143", "carry")
  ex = data.Example(messages=({"role": "user", "content": "What is 52+82? End"},), ground_truth="134")
  assert preference.wrong_solution(ex, "carry", np.random.default_rng(0))[1] == "digit"  # no carry to forget
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
