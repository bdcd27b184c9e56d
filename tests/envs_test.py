"""ToolEnv with the calculator on scripted turns, the calculator's safety, and the guessing game."""
import os
import types

import pytest

from dapo_jax.data.prompts import Example
from dapo_jax.envs import base, games, render, tool_env
from dapo_jax.envs import tool_formats as tf

EXAMPLE = Example(messages=({"role": "user", "content": "What is 4821*7302? End with: Answer: <number>"},),
                  ground_truth="35202942", data_source="arith")
TEMPLATES = os.path.join(os.path.dirname(__file__), "data", "templates")


def call(expression: str, name: str = "calculator") -> str:
  return tf.render_tool_calls([base.ToolCall(name, {"expression": expression})], "qwen")


def started(**kw) -> tool_env.ToolEnv:
  env = tool_env.ToolEnv(**kw)
  env.reset(EXAMPLE)
  return env


def check(result: base.StepResult) -> base.StepResult:
  """What the engine requires of a step's answer."""
  assert isinstance(result, base.StepResult)
  if result.observation is not None:
    render.check_messages(result.observation)
    assert result.reward is None
  for v in result.info.values():
    assert isinstance(v, (int, float, str))
  return result


# --- ToolEnv -----------------------------------------------------------------------------------------

def test_a_calculator_episode_end_to_end():
  env = tool_env.ToolEnv()
  assert env.reset(EXAMPLE) == list(EXAMPLE.messages)  # qwen (no tokenizer): the template renders tools
  assert env.fmt == "qwen" and env.tools == [tool_env.calculator_tool().schema()]
  out = check(env.step("I will use the calculator.\n" + call("4821*7302")))
  assert out.observation == [{"role": "tool", "name": "calculator", "content": "35202942"}]
  assert out.info == {"tool_calls": 1, "tool_errors": 0}
  out = check(env.step("The product is 35202942.\nAnswer: 35202942"))
  assert out.observation is None and out.reward["acc"] is True and out.reward["score"] == 1.0


def test_a_wrong_answer_scores_minus_one():
  out = check(started().step("Answer: 35202941"))
  assert out.observation is None and out.reward == {"score": -1.0, "acc": False, "pred": "35202941"}


def test_several_calls_in_one_turn():
  env = started()
  out = check(env.step(call("2+3") + "\n" + call("2**10")))
  assert [m["content"] for m in out.observation] == ["5", "1024"] and out.info["tool_calls"] == 2


def test_a_tool_that_raises_answers_with_an_error():
  def boom(expression):
    raise RuntimeError("the disk is on fire")
  tool = base.Tool("calculator", "breaks", {"type": "object", "properties": {}}, boom)
  out = check(started(tools=[tool]).step(call("1+1")))
  assert out.observation[0]["content"] == "error: calculator failed: RuntimeError: the disk is on fire"
  assert out.info == {"tool_calls": 1, "tool_errors": 1}
  # Wrong argument names are the same: the tool's TypeError goes back to the policy.
  bad = tf.render_tool_calls([base.ToolCall("calculator", {"expr": "1"})], "qwen")
  assert started().step(bad).observation[0]["content"].startswith("error: calculator failed: TypeError")


def test_an_unknown_tool_answers_with_an_error():
  out = check(started().step(call("1+1", name="python")))
  assert out.observation[0]["content"] == "error: no tool named 'python'; the tools are ['calculator']"
  assert out.info["tool_errors"] == 1


def test_a_malformed_call_is_reported_to_the_policy():
  env = started()
  out = check(env.step('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"\n</tool_call>'))
  assert out.observation[0]["role"] == "tool" and out.observation[0]["content"].startswith("error: the tool call")
  assert "not valid JSON" in out.observation[0]["content"]
  assert out.info == {"tool_errors": 1}
  assert check(env.step("Answer: 35202942")).reward["acc"]  # the episode goes on


def test_the_call_budget_ends_the_episode():
  env = started(max_tool_calls=1)
  assert check(env.step(call("1+1"))).observation is not None
  out = check(env.step(call("4821*7302")))
  assert out.observation is None and out.reward["acc"] is False and out.info["tool_budget_exceeded"] == 1


def test_built_from_config_strings():
  make = base.resolve("dapo_jax.envs.tool_env:ToolEnv",
                      '{"tools": ["dapo_jax.envs.tool_env:calculator_tool"], "max_tool_calls": 2, '
                      '"reward": "dapo_jax.rewards:math_dapo"}')
  env = make()
  env.reset(EXAMPLE)
  assert check(env.step(call("6*7"))).observation[0]["content"] == "42"
  with pytest.raises(ValueError, match="is not a Tool"):
    tool_env.ToolEnv(tools=["dapo_jax.envs.tool_env:MAX_DIGITS"])


