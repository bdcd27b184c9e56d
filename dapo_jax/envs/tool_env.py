"""A tool-using episode: the policy calls tools until it answers; the answer is scored.

    rollout.env = "dapo_jax.envs.tool_env:ToolEnv"
    rollout.env_args = '{"tools": ["dapo_jax.envs.tool_env:calculator_tool"], "max_tool_calls": 4,
                         "reward": "dapo_jax.rewards:math_dapo"}'

    user:       What is 4821*7302? ...            (the tools through the template, or as text)
    assistant:  <tool_call> {"name": "calculator", "arguments": {"expression": "4821*7302"}} </tool_call>
    tool:       35203142                          (in the template's tool role)
    assistant:  Answer: 35203142                  (no call: the episode ends, reward(text, ground_truth))

The call format follows the policy's chat template (`tool_formats.detect(env.tokenizer)`).
"""
from __future__ import annotations

import ast
import math
import operator
from typing import Callable, Sequence

from dapo_jax.envs import base, tool_formats

# --- the calculator --------------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 300
MAX_NODES = 100        # syntax-tree nodes: bounds the work of one expression
MAX_DIGITS = 100       # of any integer, literal or intermediate
MAX_EXPONENT = 64

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
  pass


def _checked(x):
  if isinstance(x, int) and x and math.log10(abs(x)) >= MAX_DIGITS:
    raise CalculatorError(f"a number has more than {MAX_DIGITS} digits")
  if isinstance(x, float) and not math.isfinite(x):
    raise CalculatorError("the result is not a finite number")
  return x


def _power(a, b):
  # Decided before computing: 9**9**9 must be refused, not run.
  if abs(b) > MAX_EXPONENT:
    raise CalculatorError(f"exponent {b} is larger than {MAX_EXPONENT}")
  if isinstance(b, float) and a < 0 and not b.is_integer():
    raise CalculatorError("a negative number to a fractional power is not a real number")
  if a and b > 0 and abs(b) * math.log10(abs(a)) >= MAX_DIGITS:
    raise CalculatorError(f"the power has more than {MAX_DIGITS} digits")
  return a ** b


def _value(node: ast.AST):
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    return _checked(node.value)
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _UNARY[type(node.op)](_value(node.operand))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    a, b = _value(node.left), _value(node.right)
    out = _power(a, b) if isinstance(node.op, ast.Pow) else _BINARY[type(node.op)](a, b)
    if isinstance(out, complex):
      raise CalculatorError("the result is not a real number")
    return _checked(out)
  raise CalculatorError("only numbers, + - * / // % ** and parentheses are allowed, got "
                        f"{type(node).__name__}")


def _show(x) -> str:
  if isinstance(x, float):
    if x.is_integer() and abs(x) < 1e16:
      return str(int(x))
    return f"{x:.15g}"  # 15 significant digits: 0.1+0.2 shows as 0.3.
  return str(x)


def calculate(expression: str) -> str:
  """An arithmetic expression's value as text, by walking its syntax tree (never eval); anything
  else, or a number too large, is an "error: ..." string for the policy."""
  expression = str(expression).strip()
  if len(expression) > MAX_EXPRESSION_CHARS:
    return f"error: the expression is longer than {MAX_EXPRESSION_CHARS} characters"
  try:
    tree = ast.parse(expression, mode="eval")
  except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: a null byte.
    return f"error: cannot parse {expression!r} as arithmetic"
  if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
    return f"error: the expression has more than {MAX_NODES} parts"
  try:
    return _show(_value(tree.body))
  except ZeroDivisionError:
    return "error: division by zero"
  except (CalculatorError, OverflowError, ValueError) as e:
    return f"error: {e}"


def calculator_tool() -> base.Tool:
  return base.Tool(
      name="calculator",
      description="Evaluates an arithmetic expression: numbers, + - * / // % ** and parentheses.",
      parameters={"type": "object",
                  "properties": {"expression": {"type": "string", "description": "e.g. (12+3)*4.5"}},
                  "required": ["expression"]},
      fn=calculate)


# --- the environment -------------------------------------------------------------------------------

