"""Preference pairs: TRL's schema, pairs made from the arithmetic task, tokenised pair batches.

Row schema (jsonl or parquet; TRL's preference format, standard or conversational):
  {"prompt": str | messages, "chosen": str | messages, "rejected": str | messages}
  {"chosen": messages, "rejected": messages}   # implicit prompt: the turns both share
A response given as messages is one assistant turn. Two optional fields are kept: `ground_truth`
for rule-checked evaluation, and `error` (the kind of mistake in the rejected response) for
held-out accuracy per kind; others are ignored. Host-side NumPy; no jax.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import numpy as np

from dapo_jax.data import prompts as data_lib
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.data.prompts import DataError


@dataclasses.dataclass(frozen=True)
class PreferencePair:
  prompt: tuple[dict, ...]       # the chat, ending with the user turn
  chosen: str                    # the preferred response
  rejected: str                  # the other one
  index: int = 0                 # row number in its file
  ground_truth: str | None = None
  error: str | None = None       # the kind of mistake in `rejected`, when the row names it


# --- rows ---------------------------------------------------------------------------------------

def _is_messages(v) -> bool:
  return (isinstance(v, (list, tuple)) and bool(v)
          and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in v))


def _turns(v) -> tuple[dict, ...]:
  return tuple({"role": m.get("role") or "user", "content": m["content"]} for m in v)


def _response(turns: tuple[dict, ...], field: str, path: str, i: int) -> str:
  if len(turns) != 1:
    raise DataError(f"{path}: row {i}: field {field!r} has {len(turns)} turns after the prompt; "
                    "a response must be one assistant turn")
  return turns[0]["content"]


def parse_row(row: dict, path: str, i: int) -> PreferencePair:
  """One row in TRL's preference schema -> PreferencePair; a missing or malformed field names the row."""
  if not isinstance(row, dict):
    raise DataError(f"{path}: row {i}: expected an object, got {type(row).__name__}")
  for field in ("chosen", "rejected"):
    v = row.get(field)
    if v is None or (isinstance(v, str) and not v.strip()):
      raise DataError(f"{path}: row {i}: no field {field!r} (preference rows need 'chosen' and 'rejected')")
    if not isinstance(v, str) and not _is_messages(v):
      raise DataError(f"{path}: row {i}: field {field!r} must be a string or a list of {{'role', 'content'}} "
                      f"messages, got {type(v).__name__}")
  chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
  if prompt is None:
    # Implicit prompt: both conversations start with the same turns; the prompt is what they share.
    if isinstance(chosen, str) or isinstance(rejected, str):
      raise DataError(f"{path}: row {i}: no field 'prompt' (needed when 'chosen' and 'rejected' are strings)")
    c, r = _turns(chosen), _turns(rejected)
    n = 0
    while n < min(len(c), len(r)) - 1 and c[n] == r[n]:
      n += 1
    if n == 0:
      raise DataError(f"{path}: row {i}: no field 'prompt', and 'chosen' and 'rejected' share no prompt turns")
    prompt_turns, c, r = c[:n], c[n:], r[n:]
  else:
    if isinstance(prompt, str):
      prompt_turns = ({"role": "user", "content": prompt},)
    elif _is_messages(prompt):
      prompt_turns = _turns(prompt)
    else:
      raise DataError(f"{path}: row {i}: field 'prompt' must be a string or a non-empty list of "
                      f"{{'role', 'content'}} messages, got {type(prompt).__name__}")
    c = ({"content": chosen},) if isinstance(chosen, str) else _turns(chosen)
    r = ({"content": rejected},) if isinstance(rejected, str) else _turns(rejected)
  gt, error = row.get("ground_truth"), row.get("error")
  return PreferencePair(prompt_turns, _response(c, "chosen", path, i), _response(r, "rejected", path, i), i,
                        None if gt is None else str(gt), None if error is None else str(error))