def test_a_callable_reward():
  env = started(reward=lambda text, gt: {"score": 0.5, "acc": True, "pred": gt})
  assert env.step("done").reward == {"score": 0.5, "acc": True, "pred": "35202942"}


def test_the_format_follows_the_tokenizer():
  with open(os.path.join(TEMPLATES, "gemma3.jinja")) as f:
    gemma = types.SimpleNamespace(chat_template=f.read())
  env = tool_env.ToolEnv()
  env.tokenizer = gemma
  messages = env.reset(EXAMPLE)
  assert env.fmt == "gemma" and env.tools is None  # the template cannot render tools: they are text
  assert "def calculator(expression: str):" in messages[0]["content"]
  assert messages[0]["content"].endswith(EXAMPLE.messages[0]["content"])
  out = check(env.step("```tool_code\ncalculator(expression='4821*7302')\n```"))
  assert out.observation == [{"role": "user", "content": "```tool_output\n35202942\n```"}]
  with open(os.path.join(TEMPLATES, "llama3_1.jinja")) as f:
    env.tokenizer = types.SimpleNamespace(chat_template=f.read())
  env.reset(EXAMPLE)
  assert env.fmt == "llama3" and env.tools
  out = check(env.step('{"name": "calculator", "parameters": {"expression": "2*21"}}'))
  assert out.observation == [{"role": "tool", "name": "calculator", "content": "42"}]


# --- the calculator ----------------------------------------------------------------------------------

@pytest.mark.parametrize("expression,value", [
    ("1+2", "3"), ("2**10", "1024"), ("7/2", "3.5"), ("7//2", "3"), ("-7%3", "2"), ("(12+3)*4.5", "67.5"),
    ("0.1+0.2", "0.3"), ("-(3-5)", "2"), ("2**64", "18446744073709551616"), ("2**-1", "0.5"),
    (" 4821 * 7302 ", "35202942"),
])
def test_calculator_values(expression, value):
  assert tool_env.calculate(expression) == value


@pytest.mark.parametrize("expression,why", [
    ("__import__('os').system('touch /tmp/dapo_calc_pwned')", "only numbers"),
    ("().__class__.__bases__", "only numbers"),
    ("(1).__class__", "only numbers"),
    ("open('/etc/passwd')", "only numbers"),
    ("x + 1", "only numbers"),
    ("lambda: 1", "only numbers"),
    ("[1, 2]", "only numbers"),
    ("'a' * 3", "only numbers"),
    ("True + 1", "only numbers"),
    ("9**9**9", "exponent"),
    ("2**65", "exponent"),
    ("10**60 ** 2", "exponent"),
    ("(10**50)**3", "digits"),
    ("10**60 * 10**60", "digits"),
    ("1" * 101, "digits"),
    ("1e308 * 10", "finite"),
    ("(-8) ** 0.5", "real number"),
    ("1/0", "division by zero"),
    ("1 +", "cannot parse"),
    ("1+" * 200 + "1", "longer than"),
    ("+".join(["1"] * 80), "parts"),
])
def test_calculator_refuses_without_executing(expression, why):
  out = tool_env.calculate(expression)
  assert out.startswith("error:") and why in out
  assert not os.path.exists("/tmp/dapo_calc_pwned")


# --- the guessing game ----------------------------------------------------------------------------------

def play(env, secret: int, guesser) -> tuple[dict, int]:
  env.reset(Example(messages=({"role": "user", "content": "guess"},), ground_truth=str(secret)))
  reply, turns = None, 0
  while True:
    turns += 1
    out = check(env.step(guesser(reply)))
    if out.observation is None:
      return out.reward, turns
    reply = out.observation[0]["content"]
    assert out.observation[0]["role"] == "user"


def binary_search(low=1, high=100):
  state = {"lo": low, "hi": high, "last": None}

  def guess(reply):
    if reply == "higher":
      state["lo"] = state["last"] + 1
    elif reply == "lower":
      state["hi"] = state["last"] - 1
    state["last"] = (state["lo"] + state["hi"]) // 2
    return f"<think>somewhere in {state['lo']}..{state['hi']}</think>My guess is {state['last']}."
  return guess


def test_binary_search_wins_within_seven_guesses():
  for secret in range(1, 101):
    reward, turns = play(games.GuessNumberEnv(max_guesses=7), secret, binary_search())
    assert reward == {"score": 1.0, "acc": True, "pred": str(secret)} and turns <= 7


def test_a_wrong_strategy_runs_out():
  reward, turns = play(games.GuessNumberEnv(max_guesses=7), 50, lambda reply: "1")
  assert reward == {"score": -1.0, "acc": False, "pred": "1"} and turns == 7


