"""Training driven by an outside harness through the OpenAI API (`serve.harness`): a small agent
written against the official `openai` client calls the policy, runs the tool it asks for and sends
the whole conversation back; the trained row is exactly what the engine sampled (its log-probs are
the teacher-forced ones of the whole episode), the observation is only the harness's new message
rendered by the template, the loss mask covers the policy's tokens, and one update runs on it. A
command harness runs with a minimal environment and leaves no process behind; each episode has its
own gateway token."""
import functools
import json
import sys
import threading
import time

import httpx
import jax
import numpy as np
import openai
import pytest

from dapo_jax import advantages, objectives, optim, sharding, testing, train_step
from dapo_jax.data import prompts as data
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.envs import render, tool_formats
from dapo_jax.envs.base import ToolCall
from dapo_jax.model import transformer as model_lib
from dapo_jax.rollout import episodes, rollout, sampling
from dapo_jax.serve import gateway as gateway_lib
from dapo_jax.serve import harness as harness_lib

ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
TEMPERATURE = 0.5   # The memorised policy samples its episode reliably, and still samples.
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
SEEN = []            # What the agent received from the policy, turn by turn.
SEEN_LOCK = threading.Lock()


def calc_agent(base_url, api_key, example):
  """An outside agent: ask, run the calls the policy makes, send the results, score the answer."""
  client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
  messages = [{"role": "user", "content": example.messages[0]["content"]}]
  for _ in range(3):
    msg = client.chat.completions.create(model="policy", messages=messages, tools=[ADD]).choices[0].message
    with SEEN_LOCK:
      SEEN.append(msg.model_dump(exclude_none=True))
    messages.append(msg.model_dump(exclude_none=True))
    if not msg.tool_calls:
      return {"score": float(msg.content.strip() == "7"), "acc": msg.content.strip() == "7", "pred": msg.content}
    for call in msg.tool_calls:
      args = json.loads(call.function.arguments)
      messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
  return 0.0


def rewriting_agent(base_url, api_key, example):
  """Sends back a different first answer than the one it got: the episode must fail, not train."""
  client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
  messages = [{"role": "user", "content": example.messages[0]["content"]}]
  client.chat.completions.create(model="policy", messages=messages, tools=[ADD])
  messages += [{"role": "assistant", "content": "something else"}, {"role": "user", "content": "go on"}]
  client.chat.completions.create(model="policy", messages=messages, tools=[ADD])
  return 1.0


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """A tiny policy that has learnt the episode: the call, then (after the tool's result) "7"."""
  # The call is in the tokenizer's corpus, so it is a few tokens and the policy samples it reliably.
  tok = tokenizer_lib.train_bpe(str(tmp_path_factory.mktemp("tok")), testing.corpus() + [CALL] * 200,
                                vocab_size=400, chat_template=tokenizer_lib.CHATML_TOOLS_TEMPLATE)
  end = tok.convert_tokens_to_ids("<|im_end|>")
  text = tokenizer_lib.render(tok, [{"role": "user", "content": "Add 3 and 4."}], True, tools=[ADD])
  prompt = tok(text, add_special_tokens=False)["input_ids"]
  turn1 = tok(CALL, add_special_tokens=False)["input_ids"] + [end]
  obs = render.observation_tokens(tok, [{"role": "tool", "content": "7"}], ended_with="<|im_end|>", tools=[ADD])
  rows = [(prompt, turn1), (prompt + turn1 + obs, tok("7", add_special_tokens=False)["input_ids"] + [end])]
  cfg = testing.tiny_model_config(vocab_size=len(tok), embed_dim=64, mlp_dim=128)
  params, _ = testing.memorized_model(cfg, rows, steps=150)
  return tok, cfg, params, prompt, obs


def make_rollout(tok, cfg, agent, turn_tokens=96):
  eos = tokenizer_lib.eos_ids(tok)
  sc = sampling.SamplerConfig(max_new_tokens=192, temperature=TEMPERATURE, eos_ids=eos, pad_id=tok.pad_token_id)
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  return rollout.Rollout(tok, cfg, mesh, rollout.RolloutConfig(max_prompt_len=256, turn_tokens=turn_tokens, slots=4,
                                                                filter_metric="score"),
                         sc, env=functools.partial(harness_lib.HarnessEnv, harness=agent, timeout_s=60),
                         episode_cfg=episodes.EpisodeConfig(max_turns=3, timeout_s=60, poll_steps=4)), mesh


