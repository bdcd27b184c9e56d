r"""Tool-call formats per chat-template family: how the policy writes a call, and how results come back.

  format  the policy's call (what the template shows it)        a result (the message the env returns)
  qwen    <tool_call>\n{"name": .., "arguments": {..}}\n</tool_call>  role "tool" (the template: <tool_response>)
  llama3  {"name": .., "parameters": {..}}, maybe after <|python_tag|>  role "tool" (the template: an ipython turn)
  gemma   ```tool_code\nname(arg=value)\n```                          a user turn of ```tool_output``` blocks
  none    as qwen, the tools described in a system message           a user turn of <tool_response> blocks

qwen and llama3 templates render `tools=` themselves; gemma (Gemma 3's template has no tool support:
Google's documented convention is plain-text prompting, as in the gemma-cookbook function-calling
notebooks) and none (a template without tools) get the tools as text from `prompt_messages`.

Episodes are token-in/token-out, so the policy's calls are parsed from its own text (`parse_tool_calls`);
`render_tool_calls` and `assistant_message` are the inverse, for SFT data and tests.
"""
from __future__ import annotations

import ast
import json
import re
from typing import Any, Sequence

from dapo_jax.envs.base import ToolCall

FORMATS = ("qwen", "llama3", "gemma", "none")


class ToolCallError(ValueError):
  """A malformed tool call; the message is meant for the policy (the env shows it as the observation)."""


# --- which format a template speaks --------------------------------------------------------------

def _template_text(tokenizer_or_template) -> str:
  if tokenizer_or_template is None or isinstance(tokenizer_or_template, str):
    return tokenizer_or_template or ""
  template = getattr(tokenizer_or_template, "chat_template", None)
  if isinstance(template, dict):  # Named templates: the tool-use one speaks the tool format.
    template = template.get("tool_use") or template.get("default") or next(iter(template.values()), "")
  return template or ""


def detect(tokenizer_or_template) -> str:
  """The tool format of a tokenizer's chat template (or of a template string, or a model name)."""
  text = _template_text(tokenizer_or_template)
  if "{%" not in text and "{{" not in text:  # A model name, not a template.
    name = text.lower()
    for key, fmt in (("qwen", "qwen"), ("llama-3", "llama3"), ("llama3", "llama3"), ("gemma", "gemma")):
      if key in name:
        return fmt
    return "none"
  if "<tool_call>" in text:  # Qwen2.5, Qwen3 (and Hermes-style ChatML tool templates).
    return "qwen"
  if "<|start_header_id|>" in text and ("ipython" in text or "<|python_tag|>" in text):
    return "llama3"  # Llama 3.1 / 3.2 / 3.3; Llama 3.0's template has no tool role.
  if "<start_of_turn>" in text:
    return "gemma"
  return "none"


def _check_format(fmt: str) -> None:
  if fmt not in FORMATS:
    raise ValueError(f"unknown tool format {fmt!r}; expected one of {FORMATS}")


# --- parsing the policy's text ---------------------------------------------------------------------

_THINK_END = "</think>"
_QWEN_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_GEMMA_CALL = re.compile(r"```tool_code[ \t]*\n?(.*?)```", re.S)
_PYTHON_TAG = "<|python_tag|>"


def _after_thinking(text: str) -> str:
  # Calls written while reasoning are not calls: only the text after the last </think> counts.
  return text.rsplit(_THINK_END, 1)[-1] if _THINK_END in text else text


def _call_from_json(obj: Any, source: str, args_keys: tuple[str, ...]) -> ToolCall:
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
    raise ToolCallError(f"a tool call must be a JSON object with a string \"name\", got {source[:200]!r}")
  args = next((obj[k] for k in args_keys if k in obj), {})
  if isinstance(args, str):  # Some models write the arguments as a JSON string.
    try:
      args = json.loads(args) if args.strip() else {}
    except json.JSONDecodeError as e:
      raise ToolCallError(f"the arguments of tool call {obj['name']!r} are not valid JSON ({e})") from None
  if args is None:
    args = {}
  if not isinstance(args, dict):
    raise ToolCallError(f"the arguments of tool call {obj['name']!r} must be a JSON object, got {args!r:.200}")
  return ToolCall(name=obj["name"], arguments=args)


def _parse_qwen(text: str) -> list[ToolCall]:
  calls = []
  for body in _QWEN_CALL.findall(text):
    try:
      obj = json.loads(body)
    except json.JSONDecodeError as e:
      raise ToolCallError(f"the tool call {body.strip()[:200]!r} is not valid JSON ({e})") from None
    calls.append(_call_from_json(obj, body.strip(), ("arguments", "parameters")))
  if text.count("<tool_call>") != len(calls):
    raise ToolCallError("a <tool_call> is not closed: write <tool_call>\n{\"name\": ..., \"arguments\": {...}}\n"
                        "</tool_call>")
  return calls


