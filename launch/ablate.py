"""Run an ablation: every stage of a config, several seeds each, from one shared warm start.

  python -m launch.ablate --config=configs/ablation.py --seeds=3 --workdir=runs/ablation
  python -m launch.ablate --config=configs/ablation.py:runlocal --stages=naive_grpo,dapo --seeds=1

A sweep (launch.sweep) over the config file's argument `stage` on the grid, unpruned: stage s is the
file's `get_config("stage=s,<its argument>")` with the `--config.x=y` overrides applied; the argument's
`task` is `arith` (the built-in task) unless it names another. Writes WORKDIR/table.md, table.json and
curves.png; the same command resumes, and finished runs are not re-run.
"""
import os

from absl import flags

from . import common

_CHILD_ENV = common.watcher_process()

from dapo_jax.sweep.study import SweepConfig  # noqa: E402

_CONFIG = common.define_config(os.path.join(common.REPO, "configs", "ablation.py"))
_SEEDS = flags.DEFINE_integer("seeds", 3, "Seeds per stage (config.seed + 0, 1, ...).", lower_bound=1)
_STAGES = flags.DEFINE_list("stages", None, "Stages to run (default: the config file's STAGES, in order).")
_WORKDIR = flags.DEFINE_string("workdir", os.path.join("runs", "ablation"), "Runs, table and plot.")


def main(argv):
  del argv
  from ml_collections import config_flags

  from dapo_jax.builders import ConfigError
  from dapo_jax.builders import sweep as sweep_builder
  from dapo_jax.sweep import space as space_lib
  file, args = sweep_builder.split_config_path(config_flags.get_config_filename(flags.FLAGS["config"]))
  args.setdefault("task", "arith")
  args.pop("stage", None)
  stages = tuple(sweep_builder.config_module(file).STAGES)
  unknown = [s for s in _STAGES.value or () if s not in stages]
  if unknown:
    raise ConfigError(f"--stages: {unknown[0]!r} is not a stage of {file}; expected some of {stages}")
  space = space_lib.Space((space_lib.Param(":stage", choices=tuple(_STAGES.value or stages)),))
  cfg = SweepConfig(seeds=_SEEDS.value, sampler="grid", pruner="none")
  common.run_sweep(sweep_builder.join_config_path(file, args), space, _WORKDIR.value, cfg,
                   {"space": [f":stage={list(space.params[0].choices)}"]}, _CHILD_ENV, name="stage",
                   row=lambda r: r.overrides[":stage"])


if __name__ == "__main__":
  common.run(main)