def load_pairs(path: str) -> list[PreferencePair]:
  """Every preference pair of a jsonl/parquet file; a bad row fails naming the file and row."""
  rows = data_lib.read_rows(path)
  if not rows:
    raise DataError(f"dataset file {path!r} has no rows")
  return [parse_row(row, path, i) for i, row in enumerate(rows)]


# --- pairs from the arithmetic task -------------------------------------------------------------

# The mistakes a rejected answer makes. "carry" and "digit" alone leave the arithmetic of the steps
# unchecked: a reward model trained on them alone scores "3+6=10, 2+9+1=13. Answer: 130" (23+96)
# highly, and a policy trained against it learns such answers. The other kinds are the mistakes a
# half-trained model makes (a wrong digit sum, a misread operand, a carry from nowhere, a lost or
# repeated step, an unfinished answer), each with the rest of the answer consistent with it.
ERROR_KINDS = ("carry", "digit", "sum", "operand", "extra_carry", "steps", "truncated")


def _operands(ex: data_lib.Example) -> tuple[str, str] | None:
  expr = ex.messages[-1]["content"].split("What is ")[1].split("?")[0]
  return tuple(expr.split("+")) if "+" in expr else None  # type: ignore[return-value]


def _columns(a: str, b: str) -> list[tuple[int, int]]:
  """The digit pairs of a + b, units first."""
  da, db = a[::-1], b[::-1]
  return [(int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0) for i in range(max(len(da), len(db)))]


def worked_sum(cols: Sequence[tuple[int, int]], sum_delta: dict[int, int] | None = None,
               extra_carry: int | None = None) -> tuple[list[str], str]:
  """Column addition written as `arith_solution` writes it, (steps, answer), with planted mistakes.

  Column i's written sum is off by sum_delta[i]; column `extra_carry` adds a carry of 1 it was not
  given. Later carries and the answer follow the written sums (each column writes its last digit,
  the leftmost its whole sum), so only the planted step is wrong.
  """
  sum_delta = sum_delta or {}
  steps, digits, carry = [], [], 0
  for i, (x, y) in enumerate(cols):
    c = carry + (i == extra_carry)
    s = x + y + c + sum_delta.get(i, 0)
    steps.append(f"{x}+{y}" + (f"+{c}" if c else "") + f"={s}")
    digits.append(str(s) if i == len(cols) - 1 else str(s % 10))
    carry = s // 10
  return steps, str(int("".join(reversed(digits))))


def _planted(cols: list[tuple[int, int]], kind: str, rng: np.random.Generator) -> str | None:
  """A worked answer with one mistake of `kind` ("sum", "operand", "extra_carry", "steps"), or None."""
  i = int(rng.integers(len(cols)))
  if kind == "sum":
    s = int(worked_sum(cols)[0][i].rsplit("=", 1)[1])
    deltas = [d for d in (-2, -1, 1, 2) if 0 <= s + d <= 19]
    steps, answer = worked_sum(cols, sum_delta={i: deltas[int(rng.integers(len(deltas)))]})
  elif kind == "operand":
    x, y = cols[i]
    j = int(rng.integers(2))
    d = (x, y)[j]
    near = [v for v in (d - 1, d + 1) if 0 <= v <= 9]
    wrong = near[int(rng.integers(len(near)))] if rng.random() < 0.5 else \
        int(rng.choice([v for v in range(10) if v != d]))
    cols = list(cols)
    cols[i] = (wrong, y) if j == 0 else (x, wrong)
    steps, answer = worked_sum(cols)
  elif kind == "extra_carry":
    sums = [int(st.rsplit("=", 1)[1]) for st in worked_sum(cols)[0]]
    free = [k for k in range(len(cols)) if k == 0 or sums[k - 1] < 10]   # no carry comes into column k
    steps, answer = worked_sum(cols, extra_carry=free[int(rng.integers(len(free)))])
  elif kind == "steps":
    steps, _ = worked_sum(cols)
    steps = steps[:i] + steps[i + 1:] if len(steps) > 1 and rng.random() < 0.5 else steps[:i + 1] + steps[i:]
    # The answer the written steps give: each step's last digit, the leftmost step's whole sum.
    sums = [st.rsplit("=", 1)[1] for st in steps]
    answer = str(int(sums[-1] + "".join(s[-1] for s in reversed(sums[:-1]))))
  else:
    return None
  return ", ".join(steps) + f". Answer: {answer}"


