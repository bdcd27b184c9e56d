"""Sweep a config: settings searched by optuna, several seeds each, pruned early on the held-out curve.

  python -m launch.sweep --workdir=runs/sweep --space='dapo.eps_high=[0.28,0.4]' --space='optim.lr=[1e-4,3e-4]' \
      --seeds=2
  python -m launch.sweep --config=configs/dapo_qwen2_5_32b.py --workdir=W          # the recipe's sweep(add)
  python -m launch.sweep --workdir=W --space='optim.lr=log(1e-5,1e-3)' --sampler=tpe --trials=12 --pruner=halving

Each trial is `launch.train` with the setting's `--config.KEY=VALUE` in WORKDIR/trials/<setting>/seed<k>;
`--config.x=y` flags here are fixed for every trial. The study is WORKDIR/study.db: the same command
resumes a killed sweep (finished trials are not rerun, a running one resumes from its checkpoint). At
the end WORKDIR/table.md (printed), table.json and curves.png. The space syntax, the samplers and the
pruning rules: docs/sweeps.md.
"""
import os

from absl import flags

from . import common

_CHILD_ENV = common.watcher_process()

from dapo_jax.sweep.study import SweepConfig  # noqa: E402

_D = SweepConfig()
_CONFIG = common.define_config()
_WORKDIR = flags.DEFINE_string("workdir", None, "The study, its trials, the report (default ./runs/sweep_<config>).")
_SPACE = flags.DEFINE_multi_string("space", [], "KEY=SPEC, repeatable: KEY=[a,b], KEY=range(lo,hi[,step]), "
                                   "KEY=log(lo,hi); :KEY for a config-file argument (default: the config file's "
                                   "sweep(add)).")
_SEEDS = flags.DEFINE_integer("seeds", _D.seeds, "Runs per setting (seeds config.seed + 0..N-1).", lower_bound=1)
_SAMPLER = flags.DEFINE_enum("sampler", _D.sampler, ["auto", "grid", "random", "tpe"],
                             "grid: every setting; auto: grid when every key lists its choices, else tpe.")
_TRIALS = flags.DEFINE_integer("trials", _D.trials, "Settings to try with random / tpe (0: the grid's size).",
                               lower_bound=0)
_PRUNER = flags.DEFINE_enum("pruner", _D.pruner, ["none", "median", "halving"], "Stops trials early: median, "
                            "successive halving, or none.")
_PRUNE_AFTER = flags.DEFINE_integer("prune_after", _D.prune_after, "Finished trials before median pruning starts.",
                                    lower_bound=0)
_PRUNE_WARMUP = flags.DEFINE_integer("prune_warmup", _D.prune_warmup, "Generated samples a trial runs before "
                                     "the median pruner may stop it.", lower_bound=0)
_REDUCTION = flags.DEFINE_integer("reduction_factor", _D.reduction_factor, "Successive halving keeps 1/r of the "
                                  "trials at each budget rung.", lower_bound=2)
_REPORT_EVERY = flags.DEFINE_integer("report_every", _D.report_every, "Generated samples between a trial's reports "
                                     "to the pruner (0: one evaluation interval's).", lower_bound=0)
_METRIC = flags.DEFINE_string("metric", _D.metric, "The held-out metric to optimise (default val/acc/mean@k).")
_DIRECTION = flags.DEFINE_enum("direction", _D.direction, ["maximize", "minimize"], "Of the metric.")
_PARALLEL = flags.DEFINE_integer("parallel", _D.parallel, "Trials at once (each its own process).", lower_bound=1)
_SAMPLER_SEED = flags.DEFINE_integer("sampler_seed", _D.sampler_seed, "The sampler's seed.")
_LAUNCHER = flags.DEFINE_string("launcher", "", "A command each trial runs under, e.g. 'srun -N4 --exclusive' on "
                                "a cluster: it must start the trial on its own slice and pass SIGTERM on.")


def sweep_config() -> SweepConfig:
  return SweepConfig(seeds=_SEEDS.value, sampler=_SAMPLER.value, trials=_TRIALS.value, pruner=_PRUNER.value,
                     prune_after=_PRUNE_AFTER.value, prune_warmup=_PRUNE_WARMUP.value,
                     reduction_factor=_REDUCTION.value,
                     report_every=_REPORT_EVERY.value, metric=_METRIC.value, direction=_DIRECTION.value,
                     parallel=_PARALLEL.value, sampler_seed=_SAMPLER_SEED.value)


def search_space():
  """(config path, space): the --space flags, else the config file's sweep(add)."""
  from ml_collections import config_flags

  from dapo_jax.builders import ConfigError
  from dapo_jax.builders import sweep as sweep_builder
  from dapo_jax.sweep import space as space_lib
  path = config_flags.get_config_filename(flags.FLAGS["config"])
  try:
    space = space_lib.from_specs(_SPACE.value) if _SPACE.value else \
        sweep_builder.recipe_space(sweep_builder.split_config_path(path)[0])
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if space is None:
    raise ConfigError(f"--space: nothing to search; give --space=KEY=SPEC or a config file with sweep(add) "
                      f"({path} has none)")
  return path, space


def workdir() -> str:
  return _WORKDIR.value or common.default_workdir().replace(os.sep, os.sep + "sweep_", 1)


def dry_run(flag_values) -> None:
  """--dry_run: the trials the sweep would run, every grid setting checked; nothing runs."""
  import sys

  from ml_collections import config_flags

  from dapo_jax.builders import sweep as sweep_builder
  path, space = search_space()
  fixed = dict(config_flags.get_override_values(flag_values["config"]))
  print("\n".join(sweep_builder.plan_lines(path, fixed, space, sweep_config(), workdir())))
  print(f"# config: {path}; checked; --dry_run: nothing was run")
  sys.exit(0)


def main(argv):
  del argv
  path, space = search_space()
  definition = {"space": list(_SPACE.value) or [dict(p) for p in space.points]}
  common.run_sweep(path, space, workdir(), sweep_config(), definition, _CHILD_ENV, launcher=_LAUNCHER.value)


if __name__ == "__main__":
  common.run(main, dry_run)
