"""Tool-call formats against the real chat templates of Qwen2.5, Qwen3, Llama 3.1 and Gemma 3
(tests/data/templates; each file's header names its source), through tiny local tokenizers."""
import functools
import json
import os

import pytest

from dapo_jax.envs import render as render_lib
from dapo_jax.envs import tool_formats as tf
from dapo_jax.envs.base import Tool, ToolCall
from dapo_jax.envs.tool_env import calculator_tool

TEMPLATES = os.path.join(os.path.dirname(__file__), "data", "templates")

# family: (template file, bos, end of turn, special tokens, added non-special tokens)
FAMILIES = {
    "qwen2_5": ("qwen2_5", None, "<|im_end|>", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]),
    "qwen3": ("qwen3", None, "<|im_end|>", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]),
    "llama3_1": ("llama3_1", "<|begin_of_text|>", "<|eot_id|>",
                 ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                  "<|python_tag|>"], []),
    "gemma3": ("gemma3", "<bos>", "<end_of_turn>", ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], []),
}
FORMAT = {"qwen2_5": "qwen", "qwen3": "qwen", "llama3_1": "llama3", "gemma3": "gemma"}
NATIVE = ("qwen2_5", "qwen3", "llama3_1")  # templates that render `tools=` themselves
GENERATION_HEADER = {"qwen2_5": "<|im_start|>assistant\n", "qwen3": "<|im_start|>assistant\n",
                     "llama3_1": "<|start_header_id|>assistant<|end_header_id|>\n\n",
                     "gemma3": "<start_of_turn>model\n"}

CALC = ToolCall("calculator", {"expression": "4821*7302"})
SEARCH = ToolCall("search", {"query": "Zürich \"old town\"", "k": 3, "exact": True, "tags": ["a", "b"],
                             "since": None, "weight": 0.5, "filters": {"lang": "de"}})
SEARCH_TOOL = Tool(name="search", description="Searches the web.",
                   parameters={"type": "object", "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
                               "required": ["query"]}, fn=lambda **kw: "none")


def template(name: str) -> str:
  with open(os.path.join(TEMPLATES, name + ".jinja")) as f:
    return f.read()


