"""A sweep's trials from a config file: each (setting, seed) is `launch.train` with the setting's
overrides, in its own process; `run` drives `sweep.study.Sweep` and writes `sweep.report`.

The settings of a sweep share their SFT warm start (`model.init="sft"`) when what the warm start reads
is equal (`start_key`: the model, tokenizer, sft, data and mesh sections, the episodes' fields of rollout,
the seed and `train.microbatch_tokens`; not data's RL-stream fields: its mixing weights and curriculum). It is trained once, by `launch.train --warm_start_only`, into
WORKDIR/starts/<key>/, and every trial starts from it (`model.init="hf"`), so the trials of a setting
differ only in their RL seed, as the paper's ablation runs do. A sweep over a field the warm start reads
(`sft.lr`, `model.num_layers`) trains one start per value.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shlex
import sys
from typing import Callable, Mapping

from dapo_jax import sharding
from dapo_jax.builders import record
from dapo_jax.builders.checks import ConfigError, validate
from dapo_jax.sweep import report as report_lib
from dapo_jax.sweep import space as space_lib
from dapo_jax.sweep import study as study_lib

START_SECTIONS = ("model", "tokenizer", "sft", "data", "mesh")  # what builders.warm_start reads, with
START_ROLLOUT = ("env", "env_args", "max_turns", "turn_stop")    # the episodes' fields its tokenizer reads
# The data fields only the RL stream reads.
START_DATA_RL = ("train_weights", "curriculum", "revisit_after", "curriculum_aside", "curriculum_streak")


def split_config_path(path: str) -> tuple[str, dict[str, str]]:
  """'configs/x.py:a=1,runlocal' -> ('configs/x.py', {'a': '1', 'runlocal': ''})."""
  file, _, arg = path.partition(":")
  args = {}
  for part in (p for p in arg.split(",") if p):
    key, _, value = part.partition("=")
    args[key] = value
  return file, args


def join_config_path(file: str, args: Mapping[str, str]) -> str:
  arg = ",".join(f"{k}={v}" if v != "" else k for k, v in args.items())
  return f"{file}:{arg}" if arg else file


def load_config(file: str, args: Mapping[str, str], overrides: Mapping[str, object]):
  """The config file's `get_config(args)` with `overrides` ({'dapo.eps_high': 0.3}) applied, locked: what
  `launch.train --config=FILE:ARGS --config.k=v` resolves."""
  module = config_module(file)
  arg = join_config_path("", args).removeprefix(":")
  try:
    cfg = module.get_config(arg or None)
  except ValueError as e:
    raise ConfigError(f"--config={join_config_path(file, args)}: {e}") from None
  for key, value in overrides.items():
    *groups, name = key.split(".")
    node = cfg
    try:
      for g in groups:
        node = node[g]
      if name not in node:
        raise KeyError(name)
      node[name] = value
    except (KeyError, TypeError, AttributeError):
      raise ConfigError(f"{key}: names no config field") from None
  cfg.lock()
  return cfg


def config_module(file: str):
  """The config file as a module (its `get_config`, and a recipe's `sweep` or `STAGES`)."""
  if not os.path.isfile(file):
    raise ConfigError(f"--config={file}: no such config file")
  spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(file))[0], file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def start_key(cfg) -> str:
  """A short hash of what the SFT warm start reads: configs with equal keys share one start."""
  d = cfg.to_dict()
  parts = {s: d[s] for s in START_SECTIONS}
  parts["data"] = {k: v for k, v in d["data"].items() if k not in START_DATA_RL}
  parts["rollout"] = {f: d["rollout"][f] for f in START_ROLLOUT}
  parts.update(seed=d["seed"], microbatch_tokens=d["train"]["microbatch_tokens"])
  return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def default_metric(cfg) -> str:
  return f"val/acc/mean@{cfg.eval.k}"


def default_report_every(cfg) -> int:
  """The samples one evaluation interval generates at least: one generation batch per rollout step."""
  d = cfg.dapo
  prompts = d.gen_prompts if d.dynamic_sampling else d.prompts_per_step
  return cfg.train.eval_every * prompts * cfg.rollout.group_size


def check(cfg) -> None:
  """`validate` for the machine the config's mesh names (the sweep's own process sees the CPU only)."""
  validate(cfg, num_devices=sharding.mesh_devices(cfg.mesh))


def check_base(cfg) -> None:
  """The sweep's config, before any setting: checked, with the held-out evaluations a sweep reads."""
  check(cfg)
  if not cfg.train.eval_every:
    raise ConfigError("train.eval_every=0: a sweep reads the held-out evaluations; set train.eval_every "
                      "(--config.train.eval_every=N)")


