"""The environment interface: what an episode's other side implements.

    messages = env.reset(example)                # the prompt, as chat messages
    obs, reward, info = env.step(assistant_text) # after each policy turn
        obs:    messages to append (a tool result, a user reply), or None: the episode is over
        reward: the final reward, {"score", "acc", "pred"} (a float is a score), when obs is None
        info:   anything to log (str/number values)

`check_example(example)` (optional) refuses a row the environment could never run; datasets call it
as they load, naming the file and row.

One instance per episode (the runner builds `Class(**rollout.env_args)` for each), so an environment
keeps its episode's state in `self`. Before `reset` the runner sets `env.tokenizer` (the policy's
tokenizer: tool environments read its chat template's format), and before each `step`
`env.turn_truncated` (the turn was cut by its token budget, not ended by the policy). `env.tools`
lists the tool schemas the prompt is rendered with (the chat template's own `tools=` support); None
renders no tools.

Environments are host Python and free of jax: `step` runs in a worker thread while the engine keeps
decoding the other slots, with a timeout; one that raises, hangs or returns garbage ends its episode
and is counted (`env/errors`, `env/timeouts`): by default its row leaves the loss (`rollout.env_error`).
An instance serves one episode: after a reset or step that outlived the timeout it is closed when
that call returns, and never called again.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
from typing import Any, Callable


@dataclasses.dataclass
class StepResult:
  observation: list[dict] | None   # messages appended to the episode; None: the episode ends
  reward: dict | None = None       # {"score", "acc", "pred"} once the episode ends
  info: dict = dataclasses.field(default_factory=dict)


class Env:
  """Base class of environments: override `reset` and `step`."""
  tokenizer = None                 # set by the runner before `reset`
  tools: list[dict] | None = None  # JSON schemas of the tools the prompt offers
  turn_truncated = False           # set by the runner before each `step`: the turn hit its token budget

  def reset(self, example) -> list[dict]:
    """The episode's first messages; by default the example's own (`data.Example.messages`)."""
    return list(example.messages)

  def step(self, assistant_text: str):
    """(observation messages or None when done, reward or None, info) after one policy turn."""
    raise NotImplementedError

  def check_example(self, example) -> None:
    """Raises a ValueError saying what is wrong when this environment could not run `example`.
    Datasets call it on every row as they load, so a bad row is named by file and row at start."""

  def close(self) -> None:
    """Releases the episode's resources (a sandbox, a connection); called once it ends."""


def import_object(path: str, what: str):
  """The object 'package.module:name' names; a ValueError naming `what` (a config field) otherwise."""
  if ":" not in path:
    raise ValueError(f"{what}={path!r} must look like 'package.module:name'")
  module_name, name = path.split(":", 1)
  try:
    return getattr(importlib.import_module(module_name), name)
  except (ImportError, AttributeError) as e:
    raise ValueError(f"{what}={path!r}: cannot import it ({e})") from None


def resolve(path: str, args: str | dict = "{}") -> Callable[[], Env]:
  """'package.module:Class' and its JSON keyword arguments -> a factory of fresh environments; fails
  at start-up naming the path."""
  field = "rollout.env"
  cls = import_object(path, field)
  try:
    kwargs = json.loads(args) if isinstance(args, str) else dict(args)
  except json.JSONDecodeError as e:
    raise ValueError(f"rollout.env_args={args!r} is not a JSON object ({e})") from None
  if not isinstance(kwargs, dict):
    raise ValueError(f"rollout.env_args={args!r} is not a JSON object")
  env = cls(**kwargs)  # Once now: wrong arguments fail at start, not in a worker.
  if not (hasattr(env, "reset") and hasattr(env, "step")):
    raise ValueError(f"{field}={path!r} is not an environment (it needs reset(example) and step(text))")
  return lambda: cls(**kwargs)


@dataclasses.dataclass(frozen=True)
class ToolCall:
  name: str
  arguments: dict


@dataclasses.dataclass
class Tool:
  """A function the policy may call: a JSON schema (name, description, parameters) and the call.

  `fn(**arguments) -> str` is the result shown to the policy (anything else is json-encoded)."""
  name: str
  description: str
  parameters: dict   # JSON schema of the arguments: {"type": "object", "properties": {...}, "required": [...]}
  fn: Callable[..., Any]

  def schema(self) -> dict:
    """The OpenAI / transformers function schema that chat templates render."""
    return {"type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

  def __call__(self, arguments: dict) -> str:
    out = self.fn(**arguments)
    return out if isinstance(out, str) else json.dumps(out)