@functools.cache
def tokenizer(family: str):
  """A byte-level BPE trained in milliseconds, with the family's special tokens and real template."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast
  file, bos, eot, specials, added = FAMILIES[family]
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(["What is 4821*7302? calculator expression search query answer"] * 4, trainer)
  hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eot,
                               additional_special_tokens=[s for s in specials if s not in (bos, eot)])
  hf.add_tokens(added)  # Qwen's tool tags are added tokens, not special ones (they survive decoding).
  hf.chat_template = template(file)
  return hf


def prompt_of(family: str, calls=(CALC,)) -> tuple[list[dict], list[dict]]:
  tools = [calculator_tool().schema()] + ([SEARCH_TOOL.schema()] if SEARCH in calls else [])
  messages = [{"role": "system", "content": "You are careful."}, {"role": "user", "content": "What is 4821*7302?"}]
  return tf.prompt_messages(messages, tools, FORMAT[family]), tools


def render(family: str, messages, tools, **kw) -> str:
  tok = tokenizer(family)
  kw = {**kw, "tools": tools} if family in NATIVE else kw
  return tok.apply_chat_template(messages, tokenize=False, **kw)


# --- which format ----------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_detect_the_real_templates(family):
  assert tf.detect(template(family)) == FORMAT[family]
  assert tf.detect(tokenizer(family)) == FORMAT[family]


def test_detect_names_and_fallbacks():
  from dapo_jax.data import tokenizer as tokenizer_lib
  assert tf.detect(tokenizer_lib.CHATML_TOOLS_TEMPLATE) == "qwen"   # the project's own tools template
  assert tf.detect(tokenizer_lib.CHATML_TEMPLATE) == "none"         # no tool support
  assert tf.detect("Qwen/Qwen2.5-7B-Instruct") == "qwen"
  assert tf.detect("meta-llama/Llama-3.1-8B-Instruct") == "llama3"
  assert tf.detect("google/gemma-3-4b-it") == "gemma"
  assert tf.detect(None) == "none"
  with pytest.raises(ValueError, match="unknown tool format"):
    tf.parse_tool_calls("", "mistral")


# --- the prompt shows the tools --------------------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_prompt_describes_the_tools(family):
  messages, tools = prompt_of(family)
  text = render(family, messages, tools, add_generation_prompt=True)
  assert "calculator" in text and "Evaluates an arithmetic expression" in text
  if family in NATIVE:
    assert messages[-1]["content"] == "What is 4821*7302?"  # untouched: the template renders the tools
    assert '"expression"' in text and '"required"' in text
  else:
    assert "def calculator(expression: str):" in text and "```tool_code" in text
  assert text.endswith(GENERATION_HEADER[family])


def test_generic_format_puts_the_tools_in_the_system_message():
  tools = [calculator_tool().schema()]
  out = tf.prompt_messages([{"role": "user", "content": "hi"}], tools, "none")
  assert out[0]["role"] == "system" and "<tools>" in out[0]["content"] and "<tool_call>" in out[0]["content"]
  out = tf.prompt_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], tools,
                           "none")
  assert out[0]["content"].startswith("Be brief.\n\n# Tools") and len(out) == 2
  assert tf.prompt_messages([{"role": "user", "content": "hi"}], None, "gemma") == [{"role": "user", "content": "hi"}]


# --- calls round-trip ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", tf.FORMATS)
def test_render_then_parse_round_trips(fmt):
  for calls in ([CALC], [CALC, SEARCH]):
    assert tf.parse_tool_calls(tf.render_tool_calls(calls, fmt), fmt) == calls
    assert tf.parse_tool_calls("Let me use the tool.\n" + tf.render_tool_calls(calls, fmt), fmt) == calls \
        or fmt == "llama3"  # Llama's call is the whole message (or follows <|python_tag|>)


@pytest.mark.parametrize("fmt", tf.FORMATS)
def test_text_without_a_call_is_an_answer(fmt):
  for text in ("The product is 35202942.\nAnswer: 35202942", "", "Answer: \\boxed{42}"):
    assert tf.parse_tool_calls(text, fmt) == []


def test_llama_python_tag_and_variants():
  body = '{"name": "calculator", "parameters": {"expression": "1+1"}}'
  call = [ToolCall("calculator", {"expression": "1+1"})]
  assert tf.parse_tool_calls("<|python_tag|>" + body, "llama3") == call
  assert tf.parse_tool_calls("I will compute it.<|python_tag|>" + body, "llama3") == call
  # "arguments" and arguments as a JSON string are accepted too.
  assert tf.parse_tool_calls('{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}', "llama3") == call
  assert tf.parse_tool_calls(body + "; " + body, "llama3") == call * 2


def test_gemma_variants():
  call = [ToolCall("calculator", {"expression": "1+1"})]
  assert tf.parse_tool_calls("```tool_code\nprint(calculator(expression='1+1'))\n```", "gemma") == call
  assert tf.parse_tool_calls("```tool_code\n[calculator(expression=\"1+1\"), calculator(expression='1+1')]\n```",
                             "gemma") == call * 2


def test_calls_while_thinking_are_not_calls():
  text = "<think>\nMaybe " + tf.render_tool_calls([CALC], "qwen") + "? No.\n</think>\n\nAnswer: 35202942"
  assert tf.parse_tool_calls(text, "qwen") == []


# --- the real check: what the template shows the policy, the policy can write back ---------------

def generated_part(family: str, calls) -> str:
  """The text after the prompt's generation header, up to the end of turn, of a conversation whose
  last assistant message makes `calls`: what the template teaches the policy to write."""
  messages, tools = prompt_of(family, calls)
  fmt = FORMAT[family]
  assistant = tf.assistant_message(tf.render_tool_calls(calls, fmt), fmt)
  prompt = render(family, messages, tools, add_generation_prompt=True)
  full = render(family, messages + [assistant], tools)
  assert full.startswith(prompt)
  eot = FAMILIES[family][2]
  turn = full[len(prompt):]
  assert eot in turn
  return turn.split(eot)[0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_template_rendered_call_parses_back(family):
  fmt = FORMAT[family]
  for calls in ([CALC], [SEARCH], [CALC, SEARCH]):
    if family == "llama3_1" and len(calls) > 1:
      continue  # Llama 3.1's template allows one call per message (it raises otherwise).
    text = generated_part(family, calls)
    assert tf.parse_tool_calls(text, fmt) == calls, text
    # Byte for byte what render_tool_calls writes (Qwen3 closes an empty thinking block first).
    assert text.removeprefix("<think>\n\n</think>\n\n") == tf.render_tool_calls(calls, fmt)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_forced_call_opening_begins_the_templates_own_call(family):
  """What a server forces for tool_choice "required" (any call) and a named function: a prefix of the
  call as the family's real chat template renders it (Qwen3's empty thinking block aside)."""
  fmt = FORMAT[family]
  text = generated_part(family, [CALC]).removeprefix("<think>\n\n</think>\n\n")
  assert text.startswith(tf.call_opening(fmt)) and text.startswith(tf.call_opening(fmt, CALC.name))
  assert len(tf.call_opening(fmt, CALC.name)) > len(tf.call_opening(fmt)) > 0
  assert tf.call_opening("none") == ""


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_rendered_call_tokenizes_back_to_itself(family):
  tok = tokenizer(family)
  text = generated_part(family, [CALC])
  ids = tok(text, add_special_tokens=False)["input_ids"]
  assert tok.decode(ids, skip_special_tokens=False) == text
  if FORMAT[family] == "qwen":
    assert tok.convert_tokens_to_ids("<tool_call>") in ids  # one token, as in Qwen's vocabulary


def test_assistant_message_keeps_the_text_and_omits_empty_tool_calls():
  text = "I need the calculator.\n" + tf.render_tool_calls([CALC], "qwen")
  msg = tf.assistant_message(text, "qwen")
  assert msg["content"] == "I need the calculator."
  assert msg["tool_calls"] == [{"type": "function", "function": {"name": "calculator",
                                                                 "arguments": {"expression": "4821*7302"}}}]
  assert tf.assistant_message("Answer: 3", "llama3") == {"role": "assistant", "content": "Answer: 3"}
  gemma = tf.assistant_message(tf.render_tool_calls([CALC], "gemma"), "gemma")
  assert "tool_calls" not in gemma and "```tool_code" in gemma["content"]
  # Llama's template reads any "tool_calls" key as a call: an answer must render as plain text.
  messages, tools = prompt_of("llama3_1")
  out = render("llama3_1", messages + [tf.assistant_message("Answer: 3", "llama3")], tools)
  assert out.endswith("<|start_header_id|>assistant<|end_header_id|>\n\nAnswer: 3<|eot_id|>")


# --- results come back in the template's tool role --------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_results_render_in_the_tool_role(family):
  fmt, tok = FORMAT[family], tokenizer(family)
  obs = tf.tool_result_messages([CALC, CALC], ["35202942", "error: boom"], fmt)
  assert all(isinstance(m["content"], str) for m in obs)  # what the engine accepts (render_lib.check_messages)
  render_lib.check_messages(obs)
  _, tools = prompt_of(family)
  text = render_lib.observation_text(tok, obs, ended_with=FAMILIES[family][2],
                                 tools=tools if family in NATIVE else None)
  expected = {
      "qwen2_5": "\n<|im_start|>user\n<tool_response>\n35202942\n</tool_response>\n<tool_response>\nerror: boom\n"
                 "</tool_response><|im_end|>\n<|im_start|>assistant\n",
      "qwen3": "\n<|im_start|>user\n<tool_response>\n35202942\n</tool_response>\n<tool_response>\nerror: boom\n"
               "</tool_response><|im_end|>\n<|im_start|>assistant\n",
      # Llama 3.1's template writes a string result with tojson (a string is iterable in Jinja).
      "llama3_1": '<|start_header_id|>ipython<|end_header_id|>\n\n"35202942"<|eot_id|>'
                  '<|start_header_id|>ipython<|end_header_id|>\n\n"error: boom"<|eot_id|>'
                  "<|start_header_id|>assistant<|end_header_id|>\n\n",
      "gemma3": "\n<start_of_turn>user\n```tool_output\n35202942\n```\n```tool_output\nerror: boom\n```<end_of_turn>\n"
                "<start_of_turn>model\n",
  }[family]
  assert text == expected


def test_generic_results_are_a_user_turn():
  obs = tf.tool_result_messages([CALC], ["7"], "none")
  assert obs == [{"role": "user", "content": "<tool_response>\n7\n</tool_response>"}]
  with pytest.raises(ValueError, match="2 tool calls but 1 results"):
    tf.tool_result_messages([CALC, CALC], ["7"], "qwen")


# --- malformed calls ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,text,match", [
    ("qwen", "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1+1\"}\n</tool_call>",
     "not valid JSON"),
    ("qwen", "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {}}", "not closed"),
    ("qwen", "<tool_call>\n{\"arguments\": {}}\n</tool_call>", "string \"name\""),
    ("qwen", "<tool_call>\n[1, 2]\n</tool_call>", "string \"name\""),
    ("qwen", "<tool_call>\n{\"name\": \"calculator\", \"arguments\": [1]}\n</tool_call>", "must be a JSON object"),
    ("qwen", "<tool_call>\n{\"name\": \"calculator\", \"arguments\": \"{oops\"}\n</tool_call>", "not valid JSON"),
    ("none", "<tool_call>{'name': 'calculator'}</tool_call>", "not valid JSON"),
    ("llama3", "{\"name\": \"calculator\", \"parameters\": {\"expression\": ", "not valid JSON"),
    ("llama3", "<|python_tag|>calculator.call(expression=\"1\")", "not valid JSON"),
    ("llama3", "{\"parameters\": {}}", "string \"name\""),
    ("gemma", "```tool_code\ncalculator('1+1')\n```", "keyword arguments only"),
    ("gemma", "```tool_code\ncalculator(expression=x)\n```", "literal value"),
    ("gemma", "```tool_code\nimport os\n```", "calls only"),
    ("gemma", "```tool_code\nos.system(cmd='ls')\n```", "must be a call like"),
    ("gemma", "```tool_code\ncalculator(expression='1'\n```", "not a Python call"),
    ("gemma", "```tool_code\ncalculator(expression='1')", "not closed"),
])
def test_malformed_calls_raise_a_clear_error(fmt, text, match):
  with pytest.raises(tf.ToolCallError, match=match) as e:
    tf.parse_tool_calls(text, fmt)
  assert isinstance(e.value, ValueError)


def test_json_arguments_render_as_the_templates_tojson():
  # The templates' `tojson` is json.dumps(ensure_ascii=False): the rendered call keeps "ü" as is.
  text = tf.render_tool_calls([SEARCH], "qwen")
  assert json.dumps(SEARCH.arguments, ensure_ascii=False) in text and "Zürich" in text


# --- ToolEnv through each real template: the prompt, the policy's call, the observation's text ----------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_tool_env_episode_through_the_real_template(family):
  from dapo_jax.data.prompts import Example
  from dapo_jax.envs.tool_env import ToolEnv
  tok, fmt, eot = tokenizer(family), FORMAT[family], FAMILIES[family][2]
  env = ToolEnv()
  env.tokenizer = tok
  example = Example(messages=({"role": "user", "content": "What is 4821*7302? End with: Answer: <number>"},),
                    ground_truth="35202942")
  messages = env.reset(example)
  assert env.fmt == fmt and (env.tools is not None) == (family in NATIVE)
  kw = {"tools": env.tools} if env.tools else {}
  prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
  assert "calculator" in prompt
  if family == "gemma3":  # Gemma 3's template ignores tools=: the text in the prompt is all there is.
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                   tools=[calculator_tool().schema()]) == prompt
  # The policy writes the call as the template shows it (the engine hands over the text before its EOS).
  out = env.step(generated_part(family, [CALC]))
  assert out.reward is None and out.info["tool_calls"] == 1
  text = render_lib.observation_text(tok, out.observation, ended_with=eot, tools=env.tools)
  assert "35202942" in text and text.endswith(GENERATION_HEADER[family])
  out = env.step("The product is 35202942.\nAnswer: 35202942")
  assert out.observation is None and out.reward["acc"]
