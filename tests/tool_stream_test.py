"""Streamed tool calls (`serve.tool_stream`) against the unstreamed answer (`openai_messages.assistant_message`,
the whole-turn parser): fed a turn a few characters at a time, the chunks' content, names and
argument fragments join into the same message, names before arguments, for every call format."""
import collections
import json

import numpy as np
import pytest

from dapo_jax.envs import tool_formats
from dapo_jax.envs.base import ToolCall
from dapo_jax.serve import openai_messages, tool_stream

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
CALLS = [ToolCall("add", {"a": 3, "b": {"c": "x}\""}}), ToolCall("mul", {"n": [1, 2]})]
TURNS = {
    "qwen": ["I will add.\n" + tool_formats.render_tool_calls(CALLS, "qwen"),
             tool_formats.render_tool_calls(CALLS[:1], "qwen"),
             "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 3}\n</tool_call>",   # malformed: text
             "No call here, just <tool talk."],
    "llama3": [tool_formats.render_tool_calls(CALLS, "llama3"),
               "Calling.<|python_tag|>" + tool_formats.render_tool_calls(CALLS[:1], "llama3"),
               "The answer is 7."],
    "gemma": ["Let me compute.\n" + tool_formats.render_tool_calls(CALLS, "gemma"), "Just text."],
}


def streamed(text: str, fmt: str, seed: int):
  """The message a client assembles from the stream of `text` fed in random pieces, and the finish."""
  stream = tool_stream.ToolCallStream(fmt, TOOLS)
  rng, at, deltas = np.random.default_rng(seed), 0, []
  while at < len(text):
    at = min(len(text), at + int(rng.integers(1, 5)))
    delta, _ = stream.update(text[:at], False)
    deltas.append(delta)
  delta, finish = stream.update(text, True, "stop")
  deltas.append(delta)
  content, names, args, order = "", {}, collections.defaultdict(str), []
  for d in filter(None, deltas):
    content += d.get("content", "")
    for c in d.get("tool_calls", []):
      if c["function"].get("name"):
        assert c["index"] not in names and c["id"].startswith("call_")  # The name comes once, first.
        names[c["index"]] = c["function"]["name"]
      assert c["index"] in names  # No arguments before their call's name.
      args[c["index"]] += c["function"].get("arguments", "")
      order.append(c["index"])
  assert order == sorted(order)  # One call after the other.
  calls = [(names[k], json.loads(args[k])) for k in sorted(names)]
  return content, calls, finish


@pytest.mark.parametrize("fmt", sorted(TURNS))
def test_a_streamed_turn_joins_into_the_unstreamed_message(fmt):
  for text in TURNS[fmt]:
    message, finish = openai_messages.assistant_message(text, TOOLS, fmt)
    want_calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                  for c in message.get("tool_calls", [])]
    for seed in range(3):
      content, calls, got_finish = streamed(text, fmt, seed)
      assert got_finish == finish, (fmt, text)
      if not want_calls and text.count("{") > text.count("}"):
        # A call that does not parse: what streamed of it cannot be taken back; the turn ends as text
        # ("stop"), all of it sent as content, as the unstreamed answer has it.
        assert content == text and finish == "stop"
        continue
      assert calls == want_calls, (fmt, text)
      if fmt != "gemma":  # (Gemma's unstreamed content is empty beside its calls; streamed, it is what came first.)
        # The text before a call streams before the call is seen: the whitespace the whole-turn
        # parser trims from it has gone out already.
        assert content.strip() == (message["content"] or "").strip(), (fmt, text, content)
