"""The calculator task: scripted episodes, and the SFT reference episode that the template and the
environment agree on (its call parses, its result renders as the text that follows, its answer scores)."""
from dapo_jax.data import prompts as data
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.envs import render, tasks
from dapo_jax.rollout import episodes


def step(env, text):
  """(observation, reward, info), as the episode driver reads a step's result."""
  return episodes.unpack_step(env.step(text))


def example():
  return data.arith_examples(1, digits=4, ops="*", seed=3)[0]


def test_a_call_then_an_answer_is_a_correct_episode():
  ex = example()
  expr = ex.messages[-1]["content"].split("What is ")[1].split("?")[0]
  env = tasks.CalculatorArith()
  env.reset(ex)
  obs, reward, info = step(env, data.arith_solution(ex, "tool"))
  assert reward is None and obs == [{"role": "tool", "name": "calculator", "content": str(eval(expr))}]
  assert info["tool_calls"] == 1
  obs, reward, _ = step(env, f"Answer: {obs[0]['content']}")
  assert obs is None and reward["acc"] and reward["score"] == 1.0


def test_without_the_tool_a_call_is_answered_with_an_error_and_malformed_calls_are_reported():
  ex = example()
  env = tasks.CalculatorArith(use_tool=False)
  env.reset(ex)
  obs, _, info = step(env, data.arith_solution(ex, "tool"))
  assert obs[0]["content"].startswith("error: no tool") and info["tool_errors"] == 1
  env = tasks.CalculatorArith()
  env.reset(ex)
  obs, _, info = step(env, '<tool_call>\n{"name": "calculator", "arguments": \n</tool_call>')
  assert "is not valid JSON" in obs[0]["content"] and info["tool_errors"] == 1
  obs, reward, _ = step(env, "Answer: 12")
  assert obs is None and not reward["acc"]


def test_the_reference_episode_is_what_the_template_and_the_environment_agree_on(tiny_tokenizer_dir, tmp_path):
  """The SFT text's call is what the template renders for an assistant tool call, the environment's
  result message renders as the text that follows it, and its answer scores."""
  from dapo_jax import testing
  tok = tokenizer_lib.train_bpe(str(tmp_path), testing.corpus(200), vocab_size=300,
                                chat_template=tokenizer_lib.CHATML_TOOLS_TEMPLATE)
  ex = example()
  env = tasks.CalculatorArith()
  prompt = tokenizer_lib.render(tok, env.reset(ex), tools=env.tools)
  text = tasks.calculator_episode_text(tok, ex)
  assert text.startswith(prompt)
  call = data.arith_solution(ex, "tool")
  expr = ex.messages[-1]["content"].split("What is ")[1].split("?")[0]
  rendered = tok.apply_chat_template(
      [*ex.messages, {"role": "assistant", "content": "", "tool_calls": [
          {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expr}}}]}],
      tools=env.tools, tokenize=False)
  assert rendered == prompt + call + tok.eos_token + "\n"
  obs, _, _ = step(env, call)
  rest = text[len(prompt) + len(call):]
  assert rest.startswith(tok.eos_token + render.observation_text(tok, obs, ended_with=tok.eos_token))
  _, reward, _ = step(env, text.rsplit("\n", 1)[-1])
  assert reward["acc"]


def test_completion_only_sft_rows_train_the_policys_turns_and_nothing_else(tiny_tokenizer_dir, tmp_path):
  """`sft.completion_only`: a calculator episode's loss mask covers the call with its end-of-turn and
  the answer; the prompt and the calculator's result are context. Packed rows keep tokens and masks aligned."""
  from dapo_jax import testing
  from dapo_jax.pipelines import sft
  tok = tokenizer_lib.train_bpe(str(tmp_path), testing.corpus(200), vocab_size=300,
                                chat_template=tokenizer_lib.CHATML_TOOLS_TEMPLATE)
  exs = data.arith_examples(3, digits=4, ops="*", seed=5)
  rows = sft.sft_rows(tok, exs, chat_template=True, style="tool")
  for ex, (ids, mask) in zip(exs, rows):
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    context = tok.decode([t for t, m in zip(ids, mask) if not m])
    assert trained == data.arith_solution(ex, "tool") + tok.eos_token + f"Answer: {ex.ground_truth}"
    assert tok.decode(ids) == tasks.calculator_episode_text(tok, ex)
    prompt = tokenizer_lib.render(tok, ex.messages, tools=tasks.calculator_schemas())
    assert context == prompt + render.observation_text(
        tok, [{"role": "tool", "name": "calculator", "content": ex.ground_truth}], ended_with=tok.eos_token)
  tokens, masks = sft.pack_masked(rows, seq_len=64, eos_id=tok.eos_token_id)
  stream = [t for ids, _ in rows for t in [*ids, tok.eos_token_id]]
  mstream = [m for _, mask in rows for m in [*mask, True]]
  n = len(stream) // 64
  assert tokens.shape == masks.shape == (n, 64)
  assert tokens.ravel().tolist() == stream[: n * 64] and masks.ravel().tolist() == mstream[: n * 64]
  steps_rows = sft.sft_rows(tok, exs, chat_template=True, style="direct")
  assert [tok.decode([t for t, m in zip(ids, mask) if m]) for ids, mask in steps_rows] == [
      f"Answer: {ex.ground_truth}" for ex in exs]