def _resolve_tool(spec) -> base.Tool:
  """A Tool, or 'module:name' naming a Tool or a function returning one (env_args are JSON)."""
  if isinstance(spec, base.Tool):
    return spec
  if isinstance(spec, str):
    found = base.import_object(spec, "tool")
    tool = found if isinstance(found, base.Tool) else found() if callable(found) else None
    if isinstance(tool, base.Tool):
      return tool
  raise ValueError(f"tool {spec!r} is not a Tool nor 'module:name' of a Tool or a function returning one")


class ToolEnv(base.Env):
  """The policy calls `tools` (at most `max_tool_calls` calls in all) until a turn without a call:
  that turn is the answer, scored by `reward(text, example.ground_truth)`.

  A tool that raises, or a name no tool has, answers with an error string (the policy sees it; the
  episode goes on); a malformed call is answered with what is wrong with it and counts as a call.
  A call beyond the budget ends the episode, scoring that turn as the answer."""

  def __init__(self, tools: Sequence = ("dapo_jax.envs.tool_env:calculator_tool",),
               reward: str | Callable = "dapo_jax.rewards:math_dapo", max_tool_calls: int = 4,
               tool_format: str | None = None):
    if max_tool_calls < 0:
      raise ValueError(f"max_tool_calls={max_tool_calls} must be >= 0")
    if tool_format is not None and tool_format not in tool_formats.FORMATS:
      raise ValueError(f"tool_format={tool_format!r}: expected one of {tool_formats.FORMATS}")
    self.tool_list = [_resolve_tool(t) for t in tools]
    self.by_name = {t.name: t for t in self.tool_list}
    self.reward_fn = base.import_object(reward, "ToolEnv reward") if isinstance(reward, str) else reward
    if not callable(self.reward_fn):
      raise ValueError(f"ToolEnv reward={reward!r} is not a function (response, ground_truth) -> dict")
    self.max_tool_calls = max_tool_calls
    self.tool_format = tool_format
    self.fmt = tool_format or "qwen"
    self.example, self.calls_made = None, 0

  def reset(self, example) -> list[dict]:
    self.example, self.calls_made = example, 0
    self.fmt = self.tool_format or (tool_formats.detect(self.tokenizer) if self.tokenizer is not None else "qwen")
    schemas = [t.schema() for t in self.tool_list]
    # Templates that render `tools=` get the schemas; the others get them as text in the prompt,
    # and no `tools=` (a template that renders tools some other way would show them twice).
    self.tools = schemas if self.fmt in ("qwen", "llama3") else None
    return tool_formats.prompt_messages(example.messages, schemas, self.fmt)

  def check_example(self, example) -> None:
    check = getattr(self.reward_fn, "check_ground_truth", None)  # The reward that scores the answer.
    if check is not None:
      check(example.ground_truth)

  def _answer(self, text: str, info: dict) -> base.StepResult:
    return base.StepResult(observation=None, reward=self.reward_fn(text, self.example.ground_truth), info=info)

  def _run(self, call: base.ToolCall) -> str:
    tool = self.by_name.get(call.name)
    if tool is None:
      return f"error: no tool named {call.name!r}; the tools are {sorted(self.by_name)}"
    try:
      return tool(call.arguments)
    except Exception as e:  # A tool's failure is the policy's information, not the run's crash.
      return f"error: {call.name} failed: {type(e).__name__}: {e}"

  def step(self, text: str) -> base.StepResult:
    try:
      calls = tool_formats.parse_tool_calls(text, self.fmt)
    except tool_formats.ToolCallError as e:
      self.calls_made += 1
      if self.calls_made > self.max_tool_calls:
        return self._answer(text, {"tool_errors": 1, "tool_budget_exceeded": 1})
      return base.StepResult(observation=tool_formats.error_messages(str(e), self.fmt), info={"tool_errors": 1})
    if not calls:
      return self._answer(text, {"tool_calls": 0})
    self.calls_made += len(calls)
    if self.calls_made > self.max_tool_calls:
      return self._answer(text, {"tool_calls": 0, "tool_budget_exceeded": 1})
    results = [self._run(c) for c in calls]
    errors = sum(r.startswith("error:") for r in results)
    return base.StepResult(observation=tool_formats.tool_result_messages(calls, results, self.fmt),
                           info={"tool_calls": len(calls), "tool_errors": errors})
