"""The SFT warm start's packing and its greedy-accuracy probe."""
import jax
import numpy as np
import pytest

from dapo_jax import testing
from dapo_jax.data import prompts as data
from dapo_jax.pipelines import sft
from dapo_jax.rollout import sampling

CFG = testing.tiny_model_config(vocab_size=50)
PARAMS = testing.sharp_params(CFG, seed=3)


def test_pack_joins_with_eos_and_drops_the_tail():
  chunks = sft.pack([[1, 2, 3], [4], [5, 6]], seq_len=3, eos_id=0)
  # Stream: 1 2 3 0 4 0 5 6 0 -> three full chunks, nothing left over.
  np.testing.assert_array_equal(chunks, [[1, 2, 3], [0, 4, 0], [5, 6, 0]])
  np.testing.assert_array_equal(sft.pack([[1, 2, 3, 4]], seq_len=3, eos_id=0), [[1, 2, 3]])


def test_exact_match_counts_the_rows_greedy_decoding_reproduces():
  rng = np.random.default_rng(0)
  B, P, C = 6, 7, 9
  prompt = rng.integers(5, CFG.vocab_size, size=(B, P)).astype(np.int32)
  pmask = np.ones((B, P), bool)
  for b, pad in enumerate([0, 2, 4, 0, 1, 3]):  # Left padding of different amounts.
    pmask[b, :pad] = False
  greedy = np.asarray(sampling.generate(CFG, sampling.SamplerConfig(max_new_tokens=C, temperature=0.0), PARAMS,
                                        prompt, pmask, jax.random.key(0)).tokens_BC)
  tokens = np.concatenate([prompt, greedy], 1)
  mask = np.concatenate([pmask, np.ones((B, C), bool)], 1)
  completion = np.concatenate([np.zeros((B, P), bool), np.ones((B, C), bool)], 1)
  assert float(sft.exact_match(CFG, PARAMS, tokens, mask, completion)) == 1.0
  # One wrong token anywhere in the completion loses that row; two rows of six lost.
  tokens[1, P + 4] = (tokens[1, P + 4] + 1) % CFG.vocab_size
  tokens[4, -1] = (tokens[4, -1] + 1) % CFG.vocab_size
  assert float(sft.exact_match(CFG, PARAMS, tokens, mask, completion)) == pytest.approx(4 / 6)


def test_probe_rows_are_prompt_then_solution_then_eos(tmp_path):
  tok = testing.build_tokenizer(str(tmp_path / "tok"))
  examples = data.arith_examples(5, seed=1)
  tokens, mask, completion = sft.probe_batch(tok, examples, chat_template=True)
  for b, ex in enumerate(examples):
    row = tokens[b][mask[b]].tolist()
    answer = tokens[b][completion[b]].tolist()
    assert answer[-1] == tok.eos_token_id and row[-len(answer):] == answer
    assert tok.decode(answer[:-1]) == data.arith_solution(ex)
    assert (completion[b] <= mask[b]).all()
  assert mask[:, -1].all()  # Every row ends at the last column (left padding).


@pytest.mark.parametrize("question,solution", [
    ("What is 47+38?", "7+8=15, 4+3+1=8. Answer: 85"),
    ("What is 95+7?", "5+7=12, 9+0+1=10. Answer: 102"),
    ("What is 10+20?", "0+0=0, 1+2=3. Answer: 30"),
])
def test_arith_solution_by_hand(question, solution):
  gt = str(sum(int(x) for x in question[8:-1].split("+")))
  ex = data.Example(messages=({"role": "user", "content": question},), ground_truth=gt)
  assert data.arith_solution(ex) == solution


@pytest.mark.parametrize("question,solution", [
    ("What is 47+38?", "ones 7+8=15 write 5 carry 1; tens 4+3+1=8 write 8. Answer: 85"),
    ("What is 695+7?", "ones 5+7=12 write 2 carry 1; tens 9+0+1=10 write 0 carry 1; hundreds 6+0+1=7 write 7. "
                       "Answer: 702"),
])
def test_arith_column_solution_by_hand(question, solution):
  gt = str(sum(int(x) for x in question[8:-1].split("+")))
  ex = data.Example(messages=({"role": "user", "content": question},), ground_truth=gt)
  assert data.arith_solution(ex, "column") == solution


def test_mixed_style_writes_each_problem_in_one_form_half_each():
  exs = data.arith_examples(2000, seed=1, digits=3)
  styles = [data.arith_solution(ex, "mixed") for ex in exs]
  assert all(m in (data.arith_solution(ex, "steps"), data.arith_solution(ex, "column")) for m, ex in zip(styles, exs))
  assert styles == [data.arith_solution(ex, "mixed") for ex in exs]  # by the problem, not by the call
  column = np.mean([m.startswith("ones ") for m in styles])
  assert 0.45 < column < 0.55, column


def test_arith_solution_carries_add_up_to_the_integer_sum():
  """Each step adds one digit of each operand (right to left) and the previous step's carry; the
  digits the steps write, with the last carry, are the integer sum."""
  for ex in data.arith_examples(300, seed=5) + data.arith_examples(100, seed=6, digits=3):
    a, b = ex.messages[-1]["content"].split("What is ")[1].split("?")[0].split("+")
    steps, answer = data.arith_solution(ex).split(". Answer: ")
    assert int(answer) == int(a) + int(b) == int(ex.ground_truth)
    carry, written = 0, []
    for i, step in enumerate(steps.split(", ")):
      lhs, s = step.split("=")
      terms = [int(t) for t in lhs.split("+")]
      x = int(a[::-1][i]) if i < len(a) else 0
      y = int(b[::-1][i]) if i < len(b) else 0
      assert terms == ([x, y, carry] if carry else [x, y]), (ex, step)
      assert int(s) == x + y + carry
      carry, written = int(s) // 10, [int(s) % 10] + written
    assert len(steps.split(", ")) == max(len(a), len(b))
    assert int("".join(map(str, ([carry] if carry else []) + written))) == int(a) + int(b)
