"""The OpenAI API's request bodies and chat messages, checked: what a client may send
(`CompletionBody`, `ChatBody`), each message as the chat template expects it (`normalize_message`:
text content, image parts for a vision-language policy, tool calls with object arguments), tools,
and a policy turn back as an assistant message. Anything malformed is a 400 naming the field."""
from __future__ import annotations

import json
import uuid
from typing import Any, Literal, Union

import pydantic

from dapo_jax.data import images as data_images
from dapo_jax.envs import tool_formats
from dapo_jax.serve import images as images_lib
from dapo_jax.serve import scoring
from dapo_jax.serve.http import APIError

MAX_DEPTH = 64           # nesting of a message or tool (its arguments, its schema): deeper is a 400


class _Body(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="ignore")
  model: str | None = None
  max_tokens: int | None = None
  temperature: float = pydantic.Field(1.0, ge=0.0, le=2.0)
  top_p: float = pydantic.Field(1.0, gt=0.0, le=1.0)
  n: int = pydantic.Field(1, ge=1, le=128)
  stop: Union[str, list[str], None] = None
  seed: int | None = None
  stream: bool = False
  stream_options: dict | None = None
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0


class CompletionBody(_Body):
  prompt: Union[str, list[str], list[int], list[list[int]]]
  logprobs: int | None = pydantic.Field(None, ge=0, le=scoring.TOP)
  echo: bool = False


class ChatBody(_Body):
  messages: list[dict[str, Any]] = pydantic.Field(min_length=1)
  max_completion_tokens: int | None = None
  logprobs: bool = False
  top_logprobs: int | None = pydantic.Field(None, ge=0, le=20)
  tools: list[dict[str, Any]] | None = None
  tool_choice: Union[Literal["none", "auto", "required"], dict, None] = None


def _stops(stop) -> list[str]:
  stops = [stop] if isinstance(stop, str) else list(stop or [])
  if len(stops) > 4 or any(not s for s in stops):
    raise APIError(400, "stop: at most 4 non-empty strings", param="stop")
  return stops


def text_chars(value, param: str) -> int:
  """Characters of text in a JSON value (its strings and keys). A 400 naming the field for nesting
  deeper than MAX_DEPTH or a string that is not Unicode text (a lone surrogate, which JSON lets
  through and no tokenizer takes)."""
  total, stack = 0, [(value, param, 0)]
  while stack:
    v, path, depth = stack.pop()
    if isinstance(v, str):
      try:
        v.encode("utf-8")
      except UnicodeEncodeError:
        raise APIError(400, f"{path}: not Unicode text (a lone surrogate)", param=path) from None
      total += len(v)
    elif isinstance(v, (dict, list)):
      if depth >= MAX_DEPTH:
        raise APIError(400, f"{path}: nested deeper than {MAX_DEPTH} levels", param=path)
      if isinstance(v, dict):
        for k, x in v.items():
          key = str(k).encode("utf-8", "backslashreplace").decode()  # (a key is text too: named safely)
          if key != k:
            raise APIError(400, f"{path}.{key}: a key that is not Unicode text", param=f"{path}.{key}")
          total += len(k)
          stack.append((x, f"{path}.{k}", depth + 1))
      else:
        stack.extend((x, f"{path}[{j}]", depth + 1) for j, x in enumerate(v))
  return total


def _bad(param: str, what: str) -> APIError:
  return APIError(400, f"{param}: {what}", param=param)