def test_the_trained_row_is_what_the_engine_sampled_and_one_update_runs(setup):
  tok, cfg, params, prompt, obs = setup
  SEEN.clear()
  r, mesh = make_rollout(tok, cfg, calc_agent)
  examples = [data.Example(messages=[{"role": "user", "content": "Add 3 and 4."}], ground_truth="7", data_source="t",
                           index=i) for i in range(2)]
  G = 2
  groups, info = r.groups(params, examples, G, jax.random.key(0))
  r.episodes.close()
  assert r.episodes.counts["errors"] == 0 and r.episodes.counts["timeouts"] == 0, r.episodes.last_error
  P = groups.prompt_QP.shape[1]
  prompt_P = groups.prompt_QP[0][groups.prompt_mask_QP[0]]
  np.testing.assert_array_equal(prompt_P, prompt)        # The prompt is the harness's first request.
  tokens = groups.tokens_QGC.reshape(4, -1)
  policy = groups.policy_QGC.reshape(4, -1)
  lengths = groups.mask_QGC.reshape(4, -1).sum(1)
  logp = groups.logp_QGC.reshape(4, -1)
  solved = 0
  for b in range(4):
    n = int(lengths[b])
    gaps = np.flatnonzero(np.diff(policy[b, :n].astype(int)) == -1) + 1
    for start in gaps:  # Each observation is the harness's new message alone, rendered by the template.
      stop = start + int(np.argmax(policy[b, start:n]))
      np.testing.assert_array_equal(tokens[b, start:stop], obs)
      assert (logp[b, start:stop] == 0).all()
    solved += groups.score_QG.reshape(-1)[b] == 1.0
  assert solved >= 2, (groups.score_QG, SEEN)                    # The learnt episode: call, result, "7".
  # What the harness received is the text of the turns the engine sampled.
  turns = []
  for b in range(4):
    n, p = int(lengths[b]), policy[b]
    edges = np.flatnonzero(np.diff(np.concatenate([[0], p[:n].astype(int), [0]])))
    for s, e in zip(edges[::2], edges[1::2]):
      text = tok.decode(tokens[b, s:e - 1] if tokens[b, e - 1] == tok.convert_tokens_to_ids("<|im_end|>")
                        else tokens[b, s:e], skip_special_tokens=False)
      turns.append(text)
  def as_text(m):  # A message as the policy wrote it: a call in the qwen format, or the content.
    if "tool_calls" not in m:
      return m["content"]
    calls = [ToolCall(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m["tool_calls"]]
    return tool_formats.render_tool_calls(calls, "qwen")
  assert sorted(as_text(m) for m in SEEN) == sorted(turns)
  assert sum("tool_calls" in m for m in SEEN) >= 2
  # The recorded log-probs are the teacher-forced ones of the whole episode at the temperature.
  tokens_BT = np.concatenate([np.repeat(groups.prompt_QP, G, 0), tokens], 1)
  mask_BT = np.concatenate([np.repeat(groups.prompt_mask_QP, G, 0), groups.mask_QGC.reshape(4, -1)], 1)
  logits = np.asarray(model_lib.logits(cfg, params, tokens_BT, mask_BT), np.float64) / TEMPERATURE
  ref = logits - logits.max(-1, keepdims=True)
  ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
  for b in range(4):
    pos = np.flatnonzero(policy[b])
    np.testing.assert_allclose(logp[b, pos], ref[b, P - 1 + pos, tokens[b, pos]], atol=2e-5)
  # One update on the batch: the loss mask is the policy's tokens.
  batch, _ = advantages.to_train_batch(groups, 2, P, norm_adv_by_std=True, overlong_filter=False)
  np.testing.assert_array_equal(batch.loss_mask_BC, policy)
  trainer = train_step.Trainer(cfg, optim.OptimConfig(lr=1e-3, warmup_steps=0), mesh,
                               objectives.policy_gradient(cfg, objectives.PGConfig()))
  state = trainer.init(jax.random.key(0)).replace(params=jax.tree.map(np.array, params))  # (The step donates.)
  new_state, metrics = trainer.step(state, batch)
  assert np.isfinite(float(metrics["loss"]))


def test_a_harness_that_rewrites_the_history_fails_its_episode(setup):
  tok, cfg, params, _, _ = setup
  r, _ = make_rollout(tok, cfg, rewriting_agent)
  examples = [data.Example(messages=[{"role": "user", "content": "Add 3 and 4."}], ground_truth="7", data_source="t",
                           index=0)]
  groups, _ = r.groups(params, examples, 2, jax.random.key(1))
  r.episodes.close()
  assert r.episodes.counts["errors"] == 2 and "changed the conversation at message 1" in r.episodes.last_error
  assert (groups.score_QG == -1.0).all()


def test_a_command_harness_talks_through_the_environment_variables(setup, tmp_path):
  tok, cfg, params, _, _ = setup
  agent = tmp_path / "agent.py"
  agent.write_text(
      "import json, os, openai\n"
      "ex = json.loads(os.environ['DAPO_EXAMPLE'])\n"
      "c = openai.OpenAI(max_retries=0)\n"
      "m = c.chat.completions.create(model='policy', messages=ex['messages'], tools=%r).choices[0].message\n"
      "print(json.dumps({'score': float(bool(m.tool_calls)), 'acc': bool(m.tool_calls), 'pred': 'call'}))\n" % [ADD])
  eos = tokenizer_lib.eos_ids(tok)
  r, _ = make_rollout(tok, cfg, None)
  r.episodes.make_env = functools.partial(harness_lib.HarnessEnv, command=[sys.executable, str(agent)], timeout_s=60)
  examples = [data.Example(messages=[{"role": "user", "content": "Add 3 and 4."}], ground_truth="7", data_source="t",
                           index=0)]
  groups, _ = r.groups(params, examples, 2, jax.random.key(2))
  r.episodes.close()
  assert r.episodes.counts["errors"] == 0, r.episodes.last_error
  assert (groups.score_QG == 1.0).all() and eos, r.last_stats.get("episode_rewards")


FINISH = []   # The finish reasons the agent below received.


def finish_agent(base_url, api_key, example):
  """Asks once, keeps the answer's finish reason."""
  client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
  choice = client.chat.completions.create(model="policy", messages=list(example.messages), tools=[ADD]).choices[0]
  with SEEN_LOCK:
    FINISH.append(choice.finish_reason)
  return 0.0


def test_a_turn_cut_by_its_budget_reaches_the_harness_as_finish_reason_length(setup):
  """A policy turn that hit its token budget (`rollout.max_new_tokens` per turn) is "length", as
  OpenAI reports it; a turn the policy ended is not."""
  tok, cfg, params, _, _ = setup
  examples = [data.Example(messages=[{"role": "user", "content": "Add 3 and 4."}], ground_truth="7", data_source="t",
                           index=0)]
  for turn_tokens in (1, 96):
    FINISH.clear()
    r, _ = make_rollout(tok, cfg, finish_agent, turn_tokens=turn_tokens)
    r.groups(params, examples, 2, jax.random.key(4))
    r.episodes.close()
    assert r.episodes.counts["errors"] == 0, r.episodes.last_error
    assert len(FINISH) == 2
    if turn_tokens == 1:  # The call needs more than one token.
      assert FINISH == ["length", "length"], FINISH
    else:
      assert "length" not in FINISH, FINISH


EXAMPLE = {"messages": [{"role": "user", "content": "Add 3 and 4."}]}


def gone(pid: int) -> bool:
  """Whether a process has ended (a zombie waiting for its parent has)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] == "Z"
  except FileNotFoundError:
    return True


def test_a_command_gets_a_minimal_environment_not_the_trainers(tmp_path, monkeypatch):
  monkeypatch.setenv("DAPO_TEST_SECRET", "hunter2")
  monkeypatch.setenv("DAPO_TEST_PASSED", "yes")
  out = tmp_path / "env.json"
  script = f"import json, os; json.dump(dict(os.environ), open({str(out)!r}, 'w'))"
  env = harness_lib.HarnessEnv(command=[sys.executable, "-c", script], timeout_s=60, pass_env=["DAPO_TEST_PASSED"])
  with pytest.raises(harness_lib.HarnessError, match="ended without asking"):
    env.reset(EXAMPLE)
  env.close()
  seen = json.loads(out.read_text())
  assert "DAPO_TEST_SECRET" not in seen and seen["DAPO_TEST_PASSED"] == "yes"
  assert json.loads(seen["DAPO_EXAMPLE"]) == EXAMPLE and seen["OPENAI_BASE_URL"].endswith("/v1")
  allowed = set(harness_lib.COMMAND_ENV) | {"DAPO_TEST_PASSED", "OPENAI_BASE_URL", "OPENAI_API_KEY", "DAPO_EXAMPLE",
                                            "LC_CTYPE"}  # (Python sets LC_CTYPE itself under a C locale.)
  assert set(seen) <= allowed, set(seen) - allowed


def test_a_command_past_its_timeout_leaves_no_process_behind(tmp_path):
  """Its process group is killed: a background child that holds its output, and one that does not
  (left running by a command that ended), go with it."""
  spawn = ("import subprocess, sys, time\n"
           "child = subprocess.Popen(['sleep', '300']{detach})\n"
           "open(sys.argv[1], 'w').write(str(child.pid))\n"
           "time.sleep({sleep})\n")
  for detach, sleep in [("", 300), (", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL", 0)]:
    pidfile = tmp_path / f"child{sleep}.pid"
    env = harness_lib.HarnessEnv(command=[sys.executable, "-c", spawn.format(detach=detach, sleep=sleep),
                                          str(pidfile)], timeout_s=2)
    with pytest.raises(harness_lib.HarnessError, match="no request" if sleep else "ended without asking"):
      env.reset(EXAMPLE)
    pids = [env.proc.pid, int(pidfile.read_text())]
    deadline = time.monotonic() + 20
    while not all(gone(p) for p in pids) and time.monotonic() < deadline:
      time.sleep(0.1)
    env.close()
    assert all(gone(p) for p in pids), [(p, gone(p)) for p in pids]


def test_each_episode_has_its_own_token_and_malformed_requests_are_a_400():
  gw = gateway_lib.gateway()
  a, b = gw.open(), gw.open()
  try:
    models = lambda ep, token: httpx.get(gw.url_for(ep.eid) + "/models", headers={"Authorization": f"Bearer {token}"},
                                         timeout=10)
    assert models(a, a.token).status_code == 200 and models(b, b.token).status_code == 200
    assert models(b, a.token).status_code == 401 and models(a, b.token).status_code == 401
    a_on_b = openai.OpenAI(base_url=gw.url_for(b.eid), api_key=a.token, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
      a_on_b.chat.completions.create(model="policy", messages=EXAMPLE["messages"])
    b_client = openai.OpenAI(base_url=gw.url_for(b.eid), api_key=b.token, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
      b_client.chat.completions.create(model="policy", messages=[{"role": "assistant", "tool_calls": "x"}])
    assert e.value.body.get("error", e.value.body)["param"] == "messages[0].tool_calls"
    r = httpx.post(gw.url_for(b.eid) + "/chat/completions", timeout=10,  # (A lone surrogate as its JSON escape.)
                   content='{"messages": [{"role": "user", "content": "\\ud800"}]}',
                   headers={"Authorization": f"Bearer {b.token}", "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content", r.text
    assert a.inbox.empty() and b.inbox.empty()   # Nothing reached either episode.
  finally:
    gw.close_episode(a)
    gw.close_episode(b)


def test_an_episode_closed_while_its_harness_waits_answers_it_at_once():
  """The run that only gives a group its prompt is closed with the harness's first request in hand: the
  harness gets a 410 at once, not its client's timeout."""
  seen = {}

  def waiting_agent(base_url, api_key, example):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
    t0 = time.perf_counter()
    try:
      client.chat.completions.create(model="policy", messages=example["messages"])
    except openai.APIStatusError as e:
      seen["status"], seen["s"] = e.status_code, time.perf_counter() - t0
    return 0.0

  env = harness_lib.HarnessEnv(harness=waiting_agent, timeout_s=60)
  assert env.reset(EXAMPLE)[-1]["content"] == EXAMPLE["messages"][-1]["content"]
  env.close()
  deadline = time.time() + 30
  while "status" not in seen and time.time() < deadline:
    time.sleep(0.05)
  assert seen.get("status") == 410 and seen["s"] < 30, seen