class Trials:
  """How the sweep in `workdir` runs a trial of the config `path` ('file.py[:args]') with `fixed`
  overrides: `plan(overrides, seed)` for `study.Sweep`."""

  def __init__(self, path: str, fixed: Mapping[str, object], workdir: str, train_module: str,
               launcher: str = ""):
    self.file, self.args = split_config_path(path)
    self.fixed, self.workdir, self.train_module = dict(fixed), workdir, train_module
    self.prefix = shlex.split(launcher)

  def config(self, overrides: Mapping[str, object]):
    file_args = {**self.args, **{k[1:]: str(v) for k, v in overrides.items() if k.startswith(":")}}
    fields = {**self.fixed, **{k: v for k, v in overrides.items() if not k.startswith(":")}}
    return load_config(self.file, file_args, fields), file_args

  def plan(self, overrides: Mapping[str, object], seed: int) -> study_lib.Plan:
    cfg, file_args = self.config(overrides)
    check(cfg)
    config_flag = f"--config={join_config_path(self.file, file_args)}"
    _, setting_flags = space_lib.command_args({k: v for k, v in overrides.items() if not k.startswith(":")})
    _, fixed_flags = space_lib.command_args(self.fixed)
    base = [*self.prefix, sys.executable, "-m", self.train_module, config_flag, *fixed_flags, *setting_flags]
    run_flags = [f"--config.seed={cfg.seed + seed}"]
    start_dir, start_argv = "", ()
    if cfg.model.init == "sft":
      start_dir = os.path.join(self.workdir, "starts", start_key(cfg))
      start_argv = (*base, f"--workdir={start_dir}", "--warm_start_only")
      run_flags += ["--config.model.init=hf", f"--config.model.hf_dir={os.path.join(start_dir, 'sft_model')}"]
    return study_lib.Plan(argv=lambda out: [*base, *run_flags, f"--workdir={out}"], num_steps=cfg.train.num_steps,
                          start_dir=start_dir, start_argv=start_argv)


def run(path: str, fixed: Mapping[str, object], space: space_lib.Space, cfg: study_lib.SweepConfig, workdir: str,
        train_module: str, definition: Mapping, launcher: str = "", env: Mapping[str, str] | None = None,
        name: str = "setting", row: Callable | None = None) -> dict:
  """Runs (or resumes) the sweep and writes its report; returns the report's table (`report.write`).
  Every setting of a grid is checked before the first trial runs."""
  trials = Trials(path, fixed, workdir, train_module, launcher)
  base, _ = trials.config({})
  check_base(base)
  if cfg.sampler in ("auto", "grid") and space.grid is not None:
    for values in space.grid_points():
      check(trials.config(space.overrides(values))[0])
  cfg = dataclasses.replace(cfg, metric=cfg.metric or default_metric(base),
                            report_every=cfg.report_every or default_report_every(base))
  record.lock(workdir)  # One sweep per workdir; its trials lock their own.
  env = dict(os.environ if env is None else env)
  # The trials compile the same programs: one persistent compilation cache for them all.
  env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.abspath(workdir), "jax_cache"))
  env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
  sweep = study_lib.Sweep(cfg, space, workdir, trials.plan, {**definition, "config": path, "fixed": dict(fixed)},
                          env=env)
  records = sweep.run()
  order = [(row or (lambda r: r.setting))(_Overrides(space.overrides(p))) for p in space.grid_points()] \
      if space.grid is not None else []
  return report_lib.write(workdir, records, cfg.metric, name, row, cfg.direction, order)


@dataclasses.dataclass(frozen=True)
class _Overrides:
  """A grid point as `row` reads a trial (its overrides and setting label), for the report's row order."""
  overrides: dict

  @property
  def setting(self) -> str:
    return space_lib.label(self.overrides)


def plan_lines(path: str, fixed: Mapping[str, object], space: space_lib.Space, cfg: study_lib.SweepConfig,
               workdir: str) -> list[str]:
  """What `launch.sweep --dry_run` prints: the trials a sweep would run, each grid setting checked as its
  trial will be (a setting the checks refuse raises ConfigError naming it)."""
  trials = Trials(path, fixed, workdir, "launch.train")
  base, _ = trials.config({})
  check_base(base)
  sampler = cfg.sampler if cfg.sampler != "auto" else ("grid" if space.grid is not None else "tpe")
  lines = []
  if sampler == "grid" and space.grid is not None:
    points = space.grid_points()
    lines.append(f"# {len(points)} settings x {cfg.seeds} seed(s) = {len(points) * cfg.seeds} trials (grid, in "
                 "this order)")
    for point in points:
      overrides = space.overrides(point)
      try:
        plan = trials.plan(overrides, 0)
      except ConfigError as e:
        raise ConfigError(f"--space setting {space_lib.label(overrides)}: {e}") from None
      start = f", warm start {os.path.basename(plan.start_dir)}" if plan.start_dir else ""
      lines.append(f"{space_lib.label(overrides)}  ({plan.num_steps} steps{start})")
  else:
    lines.append(f"# {cfg.trials or '?'} settings drawn by {sampler} x {cfg.seeds} seed(s), from:")
    lines += [f"{p.key}: {list(p.choices) if p.choices else (p.low, p.high, p.step, 'log' if p.log else '')}"
              for p in space.params]
  lines.append(f"# metric {cfg.metric or default_metric(base)} reported every "
               f"{cfg.report_every or default_report_every(base):,} samples; pruner {cfg.pruner}")
  return lines


def recipe_space(file: str) -> space_lib.Space | None:
  """The space of the config file's `sweep(add)`, if it defines one."""
  module = config_module(file)
  return space_lib.from_recipe(module.sweep) if hasattr(module, "sweep") else None