def normalize_message(m: dict, i: int, images: list | None = None) -> dict:
  """A message as the chat template expects it: text content, tool-call arguments as objects. A
  malformed one (a field of the wrong type, arguments that are not a JSON object, nesting deeper
  than MAX_DEPTH, text that is not Unicode) is a 400 naming the field. `images` (a vision-language
  model's request; None: a text model's): its `image_url` parts' images are appended to it, each
  leaving an image mark in the text (`serve.images`)."""
  at = f"messages[{i}]"
  if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
    raise _bad(f"{at}.role", "expected system, user, assistant or tool")
  text_chars(m, at)
  m = dict(m)
  if m["role"] == "developer":
    m["role"] = "system"
  content = m.get("content")
  if isinstance(content, list):  # Content parts: text, and images for a vision-language model.
    texts = []
    for j, p in enumerate(content):
      if isinstance(p, dict) and p.get("type") == "image_url" and images is not None:
        images.append(images_lib.part_image(p, f"{at}.content[{j}]"))
        texts.append(data_images.IMAGE_MARK)
        continue
      if not isinstance(p, dict) or p.get("type") != "text":
        raise _bad(f"{at}.content[{j}]", "only text parts are supported" if images is None else
                   "expected a text or image_url part")
      if not isinstance(p.get("text", ""), str):
        raise _bad(f"{at}.content[{j}].text", "expected a string")
      texts.append(p.get("text", ""))
    content = "".join(texts)
  if content is not None and not isinstance(content, str):
    raise _bad(f"{at}.content", "expected a string or text parts")
  m["content"] = content or ""
  for key in ("name", "tool_call_id"):
    if m.get(key) is not None and not isinstance(m[key], str):
      raise _bad(f"{at}.{key}", "expected a string")
  given = m.get("tool_calls")
  if given is not None and not isinstance(given, list):
    raise _bad(f"{at}.tool_calls", "expected a list of calls")
  calls = []
  for j, call in enumerate(given or []):
    where = f"{at}.tool_calls[{j}]"
    if not isinstance(call, dict):
      raise _bad(where, "expected {'type': 'function', 'function': {'name': ..., 'arguments': ...}}")
    f = call.get("function", call)
    if not isinstance(f, dict):
      raise _bad(f"{where}.function", "expected an object with a name and arguments")
    f = dict(f)
    if not isinstance(f.get("name"), str):
      raise _bad(f"{where}.function.name", "expected a string")
    if isinstance(f.get("arguments"), str):
      try:
        f["arguments"] = json.loads(f["arguments"] or "{}")
      except (ValueError, RecursionError):
        raise _bad(f"{where}.function.arguments", "not JSON") from None
      text_chars(f["arguments"], f"{where}.function.arguments")
    if f.get("arguments") is not None and not isinstance(f["arguments"], dict):
      raise _bad(f"{where}.function.arguments", "expected a JSON object")
    if call.get("id") is not None and not isinstance(call["id"], str):
      raise _bad(f"{where}.id", "expected a string")
    calls.append({"type": "function", "function": f, **({"id": call["id"]} if "id" in call else {})})
  if calls:
    m["tool_calls"] = calls
  else:
    m.pop("tool_calls", None)
  return m


def check_tools(tools) -> int:
  """Characters of text in `tools`; a 400 naming the field for a malformed one."""
  if not isinstance(tools, list):
    raise _bad("tools", "expected a list of tools")
  for i, t in enumerate(tools):
    f = t.get("function", t) if isinstance(t, dict) else None
    if not isinstance(f, dict):
      raise _bad(f"tools[{i}].function", "expected {'type': 'function', 'function': {'name': ..., 'parameters': ...}}")
    if not isinstance(f.get("name"), str):
      raise _bad(f"tools[{i}].function.name", "expected a string")
    if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
      raise _bad(f"tools[{i}].function.parameters", "expected a JSON schema (an object)")
  return text_chars(tools, "tools")


def assistant_message(text: str, tools, fmt: str, finish: str = "stop") -> tuple[dict, str]:
  """A policy turn as an OpenAI assistant message and its finish reason: with tools, the calls
  parsed in the template's format become `tool_calls` (arguments as JSON text, as OpenAI sends
  them) and the rest stays the content; a malformed call stays text, for the client to see."""
  if tools:
    try:
      calls = tool_formats.parse_tool_calls(text, fmt)
    except tool_formats.ToolCallError:
      calls = []
    if calls:
      content = tool_formats.strip_calls(text, fmt) if fmt != "gemma" else ""
      return {"role": "assistant", "content": content or None,
              "tool_calls": [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                              "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                             for c in calls]}, "tool_calls"
  return {"role": "assistant", "content": text}, finish