def _parse_llama3(text: str) -> list[ToolCall]:
  # Llama 3.1's template shows a call as the whole assistant message; the model may open it with
  # <|python_tag|>. A message that is not JSON is an answer; JSON that does not parse is a bad call.
  tagged = _PYTHON_TAG in text
  body = (text.split(_PYTHON_TAG, 1)[1] if tagged else text).strip()
  if not tagged and not body.startswith("{"):
    return []
  decoder, calls, at = json.JSONDecoder(), [], 0
  while at < len(body):
    try:
      obj, end = decoder.raw_decode(body, at)
    except json.JSONDecodeError as e:
      raise ToolCallError(f"the tool call {body[at:at + 200]!r} is not valid JSON ({e}); write "
                          "{\"name\": function name, \"parameters\": {argument: value}}") from None
    calls.append(_call_from_json(obj, body[at:end], ("parameters", "arguments")))
    at = end
    while at < len(body) and body[at] in " \t\r\n;,":  # Several calls: separated by newlines or ';'.
      at += 1
  return calls


def _literal(node: ast.AST, name: str, key: str):
  try:
    return ast.literal_eval(node)
  except (ValueError, SyntaxError, TypeError):
    raise ToolCallError(f"argument {key!r} of {name}(...) must be a literal value (a number, a string, "
                        f"a list, ...), got {ast.unparse(node)[:100]!r}") from None


def _gemma_calls(node: ast.AST) -> list[ToolCall]:
  if isinstance(node, (ast.List, ast.Tuple)):  # [f(a=1), g(b=2)]: the list form of Google's prompt.
    return [c for elt in node.elts for c in _gemma_calls(elt)]
  if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
      and len(node.args) == 1 and not node.keywords):
    return _gemma_calls(node.args[0])  # print(f(x=1)) prints the result, which is the result anyway.
  if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
    raise ToolCallError(f"a tool_code line must be a call like name(arg=value), got {ast.unparse(node)[:100]!r}")
  name = node.func.id
  if node.args or any(k.arg is None for k in node.keywords):
    raise ToolCallError(f"call {name}(...) with keyword arguments only, like {name}(arg=value)")
  return [ToolCall(name=name, arguments={k.arg: _literal(k.value, name, k.arg) for k in node.keywords})]


def _parse_gemma(text: str) -> list[ToolCall]:
  blocks = _GEMMA_CALL.findall(text)
  if text.count("```tool_code") != len(blocks):
    raise ToolCallError("a ```tool_code block is not closed with ```")
  calls = []
  for code in blocks:
    try:
      tree = ast.parse(code.strip(), mode="exec")
    except SyntaxError as e:
      raise ToolCallError(f"the tool_code {code.strip()[:200]!r} is not a Python call ({e.msg})") from None
    for stmt in tree.body:
      if not isinstance(stmt, ast.Expr):
        raise ToolCallError(f"tool_code holds calls only, got {ast.unparse(stmt)[:100]!r}")
      calls.extend(_gemma_calls(stmt.value))
  return calls


def parse_tool_calls(text: str, fmt: str) -> list[ToolCall]:
  """The tool calls in a policy turn ([] when it makes none); ToolCallError when one is malformed."""
  _check_format(fmt)
  text = _after_thinking(text)
  if fmt == "llama3":
    return _parse_llama3(text)
  if fmt == "gemma":
    return _parse_gemma(text)
  return _parse_qwen(text)


# --- writing calls and results --------------------------------------------------------------------

def _json(x) -> str:
  # As the templates' `tojson` filter writes it (transformers: json.dumps, ensure_ascii=False).
  return json.dumps(x, ensure_ascii=False)


def render_tool_calls(calls: Sequence[ToolCall], fmt: str) -> str:
  """The text a policy writes to make these calls, as the format's template renders them."""
  _check_format(fmt)
  if fmt == "llama3":
    return "\n".join(_json({"name": c.name, "parameters": c.arguments}) for c in calls)
  if fmt == "gemma":
    lines = [f"{c.name}({', '.join(f'{k}={v!r}' for k, v in c.arguments.items())})" for c in calls]
    return "```tool_code\n" + "\n".join(lines) + "\n```"
  return "\n".join(f"<tool_call>\n{_json({'name': c.name, 'arguments': c.arguments})}\n</tool_call>" for c in calls)


def call_opening(fmt: str, name: str | None = None) -> str:
  """The text that opens a call in the format (of function `name`, up to its arguments): what a server
  puts after the generation prompt to force a call (OpenAI's tool_choice "required" or a named one).
  '' for a format without calls."""
  _check_format(fmt)
  if fmt == "none":
    return ""
  if fmt == "gemma":
    return "```tool_code\n" + (f"{name}(" if name else "")
  args = "parameters" if fmt == "llama3" else "arguments"
  opening = "" if fmt == "llama3" else "<tool_call>\n"
  return opening + '{"name": "' + (f'{name}", "{args}": ' if name else "")


