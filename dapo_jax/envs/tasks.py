"""Built-in episode tasks: 4-digit products with a calculator (`configs/tools_arith.py`).

A 1M-parameter model cannot multiply 4-digit numbers in its head; with the calculator it has to
learn to call it with the right expression and copy the result into its answer:

    user:       What is 4821*7302? End with: Answer: <number>     (the tools in a system turn)
    assistant:  <tool_call>{"name": "calculator", "arguments": {"expression": "4821*7302"}}</tool_call>
    tool:       35203142
    assistant:  Answer: 35203142
"""
from __future__ import annotations

import ast
import json
import operator
import re

from dapo_jax.data import prompts as data_lib
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.envs import base
from dapo_jax.envs import render

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def calculate(expression: str) -> str:
  """An arithmetic expression's value, by walking its syntax tree (numbers and + - * / // % ** only;
  never eval): anything else, or a result too large, is an error message for the policy."""
  if len(expression) > 200:
    return "error: expression too long"
  try:
    tree = ast.parse(expression, mode="eval")
  except SyntaxError:
    return f"error: cannot parse {expression!r}"

  def value(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
      return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
      return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
      a, b = value(node.left), value(node.right)
      if isinstance(node.op, ast.Pow) and (abs(b) > 64 or abs(a) > 10 ** 6):
        raise ValueError("power too large")
      out = _OPS[type(node.op)](a, b)
      if abs(out) > 10 ** 100:
        raise ValueError("result too large")
      return out
    raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

  try:
    out = value(tree.body)
  except (ValueError, ZeroDivisionError, OverflowError) as e:
    return f"error: {e}"
  return str(int(out)) if isinstance(out, float) and out.is_integer() else str(out)


CALCULATOR = base.Tool(
    name="calculator", description="evaluates an arithmetic expression",
    parameters={"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    fn=lambda expression: calculate(str(expression)))

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def calculator_schemas() -> list[dict]:
  return [CALCULATOR.schema()]


class CalculatorArith(base.Env):
  """The arithmetic task's examples as calculator episodes, scored by `reward` (math_dapo) on the
  final answer. A turn with `<tool_call>` JSON calls the calculator (at most `max_tool_calls`
  turns); a turn without one is the answer. `use_tool=False`: the same prompts, but a call is
  answered with an error: what the policy can do without the tool."""

  def __init__(self, use_tool: bool = True, reward: str = "dapo_jax.rewards:math_dapo", max_tool_calls: int = 2):
    from dapo_jax.rewards import clients  # noqa: PLC0415
    self.use_tool, self.max_tool_calls = use_tool, max_tool_calls
    self.reward = clients.resolve(reward)
    self.tools = calculator_schemas()

  def reset(self, example):
    self.example, self.calls = example, 0
    return list(example.messages)

  def step(self, text: str):
    found = _CALL.findall(text)
    if not found or self.calls >= self.max_tool_calls:
      return None, self.reward(text, self.example.ground_truth), {"tool_calls": 0}
    self.calls += 1
    results = []
    for raw in found:
      try:
        call = json.loads(raw)
        name, args = call["name"], call.get("arguments", {})
        if name != CALCULATOR.name or not self.use_tool:
          results.append(f"error: no tool named {name!r}")
        else:
          results.append(CALCULATOR(args if isinstance(args, dict) else json.loads(args)))
      except (ValueError, KeyError, TypeError) as e:
        results.append(f"error: malformed tool call ({e})")
    messages = [{"role": "tool", "name": CALCULATOR.name, "content": r} for r in results]
    return messages, None, {"tool_calls": len(found), "tool_errors": sum(r.startswith("error") for r in results)}


def calculator_episode_text(tok, ex: data_lib.Example) -> str:
  """The reference episode of an arithmetic example, as one text (the SFT warm start's target):
  the prompt with the calculator offered, the call, its result in the template's tool role, the answer."""
  prompt = tokenizer_lib.render(tok, ex.messages, tools=calculator_schemas())
  result = render.observation_text(tok, [{"role": "tool", "name": "calculator", "content": ex.ground_truth}],
                                   ended_with=tok.eos_token)
  return (prompt + data_lib.arith_solution(ex, "tool") + tok.eos_token + result
          + data_lib.arith_solution(ex, "direct"))
