"""Tool calls streamed as OpenAI streams them: a chunk with the call's id and function name as soon as
the name is written, then its arguments' JSON text as it comes, then the next call.

The turn's text is read again at each update (turns are short) and compared with what was sent.
JSON calls (Qwen's `<tool_call>` blocks, Llama 3's call objects) stream their arguments as the policy
writes them, character for character, so the fragments join into the arguments object it wrote.
Gemma's `tool_code` is Python: its calls go out whole when the block closes. Text before the first
call streams as content; text between or after calls goes out at the turn's end. The turn's end
decides with the whole-turn parser (`envs.tool_formats`): a call that streamed its name but then does
not parse ends the turn as text (`finish_reason` "stop"), as the unstreamed answer would have it.
"""
from __future__ import annotations

import json
import re
import uuid

from dapo_jax.envs import tool_formats

_MARKERS = {"qwen": "<tool_call>", "gemma": "```tool_code"}
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _json_prefix(text: str) -> tuple[str, bool]:
  """The start of `text` up to the end of its first JSON value (strings respected), or all of it if the
  value is not complete yet; and whether it is."""
  depth, in_string, escaped = 0, False, False
  for i, ch in enumerate(text):
    if in_string:
      if escaped:
        escaped = False
      elif ch == "\\":
        escaped = True
      elif ch == '"':
        in_string = False
    elif ch == '"':
      in_string = True
    elif ch in "{[":
      depth += 1
    elif ch in "}]":
      depth -= 1
      if depth == 0:
        return text[:i + 1], True
  return text, False


def _json_calls(text: str, fmt: str) -> tuple[int, list[tuple[str, str, bool]]]:
  """Where the first call starts in `text`, and each call so far as (name, arguments text, complete);
  a call whose name is not written whole yet is left out."""
  if fmt == "llama3":  # The whole message is the call, or what follows <|python_tag|>.
    start = text.find("<|python_tag|>")
    if start >= 0:
      bodies = [text[start + len("<|python_tag|>"):]]
    else:
      start = 0 if text.lstrip().startswith("{") else -1
      bodies = [text] if start == 0 else []
  else:
    start = text.find(_MARKERS[fmt])
    bodies = [b.split("</tool_call>")[0] for b in text.split(_MARKERS[fmt])[1:]] if start >= 0 else []
  calls = []
  for body in bodies:
    while body.strip():
      name = _NAME.match(body)
      if not name:
        break
      args = _ARGS.match(body, name.end())
      if not args:
        calls.append((name.group(1), "", False))
        break
      text_args, complete = _json_prefix(body[args.end():])
      calls.append((name.group(1), text_args, complete))
      if fmt != "llama3" or not complete:
        break
      body = body[args.end() + len(text_args):].lstrip(" \t\r\n;,}")  # Llama 3: several calls in one message.
  return start, calls


def _new_call(k: int, name: str, args: str = "") -> dict:
  return {"index": k, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
          "function": {"name": name, "arguments": args}}


class ToolCallStream:
  """One streamed turn's tool calls and content: `update` gives each chunk's delta."""

  def __init__(self, fmt: str, tools):
    self.fmt, self.tools = fmt, tools
    self.content_sent = 0          # characters of the turn's text sent as content
    self.args_sent: list[str] = []  # per call whose name was sent: its arguments' text sent

  def update(self, text: str, done: bool, finish: str | None = None) -> tuple[dict | None, str | None]:
    """`text`: the turn so far (less what a stop string may still claim, while not `done`). Returns (the
    delta to send or None, and when `done` the finish reason)."""
    if done:
      return self._end(text, finish)
    delta: dict = {}
    after = tool_formats._after_thinking(text)
    thinking = len(text) - len(after)
    if self.fmt in ("qwen", "llama3"):
      start, calls = _json_calls(after, self.fmt)
      out = []
      for k, (name, args, _) in enumerate(calls):
        if k == len(self.args_sent):
          out.append(_new_call(k, name))
          self.args_sent.append("")
        if args.startswith(self.args_sent[k]) and len(args) > len(self.args_sent[k]):
          out.append({"index": k, "function": {"arguments": args[len(self.args_sent[k]):]}})
          self.args_sent[k] = args
      if out:
        delta["tool_calls"] = out
    else:
      start = after.find(_MARKERS[self.fmt]) if self.fmt in _MARKERS else -1
    end = thinking + start if start >= 0 else self._safe_end(text)
    if end > self.content_sent and not self.args_sent:
      delta["content"], self.content_sent = text[self.content_sent:end], end
    return (delta or None), None

  def _safe_end(self, text: str) -> int:
    """How much of a text without a call may go out: not the start of a call's marker at its end, and
    nothing of a Llama 3 message that is blank so far (it may open a call)."""
    if self.fmt == "llama3" and not text.strip():
      return 0
    marker = _MARKERS.get(self.fmt, "<|python_tag|>" if self.fmt == "llama3" else "")
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
      if marker.startswith(text[-k:]):
        return len(text) - k
    return len(text)

  def _end(self, text: str, finish: str | None) -> tuple[dict | None, str]:
    """The whole turn, parsed as an unstreamed answer is: what is left of its calls and its content."""
    try:
      calls = tool_formats.parse_tool_calls(text, self.fmt) if self.tools else []
    except tool_formats.ToolCallError:
      calls = []
    if not calls:  # Text, all of it not sent yet (a call that did not parse included).
      rest = text[self.content_sent:]
      return ({"content": rest} if rest else None), finish or "stop"
    _, streamed = _json_calls(tool_formats._after_thinking(text), self.fmt) if self.fmt != "gemma" else (0, [])
    out = []
    for k, call in enumerate(calls):
      if k >= len(self.args_sent):  # Not streamed: whole, its arguments as the unstreamed answer has them.
        out.append(_new_call(k, call.name, json.dumps(call.arguments)))
        continue
      # Streamed: the rest of the policy's own text of its arguments (the fragments join into it).
      args = streamed[k][1] if k < len(streamed) else ""
      if args.startswith(self.args_sent[k]) and len(args) > len(self.args_sent[k]):
        out.append({"index": k, "function": {"arguments": args[len(self.args_sent[k]):]}})
    delta: dict = {"tool_calls": out} if out else {}
    content = tool_formats.strip_calls(text, self.fmt) if self.fmt != "gemma" else ""
    if len(content) > self.content_sent and content.startswith(text[:self.content_sent]):
      delta["content"] = content[self.content_sent:]
    return (delta or None), "tool_calls"