def wrong_solution(ex: data_lib.Example, kind: str, rng: np.random.Generator,
                   style: str = "steps") -> tuple[str, str]:
  """A plausible wrong worked answer and its error kind.

  "carry": every carry is forgotten (each column writes its last digit, the leftmost its whole sum),
  so steps and answer agree and are both wrong; "digit": the steps are right but one digit of the
  final answer is changed (usually the last); "sum": one step's sum is off by 1 or 2; "operand":
  one step adds a digit that is not the question's; "extra_carry": one step adds a carry that no
  column gave; "steps": a step is left out or written twice; in these four the later steps and
  the answer follow the mistake. "truncated": the right answer cut off before its last character.
  A kind that cannot apply (no carry to forget, a direct answer) gives a digit error, so every
  rejected answer has a wrong final answer.
  """
  if kind not in ERROR_KINDS:
    raise ValueError(f"error kind {kind!r}; expected one of {ERROR_KINDS}")
  operands = _operands(ex)
  right = data_lib.arith_solution(ex, style)
  gt = ex.ground_truth
  if kind == "truncated":
    return right[:int(rng.integers(1, len(right)))], "truncated"
  if operands and style == "steps" and kind != "digit":
    cols = _columns(*operands)
    if kind == "carry":
      if any(x + y >= 10 for x, y in cols[:-1]):
        steps = ", ".join(f"{x}+{y}={x + y}" for x, y in cols)
        answer = str(sum(cols[-1])) + "".join(str((x + y) % 10) for x, y in reversed(cols[:-1]))
        return steps + f". Answer: {int(answer)}", "carry"
    else:
      text = _planted(cols, kind, rng)
      if text is not None and text.rsplit("Answer: ", 1)[1] != gt:
        return text, kind
  pos = len(gt) - 1 if rng.random() < 0.75 else int(rng.integers(len(gt)))
  choices = [d for d in "0123456789" if d != gt[pos] and not (pos == 0 and d == "0" and len(gt) > 1)]
  wrong = gt[:pos] + choices[int(rng.integers(len(choices)))] + gt[pos + 1:]
  return right[: right.rindex("Answer: ")] + f"Answer: {wrong}", "digit"


def arith_pair_rows(n: int, *, split: str = "train", seed: int = 0, digits: int = 2, ops: str = "+",
                    style: str = "steps", kinds: Sequence[str] = ERROR_KINDS) -> list[dict]:
  """`n` preference rows in TRL's conversational schema from `data.arith_examples` (same split rule):
  chosen = the correct worked answer, rejected = a wrong one (error kinds in turn)."""
  rng = np.random.default_rng([seed, 7])
  rows = []
  for j, ex in enumerate(data_lib.arith_examples(n, split=split, seed=seed, digits=digits, ops=ops)):
    rejected, kind = wrong_solution(ex, kinds[j % len(kinds)], rng, style)
    rows.append({"prompt": [dict(m) for m in ex.messages],
                 "chosen": [{"role": "assistant", "content": data_lib.arith_solution(ex, style)}],
                 "rejected": [{"role": "assistant", "content": rejected}],
                 "ground_truth": ex.ground_truth, "error": kind})
  return rows


# --- pairs from a policy's own samples -----------------------------------------------------------

