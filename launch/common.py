"""What every entry point shares: multi-host start-up, the default config path, clean errors."""
import os
import sys

from absl import app, logging

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(REPO, "configs", "default.py")


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


def _user_errors():
  from dapo_jax import checkpoint, data, hf, loop, rewards, tokenizer
  return (data.DataError, hf.CheckpointError, tokenizer.TokenizerError, rewards.RewardConfigError,
          checkpoint.CheckpointMismatchError, loop.TrainingError)


def run(main) -> None:
  """absl's app.run, with our known input errors printed as one line instead of a stack trace."""
  def wrapped(argv):
    from absl import flags
    if not flags.FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO.
    try:
      return main(argv)
    except _user_errors() as e:
      print(f"error: {e}", file=sys.stderr, flush=True)
      sys.exit(1)
  app.run(wrapped)
