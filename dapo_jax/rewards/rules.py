"""Rule-based rewards: the DAPO-Math answer check (verl's math_dapo.compute_score) and the soft overlong
penalty (paper Eq. 13).

Plain Python, no jax: reward-pool workers import this module.
"""
from __future__ import annotations

import re

# --- DAPO-Math scorer (verl's math_dapo.compute_score) ----------------------------------------------
# The normaliser is the Minerva / lighteval one used by the reference scorer. Its brittleness
# (a trailing period or markdown bold scores -1) is kept on purpose: parity, not improvement.

_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
_REMOVED_EXPRESSIONS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
    r",\!", "{,}", '"', "\\dots",
)
_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_WINDOW_CHARS = 300  # The reference looks only at the response's last 300 characters.


def normalize_final_answer(answer: str) -> str:
  """Minerva-style normalisation of a final answer string."""
  answer = answer.split("=")[-1]
  for before, after in _SUBSTITUTIONS:
    answer = answer.replace(before, after)
  for expr in _REMOVED_EXPRESSIONS:
    answer = answer.replace(expr, "")
  answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)      # keep the first $...$
  answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", answer)
  answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", answer)
  answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", answer)
  answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
  answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)    # \fracab -> \frac{a}{b}
  answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)            # \sqrta -> \sqrt{a}
  answer = answer.replace("$", "")
  if answer.replace(",", "").isdigit():
    answer = answer.replace(",", "")
  return answer.strip()


def math_dapo(response: str, ground_truth: str) -> dict:
  """DAPO-Math reward: +1 if the last `Answer:` line in the last 300 characters matches, else -1."""
  matches = _ANSWER_RE.findall(response[-_WINDOW_CHARS:])
  pred = normalize_final_answer(matches[-1] if matches else "[INVALID]")
  acc = pred == normalize_final_answer(ground_truth)
  return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


def math_verify(response: str, ground_truth: str) -> dict:
  """Symbolic equivalence with the optional `math-verify` package (run it in the pool, which times out)."""
  from math_verify import parse, verify  # Optional dependency.
  gold = parse(ground_truth, parsing_timeout=None)
  pred = parse(response[-_WINDOW_CHARS:], parsing_timeout=None)
  acc = bool(pred) and bool(verify(gold, pred, timeout_seconds=None))
  return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": str(pred[-1]) if pred else "[INVALID]"}


def overlong_penalty(length: int, max_len: int, buffer_len: int, penalty_factor: float) -> float:
  """Soft overlong punishment (paper Eq. 13): 0 up to max_len - buffer_len, then linear to -penalty.

  `length` counts completion tokens including the EOS. Generation is capped at `max_len`, so the
  value never goes below -penalty_factor.
  """
  if buffer_len <= 0 or penalty_factor == 0:
    return 0.0
  if max_len < buffer_len:
    raise ValueError(f"overlong buffer {buffer_len} is longer than max_len {max_len}")
  exceed = length - (max_len - buffer_len)
  return max(min(-exceed / buffer_len * penalty_factor, 0.0), -penalty_factor)
