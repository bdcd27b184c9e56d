"""Built-in episode tasks: 4-digit products with a calculator (`configs/tools_arith.py`).

A 1M-parameter model cannot multiply 4-digit numbers in its head; with the calculator it has to
learn to call it with the right expression and copy the result into its answer:

    user:       What is 4821*7302? End with: Answer: <number>     (the tools in a system turn)
    assistant:  <tool_call>{"name": "calculator", "arguments": {"expression": "4821*7302"}}</tool_call>
    tool:       35202942
    assistant:  Answer: 35202942
"""
from __future__ import annotations

from dapo_jax.data import prompts as data_lib
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.envs import render, tool_env


def calculator_schemas() -> list[dict]:
  return [tool_env.calculator_tool().schema()]


class CalculatorArith(tool_env.ToolEnv):
  """The arithmetic task's examples as calculator episodes (`ToolEnv`), scored by `reward`
  (math_dapo) on the final answer. `use_tool=False`: the same prompts, the calculator still offered,
  but a call is answered with an error: what the policy can do without the tool."""

  def __init__(self, use_tool: bool = True, reward: str = "dapo_jax.rewards:math_dapo", max_tool_calls: int = 2):
    super().__init__(tools=[tool_env.calculator_tool()], reward=reward, max_tool_calls=max_tool_calls)
    if not use_tool:
      self.by_name = {}


def calculator_episode_text(tok, ex: data_lib.Example) -> str:
  """The reference episode of an arithmetic example, as one text (the SFT warm start's target):
  the prompt with the calculator offered, the call, its result in the template's tool role, the answer."""
  prompt = tokenizer_lib.render(tok, ex.messages, tools=calculator_schemas())
  result = render.observation_text(tok, [{"role": "tool", "name": "calculator", "content": ex.ground_truth}],
                                   ended_with=tok.eos_token)
  return (prompt + data_lib.arith_solution(ex, "tool") + tok.eos_token + result
          + data_lib.arith_solution(ex, "direct"))
