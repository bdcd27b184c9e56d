"""One run per workdir: a run holds an exclusive lock on WORKDIR/run.lock for its process's life.

A second run started on the same workdir (another shell, a scheduler retrying while the first still
runs) is refused at start, naming the workdir and the run holding it (pid, host, start time, command),
so two writers never interleave checkpoints and metrics. The lock is `fcntl.flock` on an open file:
the kernel drops it when the process ends however it ends (kill -9, a crash, a preempted VM), so a
killed run never leaves a stale lock; the file's text is only the holder's description. Locking is
re-entrant within one process (a test or notebook that builds several runs on one workdir).

Multi-host runs share one workdir: only process 0 locks it. A remote workdir (gs://...) has no
POSIX locks and is not locked; a network file system's flock is as good as its server's.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
import sys

from dapo_jax.config_checks import ConfigError

LOCK_FILE = "run.lock"

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
