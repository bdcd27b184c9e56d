"""An environment that is an outside program: a harness drives each episode through the OpenAI
chat API, and the policy being trained answers its requests.

    rollout.env="dapo_jax.serve.harness:HarnessEnv"
    rollout.env_args='{"harness": "my_agents.calc:solve"}'        # solve(base_url, api_key, example) -> reward
    rollout.env_args='{"command": ["python", "agent.py"]}'        # a program: OPENAI_BASE_URL, OPENAI_API_KEY
                                                                  # and DAPO_EXAMPLE (JSON) in its environment;
                                                                  # its last line of stdout is the reward

A command runs in its own process group with a minimal environment (`COMMAND_ENV` and the names in
`pass_env`, not the trainer's, which may hold credentials); the whole group is killed when it
overruns `timeout_s` or its episode ends, so a background child it started does not outlive it.
Each episode has its own gateway token: one episode's harness cannot post to another's URL.

The harness's first request is the episode's prompt (messages and tools). Each later request
carries the whole conversation back; only the messages after the policy's last turn are new, and
only they are rendered (`envs.render`): the earlier turns stay the tokens the engine sampled, so
training scores exactly what was sampled, never a re-tokenisation of what the client sent back. A
harness that changes the history it was given fails its episode, saying at which message.

A group's prompt comes from one harness run's first request (`reset` is called for it and the run
dropped), so a harness must open an episode the same way for the same example.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading

from dapo_jax.envs import base as env_lib
from dapo_jax.envs import tool_formats
from dapo_jax.serve import gateway as gateway_lib
from dapo_jax.serve import http, openai_messages

COMMAND_ENV = ("PATH", "HOME", "LANG")   # what a command gets of the trainer's environment, besides pass_env


class HarnessError(RuntimeError):
  """The harness did something an episode cannot follow (no request, a changed history, a crash)."""


def _example_json(example) -> str:
  if hasattr(example, "messages"):  # A data.Example.
    return json.dumps({"messages": example.messages, "ground_truth": example.ground_truth,
                       "data_source": example.data_source, "index": example.index})
  return json.dumps(example)


def _same(sent: dict, got: dict) -> bool:
  """Whether a message the harness sent back is the one it was given (an assistant message: the
  same text, the same calls; the client's ids and JSON spacing may differ)."""
  if sent.get("role") != got.get("role") or (sent.get("content") or "") != (got.get("content") or ""):
    return False
  calls = lambda m: [(c["function"]["name"], json.loads(c["function"].get("arguments") or "{}")
                      if isinstance(c["function"].get("arguments"), str) else c["function"].get("arguments"))
                     for c in m.get("tool_calls") or []]
  return calls(sent) == calls(got)


class HarnessEnv(env_lib.Env):
  """One episode driven by a harness: `harness` ('module:function' or the function itself, called
  in a thread as function(base_url, api_key, example) -> reward) or `command` (a program run per
  episode, in its own process group, with `COMMAND_ENV`, the variables named in `pass_env` and the
  episode's OPENAI_BASE_URL, OPENAI_API_KEY, DAPO_EXAMPLE). `timeout_s` bounds the wait for the
  harness's next request or its end (a command's group is killed then)."""

  def __init__(self, harness: str = "", command=None, timeout_s: float = 300.0, pass_env=()):
    if bool(harness) == bool(command):
      raise ValueError("rollout.env_args: give one of harness='module:function' or command=[...]")
    self.fn = None
    if harness:
      self.fn = harness if callable(harness) else env_lib.import_object(harness, "rollout.env_args harness")
    self.command = [command] if isinstance(command, str) else command
    self.pass_env = (pass_env,) if isinstance(pass_env, str) else tuple(pass_env)
    self.timeout_s = timeout_s
    self.ep = None
    self.reply = None  # The answer to the harness's request in hand (until the policy's turn is sent).
    self.proc = None
    self._group_gone = False

  # --- the harness's side ----------------------------------------------------------------------

  def _run(self, example, url: str, key: str) -> None:
    try:
      if self.fn is not None:
        result = self.fn(url, key, example)
      else:
        env = {k: os.environ[k] for k in COMMAND_ENV + self.pass_env if k in os.environ}
        env.update(OPENAI_BASE_URL=url, OPENAI_API_KEY=key, DAPO_EXAMPLE=_example_json(example))
        self._group_gone = False
        self.proc = subprocess.Popen(self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        try:
          out, err = self.proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:  # It, or a background child holding its pipes, ran on.
          self._kill_group()
          out, err = self.proc.communicate(timeout=10)
          if self.proc.returncode < 0:
            raise HarnessError(f"harness {self.command} did not end within {self.timeout_s:.0f}s (killed with "
                               "its process group)") from None
        self._kill_group()  # What it left running in the background.
        if self.proc.returncode != 0:
          raise HarnessError(f"harness {self.command} exited with {self.proc.returncode}: {err.strip()[-300:]}")
        lines = out.strip().splitlines()
        result = json.loads(lines[-1]) if lines else None
      self.ep.inbox.put(("end", result))
    except BaseException as e:  # noqa: BLE001 (reported to the episode, which fails with it)
      self.ep.inbox.put(("error", f"{type(e).__name__}: {e}"))

  def _next(self):
    """The harness's next request (body, reply), or ("end", reward)."""
    try:
      item = self.ep.inbox.get(timeout=self.timeout_s)
    except queue.Empty:
      raise HarnessError(f"the harness made no request and did not end within {self.timeout_s:.0f}s") from None
    if item is None:
      raise HarnessError("the episode was closed")
    if item[0] == "error":
      raise HarnessError(f"the harness failed: {item[1]}")
    return item

  def _request(self, body: dict) -> list[dict]:
    if not isinstance(body.get("messages"), list) or not body["messages"]:
      raise HarnessError("the harness sent a request without messages")
    return [openai_messages.normalize_message(m, i) for i, m in enumerate(body["messages"])]

  # --- the environment's side -----------------------------------------------------------------

  def reset(self, example) -> list[dict]:
    gw = gateway_lib.gateway()
    self.ep = gw.open()
    self.fmt = tool_formats.detect(self.tokenizer) if self.tokenizer is not None else "qwen"
    threading.Thread(target=self._run, args=(example, gw.url_for(self.ep.eid), self.ep.token), daemon=True,
                     name="harness").start()
    item = self._next()
    if item[0] == "end":
      raise HarnessError("the harness ended without asking the policy anything")
    body, self.reply = item
    self.messages = self._request(body)
    self.tools = body.get("tools") or None
    return list(self.messages)

  def step(self, assistant_text: str):
    message, finish = openai_messages.assistant_message(assistant_text, self.tools, self.fmt)
    if self.turn_truncated:  # The turn hit its token budget: OpenAI's "length", whatever it holds.
      finish = "length"
    n = len(self.tokenizer(assistant_text, add_special_tokens=False)["input_ids"]) if self.tokenizer else 0
    reply, self.reply = self.reply, None
    reply(gateway_lib.chat_completion(message, finish, {"prompt_tokens": 0, "completion_tokens": n,
                                                        "total_tokens": n}))
    self.messages.append(message)
    item = self._next()
    if item[0] == "end":
      return None, item[1], {}
    body, self.reply = item
    got = self._request(body)
    for i, sent in enumerate(self.messages):
      if i >= len(got) or not _same(sent, got[i]):
        raise HarnessError(f"the harness changed the conversation at message {i} (it must send back the history "
                           "it was given, the policy's turns as answered)")
    if len(got) == len(self.messages):
      raise HarnessError("the harness asked again without adding a message")
    new = got[len(self.messages):]
    self.messages = got
    return [{"role": m["role"], "content": m["content"], **({"name": m["name"]} if "name" in m else {})}
            for m in new], None, {}

  def close(self) -> None:
    """Ends the episode: the request in hand, if any, and any later one are answered 410 at once (a
    harness never waits out its client's timeout on an episode that has ended, as the run that only
    gives a group its prompt does)."""
    if self.reply is not None:
      reply, self.reply = self.reply, None
      reply(http.APIError(410, f"episode {self.ep.eid} has ended", code="episode_ended"))
    if self.ep is not None:
      gateway_lib.gateway().close_episode(self.ep)
    self._kill_group()

  def _kill_group(self) -> None:
    """Kills the command's process group: it, and what it started (that did not leave the group).
    Once its leader has been reaped and the group killed, never again (its id could be reused)."""
    if self.proc is None or self._group_gone:
      return
    try:
      os.killpg(self.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # Gone already.
      pass
    self._group_gone = self.proc.poll() is not None

