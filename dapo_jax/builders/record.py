"""The run's record in its workdir: one run per workdir, the model directories it writes, its config.

One run per workdir: a run holds an exclusive lock on WORKDIR/run.lock for its process's life.

A second run started on the same workdir (another shell, a scheduler retrying while the first still
runs) is refused at start, naming the workdir and the run holding it (pid, host, start time, command),
so two writers never interleave checkpoints and metrics. The lock is `fcntl.flock` on an open file:
the kernel drops it when the process ends however it ends (kill -9, a crash, a preempted VM), so a
killed run never leaves a stale lock; the file's text is only the holder's description. Locking is
re-entrant within one process (a test or notebook that builds several runs on one workdir).

Multi-host runs share one workdir: only process 0 locks it. A remote workdir (gs://...) has no
POSIX locks and is not locked; a network file system's flock is as good as its server's.

A run records its resolved config in WORKDIR/config.json at each start and its command lines in
command.txt (`record_config`); a restart that changes one of the fields a run cannot change (the
caller names them) is refused naming the field and both values.

The model directories a run writes into its workdir (W/sft_model, W/rm_model, W/dpo_model, W/model)
are written whole or not at all (`write_model_dir`: into a sibling, then swapped in, so a kill during
the write never leaves a half-written model that a rerun would load), and never over files a model
export does not write (`check_model_dir`, at start: a user's own files there are refused by name).
"""
from __future__ import annotations

import dataclasses
import datetime
import fcntl
import json
import logging
import os
import shlex
import shutil
import socket
import sys
import time

import jax

from dapo_jax.builders.checks import as_config
from dapo_jax.errors import ConfigError
from dapo_jax.model.config import ModelConfig
from dapo_jax.settings import RUNTIME_FIELDS, Config

LOCK_FILE = "run.lock"
CONFIG_FILE = "config.json"
COMMAND_FILE = "command.txt"

_held: dict[str, int] = {}  # realpath of a workdir -> the open file descriptor holding its lock


class WorkdirBusyError(ConfigError):
  """Another process holds the workdir's lock (a ConfigError: `--workdir` names a busy directory, and
  the launch scripts print it as one line)."""


def holder(workdir: str) -> dict:
  """What the lock file says about the run that holds (or last held) `workdir`; {} if nothing."""
  try:
    with open(os.path.join(workdir, LOCK_FILE)) as f:
      info = json.loads(f.read() or "{}")
  except (OSError, ValueError):
    return {}
  return info if isinstance(info, dict) else {}


def describe(info: dict) -> str:
  if not info.get("pid"):
    return "another process (it has not written its description yet)"
  cmd = " ".join(info.get("argv") or [])[:200]
  return (f"pid {info['pid']} on host {info.get('host', '?')}, started {info.get('started', '?')}"
          + (f" ({cmd})" if cmd else ""))


def lock(workdir: str, process_index: int = 0) -> str:
  """Takes `workdir`'s lock for the rest of this process's life, or raises WorkdirBusyError naming
  the run that holds it. Creates the directory. Returns the lock file's path ('' when not locked)."""
  if "://" in workdir or process_index != 0:
    return ""
  os.makedirs(workdir, exist_ok=True)
  key = os.path.realpath(workdir)
  path = os.path.join(key, LOCK_FILE)
  if key in _held:
    return path
  fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    os.close(fd)
    raise WorkdirBusyError(f"workdir {workdir} is in use by another run: {describe(holder(key))}; wait for "
                           "it to end or stop it, or use another --workdir") from None
  except OSError as e:  # A file system without locks: say so and go on unlocked.
    os.close(fd)
    logging.warning("workdir %s cannot be locked (%s); nothing stops a second run from writing to it", workdir, e)
    return ""
  info = {"pid": os.getpid(), "host": socket.gethostname(), "argv": sys.argv,
          "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")}
  os.ftruncate(fd, 0)
  os.pwrite(fd, json.dumps(info).encode(), 0)
  _held[key] = fd
  return path