def test_hints_and_turns_without_a_number():
  env = games.GuessNumberEnv(max_guesses=3)
  env.reset(Example(messages=({"role": "user", "content": "guess"},), ground_truth="40"))
  assert env.step("10").observation == [{"role": "user", "content": "higher"}]
  assert env.step("I pick 90 this time").observation == [{"role": "user", "content": "lower"}]
  assert env.step("no idea").reward == {"score": -1.0, "acc": False, "pred": ""}
  with pytest.raises(ValueError, match="integer ground truth"):
    env.reset(Example(messages=(), ground_truth="forty"))


def test_guess_number_examples():
  rows = games.guess_number_examples(50, seed=3, low=5, high=9)
  assert rows == games.guess_number_examples(50, seed=3, low=5, high=9)
  assert {int(r.ground_truth) for r in rows} == {5, 6, 7, 8, 9}
  assert [r.index for r in rows] == list(range(50)) and rows[0].data_source == "guess_number"
  assert "from 5 to 9" in rows[0].messages[0]["content"] and rows[0].messages[0]["role"] == "user"
  env = base.resolve("dapo_jax.envs.games:GuessNumberEnv", {"max_guesses": 4})()
  assert env.reset(rows[0]) == list(rows[0].messages)


def test_rows_an_environment_cannot_run_are_named_at_load(tmp_path):
  """An episode dataset is checked by its environment as it loads: a guessing game's secret that is
  not an integer, or a tool episode whose reward cannot read the ground truth, is named by file and
  row; the rows it can run load."""
  import json  # noqa: PLC0415

  from configs import dapo_qwen2_5_32b  # noqa: PLC0415
  from dapo_jax import builders  # noqa: PLC0415
  from dapo_jax.data import prompts  # noqa: PLC0415
  path = tmp_path / "games.jsonl"
  rows = [{"prompt": "Guess my number (1-100).", "reward_model": {"ground_truth": gt}} for gt in ("42", "seven", "7")]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  cfg = dapo_qwen2_5_32b.get_config("runlocal")
  cfg.data.update(task="file", train_files=(str(path),), eval_files=())
  cfg.rollout.update(env="dapo_jax.envs.games:GuessNumberEnv", env_args='{"max_guesses": 3}')
  with pytest.raises(prompts.DataError, match=rf"^{path}: row 1: an unusable ground truth: GuessNumberEnv needs an "
                                              r"integer ground truth, got 'seven'"):
    builders.datasets(cfg)
  cfg.data.missing_answer = "skip"
  assert [ex.ground_truth for ex in builders.datasets(cfg)[0]] == ["42", "7"]
  # A tool environment asks the reward that scores its answers.
  env = tool_env.ToolEnv(reward="dapo_jax.rewards:python_tests")
  with pytest.raises(ValueError, match="ground_truth is not a JSON object \\(a int"):
    env.check_example(EXAMPLE)
  tool_env.ToolEnv().check_example(EXAMPLE)  # math_dapo reads any answer.


def test_turn_stop_names_one_token_and_the_sampler_stops_on_it(tiny_tokenizer_dir):
  """`rollout.turn_stop` strings become stop ids of the sampler for episodes; a string that is not
  exactly one token, or turn_stop without an environment, is a one-line config error."""
  from configs import default  # noqa: PLC0415
  from dapo_jax import builders  # noqa: PLC0415
  from dapo_jax.data import tokenizer as tokenizer_lib  # noqa: PLC0415
  tok = tokenizer_lib.load(tiny_tokenizer_dir)
  cfg = default.get_config()
  cfg.rollout.turn_stop = ("<|endoftext|>",)
  with pytest.raises(builders.ConfigError, match=r"rollout.turn_stop=\('<\|endoftext\|>',\) ends turns of episodes"):
    builders.sampler_config(cfg, tok)
  cfg.rollout.env = "dapo_jax.envs.games:GuessNumberEnv"
  (stop,) = builders.turn_stop_ids(cfg, tok)
  assert stop == tok.convert_tokens_to_ids("<|endoftext|>") and stop in builders.sampler_config(cfg, tok).eos_ids
  assert builders.episodes(cfg, tok)[1].turn_stop_ids == (stop,)
  cfg.rollout.turn_stop = ("</tool_call>",)
  n = len(tok("</tool_call>", add_special_tokens=False)["input_ids"])
  with pytest.raises(builders.ConfigError, match=rf"rollout.turn_stop: '</tool_call>' is {n} tokens of this "
                                                    r"tokenizer .* each must be exactly one token"):
    builders.turn_stop_ids(cfg, tok)