def strip_calls(text: str, fmt: str) -> str:
  """The content left beside the calls: Llama's call is the whole message (or follows <|python_tag|>)."""
  if fmt == "llama3":
    text = _after_thinking(text)
    return text.split(_PYTHON_TAG, 1)[0].strip() if _PYTHON_TAG in text else ""
  return _QWEN_CALL.sub("", text).strip()


def assistant_message(text: str, fmt: str) -> dict:
  """A policy turn as the OpenAI-style assistant message its template renders (SFT data, tests).

  qwen / llama3: the calls move to "tool_calls" (arguments as objects, as the templates expect) and the
  rest of the text stays the content. gemma / none: the template knows no tool_calls, so the calls
  stay in the content as written. A turn without calls has no "tool_calls" key (Llama's template
  treats the key's presence as a call)."""
  calls = parse_tool_calls(text, fmt)
  if not calls or fmt in ("gemma", "none"):
    return {"role": "assistant", "content": text}
  return {"role": "assistant", "content": strip_calls(text, fmt),
          "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                         for c in calls]}


def tool_result_messages(calls: Sequence[ToolCall], results: Sequence[str], fmt: str) -> list[dict]:
  """The observation answering these calls: messages in the template's tool role (or a user turn)."""
  _check_format(fmt)
  if len(calls) != len(results):
    raise ValueError(f"{len(calls)} tool calls but {len(results)} results")
  if fmt == "gemma":
    return [{"role": "user", "content": "\n".join(f"```tool_output\n{r}\n```" for r in results)}]
  if fmt == "none":
    return [{"role": "user", "content": "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)}]
  return [{"role": "tool", "name": c.name, "content": str(r)} for c, r in zip(calls, results)]


def error_messages(error: str, fmt: str) -> list[dict]:
  """An observation telling the policy its turn's tool call could not be run."""
  return tool_result_messages([ToolCall(name="error", arguments={})], [f"error: {error}"], fmt)


# --- tools as text, for templates without tool support ----------------------------------------------

_PY_TYPES = {"string": "str", "integer": "int", "number": "float", "boolean": "bool", "array": "list",
             "object": "dict"}


def _function(schema: dict) -> dict:
  return schema.get("function", schema)


def _python_stub(schema: dict) -> str:
  f = _function(schema)
  props = f.get("parameters", {}).get("properties", {})
  args = ", ".join(f"{k}: {_PY_TYPES.get(v.get('type'), 'object')}" for k, v in props.items())
  lines = [f"def {f['name']}({args}):", f'  """{f.get("description", "")}']
  lines += [f"  {k}: {v['description']}" for k, v in props.items() if v.get("description")]
  return "\n".join(lines) + '\n  """'


def gemma_tools_text(tools: Sequence[dict]) -> str:
  """Google's Gemma 3 function-calling convention: the tools as Python signatures, calls in
  ```tool_code```, results in ```tool_output```."""
  stubs = "\n\n".join(_python_stub(t) for t in tools)
  return ("You can call the Python functions below. To call one, write the call, with keyword arguments, "
          "in a tool_code block and stop there:\n```tool_code\nname(arg=value)\n```\nIts result comes back "
          "in a tool_output block; use it to call more functions or to answer.\n\n"
          f"```python\n{stubs}\n```")


def qwen_tools_text(tools: Sequence[dict]) -> str:
  """The tools as the qwen format describes them in a system prompt, for templates without tools."""
  listed = "\n".join(_json(t) for t in tools)
  return ("# Tools\n\nYou may call the functions below. Their signatures are within <tools></tools>:\n"
          f"<tools>\n{listed}\n</tools>\n\nTo call one, write a JSON object with its name and arguments within "
          "<tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
          "<args-json-object>}\n</tool_call>")


def prompt_messages(messages: Sequence[dict], tools: Sequence[dict] | None, fmt: str) -> list[dict]:
  """The prompt's messages with the tools described as text where the template cannot render `tools=`
  (gemma: in the first user turn; none: in the system message); qwen and llama3 are left as they are."""
  _check_format(fmt)
  messages = [dict(m) for m in messages]
  if not tools or fmt in ("qwen", "llama3"):
    return messages
  if fmt == "gemma":
    at = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if at is None:
      raise ValueError("the gemma tool format describes the tools in the first user turn; the prompt has none")
    messages[at]["content"] = gemma_tools_text(tools) + "\n\n" + messages[at]["content"]
    return messages
  if messages and messages[0].get("role") == "system":
    messages[0]["content"] = messages[0]["content"] + "\n\n" + qwen_tools_text(tools)
    return messages
  return [{"role": "system", "content": qwen_tools_text(tools)}, *messages]