def policy_pair_rows(examples: Sequence[data_lib.Example], responses_QK: Sequence[Sequence[str]],
                     correct_QK: Sequence[Sequence[bool]], *, pairs_per_prompt: int = 2,
                     reference: Sequence[str | None] | None = None, chosen: str = "sample") -> list[dict]:
  """Preference rows from a policy's samples, labelled by a rule check (StackLLaMA's recipe: the
  reward model learns the mistakes the policy it will score actually makes).

  Prompt q's distinct wrong samples are each paired with one of its distinct correct samples (taken
  in turn), up to `pairs_per_prompt` pairs. A prompt with no correct sample takes `reference[q]` (the
  task's worked answer) as its chosen response when given, else gives no pair. With
  chosen="reference" every pair's chosen response is the reference: a right final answer reached
  by wrong steps is never preferred. Rows are in TRL's conversational schema with `error="policy"`.
  """
  if chosen not in ("sample", "reference") or (chosen == "reference" and reference is None):
    raise ValueError(f"chosen={chosen!r}: expected 'sample', or 'reference' with the references given")
  if not (len(examples) == len(responses_QK) == len(correct_QK)):
    raise ValueError(f"{len(examples)} prompts, {len(responses_QK)} response groups, {len(correct_QK)} labels")
  rows = []
  for q, ex in enumerate(examples):
    right = list(dict.fromkeys(t for t, ok in zip(responses_QK[q], correct_QK[q]) if ok))
    wrong = list(dict.fromkeys(t for t, ok in zip(responses_QK[q], correct_QK[q]) if not ok))
    if chosen == "reference":
      right = [reference[q]] if reference[q] is not None else []
    elif not right and reference is not None and reference[q] is not None:
      right = [reference[q]]
    if not right:
      continue
    for j, rejected in enumerate(wrong[:pairs_per_prompt]):
      rows.append({"prompt": [dict(m) for m in ex.messages],
                   "chosen": [{"role": "assistant", "content": right[j % len(right)]}],
                   "rejected": [{"role": "assistant", "content": rejected}],
                   "ground_truth": ex.ground_truth, "error": "policy"})
  return rows


def write_jsonl(rows: Sequence[dict], path: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")


# --- tokenised pair batches ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PairBatch:
  """2N rows laid out like the RL batch, [left-padded prompt | right-padded response]: rows 0..N-1
  are the chosen responses, N..2N-1 the rejected ones, to the same prompts."""
  tokens_BT: np.ndarray        # int32 [2N, P+C]
  mask_BT: np.ndarray          # bool: real prompt tokens and response tokens up to and including EOS
  response_mask_BC: np.ndarray  # bool [2N, C]: response tokens (the log-prob / score positions)

  @property
  def num_pairs(self) -> int:
    return self.tokens_BT.shape[0] // 2


def pair_batch(tok, pairs: Sequence[PreferencePair], prompt_len: int, response_len: int,
               chat_template: bool = True) -> PairBatch:
  """Tokenises pairs as generation sees them: the rendered prompt, then the response and EOS.

  Over-long prompts keep their last `prompt_len` tokens; over-long responses their first
  `response_len` (the EOS is then lost, as for a completion that hit the budget).
  """
  texts = [tokenizer_lib.render(tok, p.prompt, chat_template) for p in pairs]
  prompt_NP, prompt_mask_NP = tokenizer_lib.encode_left_padded(tok, texts, prompt_len)
  responses = [p.chosen for p in pairs] + [p.rejected for p in pairs]
  ids = tok(responses, add_special_tokens=False)["input_ids"]
  resp_BC = np.full((len(ids), response_len), tok.pad_token_id, np.int32)
  resp_mask_BC = np.zeros((len(ids), response_len), bool)
  for b, row in enumerate(ids):
    row = (list(row) + [tok.eos_token_id])[:response_len]
    resp_BC[b, :len(row)], resp_mask_BC[b, :len(row)] = row, True
  tokens_BT = np.concatenate([np.concatenate([prompt_NP, prompt_NP]), resp_BC], axis=1)
  mask_BT = np.concatenate([np.concatenate([prompt_mask_NP, prompt_mask_NP]), resp_mask_BC], axis=1)
  return PairBatch(tokens_BT, mask_BT, resp_mask_BC)
