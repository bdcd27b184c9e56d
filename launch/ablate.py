"""Run an ablation: every stage of a config, several seeds each, from one shared warm start.

  python -m launch.ablate --config=configs/ablation.py --seeds=3 --workdir=runs/ablation
  python -m launch.ablate --config=configs/ablation.py:runlocal --stages=naive_grpo,dapo --seeds=1

Stage s is the config file's `get_config("stage=s,<its argument>")` with the `--config.x=y`
overrides applied; the argument's `task` is `arith` (the built-in task) unless it names another.
Writes WORKDIR/table.md, table.json and curves.png; the same command resumes, and finished runs are
not re-run (dapo_jax/builders/ablation.py).
"""
import importlib.util
import os
import sys

from absl import flags
from ml_collections import config_flags

from . import common

_CONFIG = common.define_config(os.path.join(common.REPO, "configs", "ablation.py"))
_SEEDS = flags.DEFINE_integer("seeds", 3, "Seeds per stage (0, 1, ...).", lower_bound=1)
_STAGES = flags.DEFINE_list("stages", None, "Stages to run (default: the config file's STAGES, in order).")
_WORKDIR = flags.DEFINE_string("workdir", os.path.join("runs", "ablation"), "Runs, table and plot.")


def stage_configs(path: str, overrides: dict, stages=None) -> dict:
  """{stage: ConfigDict} of the config file `path` ('file.py[:arg]'), with `overrides` applied."""
  file, _, arg = path.partition(":")
  spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(file))[0], file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  parts = [p for p in arg.split(",") if p]
  if not any(p.startswith("task=") for p in parts):
    parts.append("task=arith")
  out = {}
  unknown = [s for s in stages or () if s not in module.STAGES]
  if unknown:
    raise ValueError(f"--stages: {unknown[0]!r} is not a stage of {file}; expected some of {module.STAGES}")
  for stage in stages or module.STAGES:
    cfg = module.get_config(",".join(parts + [f"stage={stage}"]))
    for key, value in overrides.items():
      *groups, name = key.split(".")
      node = cfg
      for g in groups:
        node = node[g]
      node[name] = value
    cfg.lock()
    out[stage] = cfg
  return out


def main(argv):
  del argv
  common.init_distributed()
  from dapo_jax import builders  # After distributed init.
  from dapo_jax.builders import ablation
  flag = flags.FLAGS["config"]
  try:
    cfgs = stage_configs(config_flags.get_config_filename(flag), config_flags.get_override_values(flag),
                         _STAGES.value)
  except ValueError as e:
    raise builders.ConfigError(str(e)) from None
  for cfg in cfgs.values():
    builders.validate(cfg)  # Every stage, before the first one trains.
  import jax
  if not jax.config.jax_compilation_cache_dir:  # The seeds of a stage compile the same programs.
    jax.config.update("jax_compilation_cache_dir", os.path.join(_WORKDIR.value, "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  try:
    t = ablation.run(cfgs, _SEEDS.value, _WORKDIR.value)
  except ablation.Interrupted as e:
    print(e, file=sys.stderr)
    sys.exit(1)
  with open(os.path.join(_WORKDIR.value, "table.md")) as f:
    print(f.read())
  if not t["plotted"]:
    print('curves.png needs matplotlib: pip install -e ".[plot]", then the same command again')


if __name__ == "__main__":
  common.run(main)
