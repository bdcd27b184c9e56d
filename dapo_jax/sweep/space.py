"""A sweep's search space: what `--space=KEY=SPEC` (repeatable) says, or a recipe's `sweep(add)`.

  dapo.eps_high=[0.2,0.28,0.35]     choices: numbers, true/false/none, or words; every sampler, the grid too
  optim.lr=log(1e-5,1e-3)           a float drawn log-uniformly between the bounds (random, tpe)
  dapo.eps_high=range(0.2,0.4)      a float drawn uniformly
  dapo.eps_high=range(0.2,0.4,0.05) ... on a step of 0.05 from the low bound
  train.minibatches=range(1,4)      integers when both bounds are integers (both included)
  :stage=[naive_grpo,dapo]          a leading ':' names an argument of the config file (file.py:stage=dapo)

A setting is one value per key; a trial runs one setting with one seed. `overrides(params)` turns the
sampler's values into a run's config: `--config.KEY=VALUE` flags and config-file arguments.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
from typing import Any, Callable, Mapping, Sequence

Value = Any  # int | float | bool | str | None: what a grid and the study's database hold
_CALL = re.compile(r"^(range|log)\((.*)\)$")
_KEY = re.compile(r"^:?[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
POINT = "point"  # the one parameter of a recipe's explicit settings: the index of the setting


@dataclasses.dataclass(frozen=True)
class Param:
  """One searched key: `choices`, or a range [low, high] (`log`: log-uniform; `step`: on a grid)."""
  key: str
  choices: tuple = ()
  low: float | int | None = None
  high: float | int | None = None
  step: float | int | None = None
  log: bool = False

  @property
  def integer(self) -> bool:
    return not self.choices and all(isinstance(v, int) for v in (self.low, self.high)) and \
        (self.step is None or isinstance(self.step, int))

  def suggest(self, trial) -> Value:
    """This key's value for an optuna trial (the sampler's choice, or an enqueued trial's fixed one)."""
    if self.choices:
      return trial.suggest_categorical(self.key, list(self.choices))
    if self.integer:
      return trial.suggest_int(self.key, self.low, self.high, step=self.step or 1, log=self.log)
    return trial.suggest_float(self.key, float(self.low), float(self.high), step=self.step, log=self.log)


@dataclasses.dataclass(frozen=True)
class Space:
  """The searched keys; or, from a recipe's `sweep(add)`, a list of explicit settings (`points`)."""
  params: tuple[Param, ...]
  points: tuple[Mapping[str, Value], ...] = ()

  @property
  def grid(self) -> dict[str, list] | None:
    """{key: choices} for optuna's GridSampler; None when a key is a range."""
    if any(not p.choices for p in self.params):
      return None
    return {p.key: list(p.choices) for p in self.params}

  @property
  def size(self) -> int | None:
    """How many settings the grid holds (None: a range makes it unbounded)."""
    grid = self.grid
    return None if grid is None else math.prod(len(v) for v in grid.values())

  def grid_points(self) -> list[dict[str, Value]]:
    """Every setting of the grid as {key: value}, the first key varying slowest, values as listed."""
    grid = self.grid
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]

  def suggest(self, trial) -> dict[str, Value]:
    """The trial's setting, as the sampler picks it: {optuna parameter: value}."""
    return {p.key: p.suggest(trial) for p in self.params}

  def overrides(self, params: Mapping[str, Value]) -> dict[str, Value]:
    """{config key: value} of a setting (a recipe's point, or the parameters themselves)."""
    if self.points:
      return dict(self.points[int(params[POINT])])
    return {p.key: params[p.key] for p in self.params}


def parse_value(text: str) -> Value:
  """'3' -> 3, '1e-4' -> 0.0001, 'true' -> True, 'none' -> None, "'a'" or 'a' -> 'a'."""
  text = text.strip()
  low = text.lower()
  if low in ("true", "false"):
    return low == "true"
  if low == "none":
    return None
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
    return text[1:-1]
  return text


def parse(spec: str) -> Param:
  """One `--space` value, 'KEY=SPEC', as the module docstring writes it."""
  key, eq, body = spec.partition("=")
  key, body = key.strip(), body.strip()
  where = f"--space={spec!r}"
  if not eq or not _KEY.match(key):
    raise ValueError(f"{where}: expected KEY=[a,b,...], KEY=range(low,high[,step]) or KEY=log(low,high), KEY a "
                     "config field (dapo.eps_high) or a config-file argument (:stage)")
  if body.startswith("[") and body.endswith("]"):
    choices = tuple(parse_value(v) for v in body[1:-1].split(",") if v.strip())
    if not choices:
      raise ValueError(f"{where}: no choices between the brackets")
    if len(set(map(repr, choices))) != len(choices):
      raise ValueError(f"{where}: a choice is listed twice")
    return Param(key, choices=choices)
  call = _CALL.match(body)
  if not call:
    raise ValueError(f"{where}: expected [a,b,...], range(low,high[,step]) or log(low,high) after '='")
  kind, args = call.group(1), [parse_value(a) for a in call.group(2).split(",")]
  if not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args) or \
      len(args) not in ((2, 3) if kind == "range" else (2,)):
    raise ValueError(f"{where}: {kind}() takes {'two or three numbers' if kind == 'range' else 'two numbers'}")
  low, high, *step = args
  if not low < high:
    raise ValueError(f"{where}: the low bound {low} is not below the high bound {high}")
  if kind == "log" and low <= 0:
    raise ValueError(f"{where}: log() needs a positive low bound, got {low}")
  if step and step[0] <= 0:
    raise ValueError(f"{where}: the step {step[0]} is not positive")
  return Param(key, low=low, high=high, step=step[0] if step else None, log=kind == "log")


def from_specs(specs: Sequence[str]) -> Space:
  """The space of the repeated `--space` flags; a key given twice is an error."""
  params = tuple(parse(s) for s in specs)
  keys = [p.key for p in params]
  twice = sorted({k for k in keys if keys.count(k) > 1})
  if twice:
    raise ValueError(f"--space: {twice[0]} is given more than once")
  return Space(params)


def from_recipe(sweep: Callable) -> Space:
  """The settings a recipe's `sweep(add)` adds (`add(**{"dapo.eps_high": 0.28})` once per setting), as
  one choice over them: the grid runs each once."""
  points = []
  sweep(lambda **overrides: points.append(dict(overrides)))
  if not points:
    raise ValueError("the config file's sweep(add) added no setting")
  return Space((Param(POINT, choices=tuple(range(len(points)))),), tuple(points))


def label(overrides: Mapping[str, Value]) -> str:
  """A setting's name, e.g. 'dapo.eps_high=0.28,optim.lr=0.0001' or 'stage=dapo' (a file argument): the
  table's row and the trials' directory (WORKDIR/trials/<label>/seed<k>)."""
  text = ",".join(f"{k.lstrip(':')}={v!r}" if isinstance(v, float) else f"{k.lstrip(':')}={v}"
                  for k, v in overrides.items())
  return re.sub(r"[^A-Za-z0-9_.,=+\-]", "_", text) or "default"


def command_args(overrides: Mapping[str, Value]) -> tuple[list[str], list[str]]:
  """(config-file arguments 'k=v', '--config.k=v' flags) of a setting."""
  file_args, flags = [], []
  for key, value in overrides.items():
    text = value if isinstance(value, str) else repr(value)
    if key.startswith(":"):
      file_args.append(f"{key[1:]}={text}")
    else:
      flags.append(f"--config.{key}={text}")
  return file_args, flags