def release(workdir: str) -> None:
  """Drops this process's lock on `workdir` (a run that ends before its process does)."""
  fd = _held.pop(os.path.realpath(workdir), None)
  if fd is not None:
    os.close(fd)  # Closing the descriptor releases the flock.


# What `hf.save`, `hf.save_scalar`, `gguf.to_hf_dir` and a tokenizer's `save_pretrained` write.
MODEL_DIR_FILES = frozenset({
    "config.json", "generation_config.json", "model.safetensors", "source.json", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
    "vocab.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json"})


class ModelDirError(ConfigError):
  """A workdir's model directory holds files the run did not write."""


def check_model_dir(path: str, writer: str, overwrite: bool = False, extra=()) -> None:
  """Refuses to go on (before any work) when `path`, the model directory `writer` will write, holds
  files a model export does not write (`MODEL_DIR_FILES` and `extra`): they are someone else's (a
  stale sharded index there would even shadow the new weights). `overwrite` lets the write replace
  the whole directory."""
  if os.path.isfile(path):
    raise ModelDirError(f"{path} is a file; {writer} writes its model into a directory there: move the file away")
  recover_model_dir(path)
  if overwrite or not os.path.isdir(path):
    return
  foreign = sorted(set(os.listdir(path)) - MODEL_DIR_FILES - set(extra))
  if foreign:
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    raise ModelDirError(f"{path} holds files {writer} does not write ({shown}); move them away, or pass "
                        "--overwrite to replace the directory")


def write_model_dir(path: str, write) -> str:
  """Calls `write(tmp)` on an empty sibling directory, then swaps it in for `path`: a reader sees the
  old directory or the new one, never a half-written one (a kill in `write` leaves only the
  sibling, cleared by the next write). Returns `path`."""
  path = path.rstrip("/")
  tmp, old = path + ".partial", path + ".replaced"
  recover_model_dir(path)
  for leftover in (tmp, old):
    shutil.rmtree(leftover, ignore_errors=True)
  os.makedirs(tmp)
  write(tmp)
  if os.path.isdir(path):
    os.rename(path, old)
  os.rename(tmp, path)
  shutil.rmtree(old, ignore_errors=True)
  return path


def recover_model_dir(path: str) -> None:
  """A kill between `write_model_dir`'s two renames leaves the old directory set aside and the new
  one complete beside it: finish the swap."""
  path = path.rstrip("/")
  tmp, old = path + ".partial", path + ".replaced"
  if not os.path.exists(path) and os.path.isdir(old) and os.path.isdir(tmp):
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


# --- The run's own record of its config -------------------------------------------------------------

def record_config(cfg: Config, workdir: str, fields, *, argv=None, name: str = CONFIG_FILE,
                  command_name: str = COMMAND_FILE, write: bool = True) -> None:
  """Writes the resolved config to WORKDIR/`name` and appends the command line to
  `command_name`; refuses (CheckpointMismatchError) a config whose `fields` (dotted paths) differ from
  the ones recorded there. `write`: this process writes (process 0 of a multi-host run); every
  process checks."""
  path = os.path.join(workdir, name)
  if os.path.exists(path):
    try:
      with open(path) as f:
        old = json.load(f)
    except ValueError as e:
      raise ConfigError(f"{path}: not a readable run config ({e}); move it away to start afresh") from None
    for field in fields:
      before, now = _get(old, field), _plain(_setting(cfg, field))
      if before is not None and before != now:
        from dapo_jax.checkpoint import CheckpointMismatchError  # noqa: PLC0415 (jax: only when refusing)
        raise CheckpointMismatchError(
            f"{path}: the run was started with {field}={before!r}, this config has {field}={now!r}; a run "
            "cannot change it (use another --workdir)")
  if not write:
    return
  os.makedirs(workdir, exist_ok=True)
  with open(path + ".tmp", "w") as f:
    f.write(json.dumps(cfg.to_dict(), indent=1, sort_keys=True, default=str) + "\n")
  os.replace(path + ".tmp", path)
  with open(os.path.join(workdir, command_name), "a") as f:
    f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')}  {shlex.join(sys.argv if argv is None else argv)}\n")


