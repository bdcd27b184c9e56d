"""Environments of the `verifiers` library (prime-rl's environments hub) as training environments.

    rollout.env="dapo_jax.serve.verifiers_env:VerifiersEnv"
    rollout.env_args='{"environment": "dapo_jax.serve.verifiers_env:arith_exact_match"}'   # module:function
    rollout.env_args='{"environment": "my-env", "env_args": {"difficulty": 2}}'   # vf.load_environment's id

A verifiers environment drives an OpenAI client: its rollout logic (one turn, several, tools) talks to
the episode gateway (`serve.harness`), which answers each request with the engine's sample of the
policy being trained, so the trained row is exactly what the engine sampled (token-in/token-out),
and the environment's rubric scores the rollout: that score is the episode's reward. Rollout errors
and timeouts are the harness's: the episode fails (`env/errors`) and leaves the loss by default;
an empty reply, which ends a verifiers rollout with an error, is the policy's and is scored
(`POLICY_ERRORS`).

Each episode's input is one of the run's examples: its messages as the prompt (after the
environment's `system_prompt`, if it has one), its ground truth as the `answer`. The sampler is the
rollout's (the gateway ignores a request's sampling fields).

Needs `pip install -e ".[verifiers]"` (verifiers 0.2, the library's Environment / Rubric API).
"""
from __future__ import annotations

import asyncio
import json
import re
import signal
import threading

from dapo_jax.envs import base as env_lib
from dapo_jax.serve import harness as harness_lib


class VerifiersEnv(harness_lib.HarnessEnv):
  """One episode run by a verifiers environment: `environment` is 'module:function' (called with
  `env_args`, returning a `verifiers.Environment`) or the id of an installed environment
  (`verifiers.load_environment(id, **env_args)`); `timeout_s` bounds each wait on it."""

  def __init__(self, environment: str, env_args: dict | None = None, timeout_s: float = 300.0):
    try:
      import verifiers as vf
    except ImportError:
      raise ImportError("rollout.env=...verifiers_env:VerifiersEnv needs the 'verifiers' package: "
                        "pip install -e '.[verifiers]'") from None
    self.vf = vf
    self.environment = _environment(environment, json.dumps(env_args or {}, sort_keys=True))
    super().__init__(harness=self._solve, timeout_s=timeout_s)

  def _input(self, example) -> dict:
    """The environment's rollout input for one of the run's examples."""
    system = getattr(self.environment, "system_prompt", None)
    prompt = ([{"role": "system", "content": system}] if system else []) + [dict(m) for m in example.messages]
    return {"prompt": prompt, "answer": str(example.ground_truth), "example_id": int(example.index), "info": {}}

  def _solve(self, base_url: str, api_key: str, example) -> float:
    """One rollout against this episode's gateway URL; its rubric's reward."""
    from openai import AsyncOpenAI

    async def run():
      async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=self.timeout_s) as openai:
        client = self.vf.OpenAIChatCompletionsClient(openai)
        return await self.environment.run_rollout(self._input(example), client, "policy", {})

    out = asyncio.run(run())
    error = out.get("error")
    if error and (error.get("error") if isinstance(error, dict) else None) not in POLICY_ERRORS:
      raise harness_lib.HarnessError(f"the verifiers rollout failed: {str(error)[:300]}")
    return float(out.get("reward") or 0.0)


# Rollout errors that are the policy's doing, not the environment's: the episode is scored (its rubric
# on what there is), not failed. An empty reply ends a verifiers rollout with this error.
POLICY_ERRORS = ("EmptyModelResponseError",)

_BUILT: dict = {}
_BUILDING = threading.Lock()


class _NoSignals:
  """`signal` as a verifiers Environment's constructor sees it: installing a handler does nothing."""

  def __getattr__(self, name):
    return getattr(signal, name)

  @staticmethod
  def signal(signum, handler):
    return signal.getsignal(signum)


def _environment(environment: str, env_args_json: str):
  """The verifiers Environment of (environment, env_args), built once for all the run's episodes (they
  run their rollouts on it side by side, each in its own event loop). Its constructor would install
  SIGINT and SIGTERM handlers over the trainer's (and cannot, off the main thread, where episodes
  start): it runs without them."""
  import verifiers as vf
  from verifiers.envs import environment as vf_environment
  with _BUILDING:
    key = (environment, env_args_json)
    if key not in _BUILT:
      env_args = json.loads(env_args_json)
      real, vf_environment.signal = vf_environment.signal, _NoSignals()
      try:
        if ":" in environment:
          built = env_lib.import_object(environment, "rollout.env_args environment")(**env_args)
        else:
          built = vf.load_environment(environment, **env_args)
      finally:
        vf_environment.signal = real
      if not isinstance(built, vf.Environment):
        raise TypeError(f"rollout.env_args environment={environment!r} gave a {type(built).__name__}, not a "
                        "verifiers Environment")
      _BUILT[key] = built
    return _BUILT[key]


_ANSWER = re.compile(r"Answer:\s*(-?[\d,]+)")


def arith_exact_match(system_prompt: str | None = None):
  """A one-turn verifiers environment for the arithmetic task: its rubric gives 1.0 when the number
  after the reply's last "Answer:" is the example's answer, else 0.0 (the dataset is the run's)."""
  import verifiers as vf
  from datasets import Dataset

  def exact_match(completion, answer, **_) -> float:
    if not completion:
      return 0.0
    message = completion[-1] if isinstance(completion, list) else completion
    text = message["content"] if isinstance(message, dict) else getattr(message, "content", message)
    found = _ANSWER.findall(text or "")
    return float(bool(found) and found[-1].replace(",", "") == str(answer).strip())

  placeholder = Dataset.from_list([{"question": "", "answer": ""}])  # Rows come from the run (`_input`).
  return vf.SingleTurnEnv(dataset=placeholder, system_prompt=system_prompt, rubric=vf.Rubric(funcs=[exact_match]))