def recorded_config(workdir: str, name: str = CONFIG_FILE):
  """The ConfigDict WORKDIR/`name` holds (`record_config`), or None if there is none. JSON lists come
  back as tuples, as the recipes write them."""
  import ml_collections  # noqa: PLC0415
  path = os.path.join(workdir, name)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      raw = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f"{path}: not a readable run config ({e})") from None
  tuples = lambda x: (tuple(tuples(v) for v in x) if isinstance(x, list)
                      else {k: tuples(v) for k, v in x.items()} if isinstance(x, dict) else x)
  return ml_collections.ConfigDict(tuples(raw))


def _get(tree, path: str):
  for part in path.split("."):
    if not hasattr(tree, "get") or part not in tree:
      return None
    tree = tree[part]
  return tree


def _setting(cfg: Config, path: str):
  for part in path.split("."):
    cfg = getattr(cfg, part)
  return cfg


def _plain(x):
  """A config value as JSON reads it back (tuples as lists, sections as dicts)."""
  return json.loads(json.dumps(x.to_dict() if hasattr(x, "to_dict") else x, default=str))


# Fields a run cannot change between starts: its parameters' shapes and meaning, its tokens, what its
# checkpoints hold (a value model with gae) and what it optimises.
_ARCHITECTURE = tuple(f"model.{f.name}" for f in dataclasses.fields(ModelConfig)
                      if f.name not in RUNTIME_FIELDS and f.name != "vocab_size")
RESUME_FIELDS = _ARCHITECTURE + ("model.init", "model.hf_dir", "model.gguf", "model.vocab_size", "model.lora.rank",
                                 "tokenizer.path", "tokenizer.vocab_size", "dapo.adv_estimator", "dapo.policy_loss")
# The supervised pipelines' own records (WORKDIR/<pipeline>_config.json, beside a training run's):
# what they start from, train on and optimise.
_PAIR_FIELDS = ("init_dir", "train_files", "prompt_len", "response_len")
PIPELINE_RESUME_FIELDS = {
    "sft": RESUME_FIELDS[:-2] + ("data.task", "data.train_files", "chat_sft.assistant_only", "chat_sft.packing",
                                 "sft.seq_len"),
    "rm": tuple(f"rm.{k}" for k in _PAIR_FIELDS + ("margin",)) + ("tokenizer.path", "model.lora.rank"),
    "dpo": tuple(f"dpo.{k}" for k in _PAIR_FIELDS + ("beta", "loss_type", "label_smoothing", "rpo_alpha"))
           + ("tokenizer.path", "model.lora.rank"),
}


def save_run_config(cfg, workdir: str, argv=None, *, fields=RESUME_FIELDS, name: str = CONFIG_FILE,
                    command_name: str = COMMAND_FILE) -> None:
  """Writes the resolved config to WORKDIR/config.json and appends the command line to command.txt;
  refuses (CheckpointMismatchError) a config whose `fields` differ from the run's recorded ones."""
  record_config(as_config(cfg), workdir, fields, argv=argv, name=name, command_name=command_name,
                write=jax.process_index() == 0)


def save_pipeline_config(cfg, workdir: str, pipeline: str) -> None:
  """`save_run_config` for `launch.sft|rm|dpo`: WORKDIR/<pipeline>_config.json, checked against
  `PIPELINE_RESUME_FIELDS[pipeline]` when the pipeline resumes."""
  save_run_config(cfg, workdir, fields=PIPELINE_RESUME_FIELDS[pipeline], name=f"{pipeline}_config.json",
                  command_name=f"{pipeline}_command.txt")


def load_run_config(workdir: str):
  """The ConfigDict a run in `workdir` recorded (`save_run_config`), or None if it has none."""
  return recorded_config(workdir)
