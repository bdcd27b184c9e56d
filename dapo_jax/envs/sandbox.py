"""Runs untrusted programs (model-written code) in a sandbox made of the operating system's own tools.

    result = run_python("print(input())", stdin="hi", limits=Limits(cpu_s=2))
    result.exit_code, result.stdout    # 0, "hi\n"

Each run gets, from util-linux `unshare`: fresh mount, PID, network, IPC, UTS and cgroup namespaces
(the network namespace has only a loopback that is down); a new root made of a read-only bind of the
host's `/`, with empty tmpfs over the private places (`HIDDEN_DIRS`: /root, /home, /tmp, ...), a
minimal /dev, a fresh /proc and an empty /sys; its working directory /tmp, a fresh size-limited tmpfs
holding main.py and the given files. The program then runs (`setpriv`) as an unprivileged uid of its
own (60000 + a slot taken under a file lock, so concurrent sandboxes, in threads or processes, never
share one) without groups, capabilities or the right to gain privileges, under rlimits (`prlimit`:
CPU, address space, processes of its uid, file size, open files, no core files) and a wall-clock
limit (coreutils `timeout` inside, a process-group kill outside). Its PID namespace's init ends when
it does, which kills every process it started. Captured output is truncated at a byte cap while the
pipes are drained, so memory stays bounded. Nothing here filters Python: the kernel does the isolation.

This needs root (or CAP_SYS_ADMIN) on Linux; `check_available()` says what is missing. The mode
"none" runs a plain subprocess with the same rlimits, for trusted code only (docs/sandbox.md).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import fcntl
import logging
import os
import selectors
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Iterable

MODES = ("namespaces", "none")
UID_BASE = int(os.environ.get("DAPO_SANDBOX_UID_BASE", "60000"))  # uids UID_BASE..UID_BASE+SLOTS-1
SLOTS = 1000
# Host directories the sandbox sees as empty: where secrets, other users' files and scratch space live.
HIDDEN_DIRS = ("/root", "/home", "/tmp", "/var/tmp", "/run", "/mnt", "/media", "/srv", "/lost+found")
DEVICES = ("null", "zero", "full", "random", "urandom")
TOOLS = ("unshare", "setpriv", "prlimit", "mount", "umount", "pivot_root", "timeout", "cp", "chown", "sh")
# The program's whole environment (python -I ignores PYTHON* variables anyway).
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
        "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class SandboxError(RuntimeError):
  """The sandbox itself could not be built (not the program's failure)."""


@dataclasses.dataclass(frozen=True)
class Limits:
  cpu_s: float = 5          # CPU seconds per process, whole (RLIMIT_CPU; SIGXCPU, SIGKILL a second later)
  wall_s: float = 10        # wall-clock seconds for the whole run
  memory_mb: int = 512      # address space per process (RLIMIT_AS)
  processes: int = 32       # processes and threads of the sandbox's uid (RLIMIT_NPROC)
  output_bytes: int = 65536 # captured stdout and stderr, each; the rest is read and dropped
  file_mb: int = 16         # largest file it may write (RLIMIT_FSIZE)
  disk_mb: int = 64         # its working directory (a tmpfs) and /dev/shm, each
  open_files: int = 256     # RLIMIT_NOFILE

  def __post_init__(self):
    for name in ("cpu_s", "wall_s", "memory_mb", "processes", "output_bytes", "file_mb", "disk_mb", "open_files"):
      if not getattr(self, name) > 0:
        raise ValueError(f"Limits.{name}={getattr(self, name)!r} must be positive")


@dataclasses.dataclass
class Result:
  exit_code: int | None          # None when killed by a signal
  stdout: str
  stderr: str
  timed_out: bool                # ran past wall_s or cpu_s
  killed_by_signal: int | None   # the signal that ended it (SIGKILL, SIGXCPU, ...)
  truncated: bool = False        # stdout or stderr ran past output_bytes
  wall_s: float = 0.0
  mode: str = "namespaces"
  uid: int | None = None         # the uid it ran as (namespaces mode)

  @property
  def ok(self) -> bool:
    return self.exit_code == 0 and not self.timed_out


# --- uid slots: one per running sandbox, across threads and processes ----------------------------

_LOCK_DIR = os.path.join(tempfile.gettempdir(), "dapo-sandbox-slots")


class _Slot:
  """A uid held under an exclusive flock, so concurrent sandboxes (threads or processes) differ."""

  def __init__(self):
    os.makedirs(_LOCK_DIR, mode=0o700, exist_ok=True)
    start = (os.getpid() * 7 + threading.get_ident()) % SLOTS  # Spread the first tries.
    for i in range(SLOTS):
      slot = (start + i) % SLOTS
      fd = os.open(os.path.join(_LOCK_DIR, f"{slot}.lock"), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        os.close(fd)
        continue
      self.uid, self._fd = UID_BASE + slot, fd
      return
    raise SandboxError(f"all {SLOTS} sandbox uid slots are in use")

  def release(self) -> None:
    os.close(self._fd)


def processes_of_uid(uid: int) -> list[int]:
  """PIDs of live (not zombie) processes whose real uid is `uid`, read from /proc."""
  out = []
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/status") as f:
        status = f.read()
    except OSError:
      continue
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if fields.get("Uid", "").split()[:1] == [str(uid)] and not fields.get("State", "").strip().startswith("Z"):
      out.append(int(name))
  return out


# --- the sandbox script ----------------------------------------------------------------------------

def _interpreter() -> str:
  """This process's python (a venv's, with its site-packages), else python3 on PATH."""
  if sys.executable and os.path.isabs(sys.executable) and os.path.exists(sys.executable):
    return sys.executable
  return os.path.realpath(shutil.which("python3") or "/usr/bin/python3")


def _readable_paths(python: str) -> list[str]:
  """Directories the program must read that a hidden dir may cover: the interpreter and its stdlib."""
  paths = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, sys.exec_prefix)}
  paths |= {os.path.dirname(python), os.path.dirname(os.path.realpath(python))}
  hidden = lambda p: any(p == h or p.startswith(h + "/") for h in HIDDEN_DIRS)
  return sorted(p for p in paths if hidden(p) and os.path.isdir(p))


def _script(host_dir: str, uid: int, limits: Limits, argv: list[str], readable: list[str]) -> str:
  """The shell script run as PID 1 of the new namespaces: build the root, then run the program."""
  q, new = shlex.quote, shlex.quote(os.path.join(host_dir, "root"))
  lines = [
      "set -eu",
      f"exec 7>{q(os.path.join(host_dir, 'status'))} 8>&2 2>&7 6<{q(os.path.join(host_dir, 'stdin'))}",
      # Private propagation, so none of this reaches the host's mount table.
      "mount --make-rprivate /",
      f"mount --bind / {new}",
      f"mount -o remount,bind,ro,nosuid,nodev {new}",
  ]
  size = f"size={limits.disk_mb}m"
  # /tmp, the working directory: its own tmpfs, filled before anything is bound inside it.
  lines += [f"mount -t tmpfs -o {size},mode=700,uid={uid},gid={uid},nosuid,nodev work {new}/tmp",
            f"cp -R {q(os.path.join(host_dir, 'in'))}/. {new}/tmp/", f"chown -R {uid}:{uid} {new}/tmp"]
  hidden = [d for d in HIDDEN_DIRS if d != "/tmp" and os.path.isdir(d) and not os.path.islink(d)]
  lines += [f"mount -t tmpfs -o size=1m,mode=755,nosuid,nodev hidden {new}{q(d)}" for d in hidden]
  for p in readable:  # Bound back read-only inside the hidden dirs, before those become read-only.
    lines += [f"mkdir -p {new}{q(p)}", f"mount --bind {q(p)} {new}{q(p)}",
              f"mount -o remount,bind,ro,nosuid,nodev {new}{q(p)}"]
  lines += [f"mount -o remount,ro,nosuid,nodev {new}{q(d)}" for d in hidden]
  lines += [
      f"mount -t proc -o nosuid,nodev,noexec proc {new}/proc",
      f"mount -t tmpfs -o size=1m,mode=755,nosuid dev {new}/dev",
  ]
  for dev in DEVICES:
    lines += [f": > {new}/dev/{dev}", f"mount --bind /dev/{dev} {new}/dev/{dev}"]
  lines += [
      f"ln -s /proc/self/fd {new}/dev/fd",
      *(f"ln -s /proc/self/fd/{i} {new}/dev/{n}" for i, n in enumerate(("stdin", "stdout", "stderr"))),
      f"mkdir {new}/dev/shm",
      f"mount -t tmpfs -o {size},mode=1777,nosuid,nodev shm {new}/dev/shm",
      f"mount -o remount,ro,nosuid {new}/dev",
      # Swap roots and drop the old one, so nothing outside the new root is reachable by path.
      f"cd {new}", "pivot_root . .", "umount -l .", "cd /tmp",
      "echo ready >&7", "set +e",
  ]
  wall = f"{limits.wall_s:.3f}"
  cpu = max(1, int(round(limits.cpu_s)))
  run = [
      "timeout", "-s", "KILL", wall,
      "prlimit", f"--cpu={cpu}:{cpu + 1}", f"--as={limits.memory_mb << 20}", f"--nproc={limits.processes}",
      f"--fsize={limits.file_mb << 20}", f"--nofile={limits.open_files}", "--core=0", "--",
      "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs", "--inh-caps=-all",
      "--bounding-set=-all", "--",
      "env", "-i", *(f"{k}={v}" for k, v in _ENV.items()), *argv,
  ]
  lines += [" ".join(q(a) for a in run) + " <&6 2>&8 6<&- 7>&- 8>&-", 'echo "exit $?" >&7']
  return "\n".join(lines) + "\n"


def _unshare(script: str) -> list[str]:
  return ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--net", "--ipc", "--uts", "--cgroup",
          "--", "sh", "-c", script]


# --- running -------------------------------------------------------------------------------------

_warned_none = False
_warn_lock = threading.Lock()


def _warn_unsandboxed() -> None:
  global _warned_none
  with _warn_lock:
    if not _warned_none:
      _warned_none = True
      logging.warning("sandbox='none': programs run as plain subprocesses with rlimits only, NOT isolated "
                      "(network, files and the host's processes are reachable); use it for trusted code only")


def default_mode() -> str:
  """The mode `run_python` uses when not told: $DAPO_SANDBOX, else "namespaces"."""
  mode = os.environ.get("DAPO_SANDBOX", "namespaces") or "namespaces"
  if mode not in MODES:
    raise ValueError(f"DAPO_SANDBOX={mode!r}; expected one of {MODES}")
  return mode


def run_python(source: str, *, stdin: str = "", limits: Limits = Limits(), files: dict[str, str] | None = None,
               sandbox: str | None = None) -> Result:
  """Runs `source` as main.py (with `files` beside it) under `python3 -I` in a fresh sandbox.

  -I leaves the script's directory off sys.path: main.py reads its files with open(), or adds "."."""
  files = dict(files or {}, **{"main.py": source})
  return run([_interpreter(), "-I", "-B", "main.py"], stdin=stdin, limits=limits, files=files, sandbox=sandbox)


def run(argv: list[str], *, stdin: str = "", limits: Limits = Limits(), files: dict[str, str] | None = None,
        sandbox: str | None = None) -> Result:
  """Runs `argv` (absolute program path) in a fresh sandbox whose working directory holds `files`."""
  mode = sandbox or default_mode()
  if mode not in MODES:
    raise ValueError(f"sandbox={mode!r}; expected one of {MODES}")
  host_dir = tempfile.mkdtemp(prefix="dapo_sandbox_")
  slot = None
  try:
    os.makedirs(os.path.join(host_dir, "in"))
    for name, text in (files or {}).items():
      path = os.path.normpath(os.path.join(host_dir, "in", name))
      if not path.startswith(os.path.join(host_dir, "in") + os.sep):
        raise ValueError(f"file name {name!r} leaves the working directory")
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, "w") as f:
        f.write(text)
    with open(os.path.join(host_dir, "stdin"), "w") as f:
      f.write(stdin)
    if mode == "none":
      _warn_unsandboxed()
      return _run_unsandboxed(argv, host_dir, limits)
    os.makedirs(os.path.join(host_dir, "root"))
    slot = _Slot()
    return _run_sandboxed(argv, host_dir, slot.uid, limits)
  finally:
    if slot is not None:
      _reap(slot.uid)
      slot.release()
    shutil.rmtree(host_dir, ignore_errors=True)


def _reap(uid: int, wait_s: float = 2.0) -> None:
  """Waits until no process of `uid` is left (the PID namespace's teardown is asynchronous after a
  kill), killing stragglers, so the next holder of the uid starts with a clean process count."""
  deadline = time.monotonic() + wait_s
  while (pids := processes_of_uid(uid)):
    for pid in pids:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    if time.monotonic() > deadline:
      raise SandboxError(f"processes {pids} of sandbox uid {uid} survived their sandbox")
    time.sleep(0.01)


def _run_sandboxed(argv: list[str], host_dir: str, uid: int, limits: Limits) -> Result:
  script = _script(host_dir, uid, limits, argv, _readable_paths(argv[0]))
  result = _communicate(_unshare(script), limits, host_dir)
  with open(os.path.join(host_dir, "status")) as f:
    status = f.read().splitlines()
  if "ready" not in status:
    if result.timed_out:
      raise SandboxError(f"the sandbox took more than wall_s={limits.wall_s} to start")
    raise SandboxError("the sandbox could not be built: " + " | ".join(status[-6:] or [result.stderr[-500:]]))
  result.uid, last = uid, status[-1]
  if last.startswith("exit "):  # The shell reports a death by signal N as 128+N.
    code = int(last.split()[1])
    if code > 128 and code - 128 < signal.NSIG:
      result.exit_code, result.killed_by_signal = None, code - 128
    else:
      result.exit_code = code
  result.timed_out = result.timed_out or result.killed_by_signal == signal.SIGXCPU or (
      result.killed_by_signal == signal.SIGKILL and result.wall_s >= limits.wall_s * 0.95)
  return result


def _run_unsandboxed(argv: list[str], host_dir: str, limits: Limits) -> Result:
  cpu = max(1, int(round(limits.cpu_s)))
  rlimits = ["prlimit", f"--cpu={cpu}:{cpu + 1}", f"--as={limits.memory_mb << 20}",
             f"--fsize={limits.file_mb << 20}", f"--nofile={limits.open_files}", "--core=0", "--"]
  work = os.path.join(host_dir, "in")
  env = ["env", "-i", *(f"{k}={v}" for k, v in dict(_ENV, HOME=work, TMPDIR=work).items())]
  with open(os.path.join(host_dir, "stdin")) as stdin:
    result = _communicate(rlimits + env + argv, limits, host_dir, cwd=work, stdin=stdin)
  result.mode = "none"
  if result.exit_code is not None and result.exit_code < 0:
    result.exit_code, result.killed_by_signal = None, -result.exit_code
  result.timed_out = result.timed_out or result.killed_by_signal == signal.SIGXCPU
  return result


def _communicate(cmd: list[str], limits: Limits, host_dir: str, cwd: str | None = None, stdin=None) -> Result:
  """Runs `cmd` in its own session, reading stdout/stderr up to the byte cap; kills the group at wall_s."""
  start = time.monotonic()
  # The inner `timeout` enforces wall_s; this outer deadline only catches a sandbox that hangs.
  deadline = start + limits.wall_s + 2.0
  proc = subprocess.Popen(cmd, stdin=stdin if stdin is not None else subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, cwd=cwd or host_dir, start_new_session=True, close_fds=True)
  bufs, truncated, timed_out = {proc.stdout: bytearray(), proc.stderr: bytearray()}, False, False
  sel = selectors.DefaultSelector()
  for pipe in bufs:
    sel.register(pipe, selectors.EVENT_READ)
  try:
    while sel.get_map():
      remaining = deadline - time.monotonic()
      if cwd is not None:  # Unsandboxed: no inner timeout, so this is the wall limit.
        remaining -= 2.0
      if remaining <= 0:
        timed_out = True
        _kill_group(proc)
        remaining = 1.0
      for key, _ in sel.select(timeout=remaining):
        chunk = os.read(key.fd, 65536)
        if not chunk:
          sel.unregister(key.fileobj)
          continue
        buf = bufs[key.fileobj]
        room = limits.output_bytes - len(buf)
        if len(chunk) > room:
          truncated = True
        buf += chunk[:max(room, 0)]
      if timed_out and time.monotonic() > deadline + 1.0:
        break  # A grandchild kept a pipe open past the kill; stop reading it.
    try:
      proc.wait(timeout=max(deadline - time.monotonic(), 0) + 1.0)
    except subprocess.TimeoutExpired:
      timed_out = True
      _kill_group(proc)
      proc.wait()
  finally:
    sel.close()
    for pipe in bufs:
      pipe.close()
    if proc.poll() is None:
      _kill_group(proc)
      proc.wait()
  text = lambda b: b.decode("utf-8", "replace")
  return Result(exit_code=proc.returncode, stdout=text(bufs[proc.stdout]), stderr=text(bufs[proc.stderr]),
                timed_out=timed_out, killed_by_signal=None, truncated=truncated,
                wall_s=time.monotonic() - start)


def _kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


# --- availability and pools ---------------------------------------------------------------------

_available: str | None = None  # "" once checked and fine; else the reason


def check_available() -> None:
  """Raises RuntimeError saying exactly what is missing when this host cannot build the sandbox."""
  global _available
  if _available is None:
    _available = _why_unavailable()
  if _available:
    raise RuntimeError(f"the code sandbox cannot run on this host: {_available}. Fix that, or set "
                       "DAPO_SANDBOX=none (reward.sandbox='none') to run trusted code without isolation.")


def _why_unavailable() -> str:
  if not sys.platform.startswith("linux"):
    return f"it needs Linux namespaces (this is {sys.platform})"
  missing = [t for t in TOOLS if shutil.which(t) is None]
  if missing:
    return f"missing programs {missing} (util-linux and coreutils provide them)"
  if os.geteuid() != 0:
    return f"it must run as root (uid 0) to build namespaces and switch uids; this process is uid {os.geteuid()}"
  import pwd
  taken = [u.pw_name for u in pwd.getpwall() if UID_BASE <= u.pw_uid < UID_BASE + SLOTS]
  if taken:
    return (f"users {taken} have uids in the sandbox's range {UID_BASE}..{UID_BASE + SLOTS - 1}; "
            "set DAPO_SANDBOX_UID_BASE to a free range")
  try:
    r = run_python("import socket; print('ok')", limits=Limits(cpu_s=5, wall_s=20), sandbox="namespaces")
  except SandboxError as e:
    return str(e)
  if r.stdout.strip() != "ok":
    return (f"a test program failed in the sandbox (exit {r.exit_code}, signal {r.killed_by_signal}): "
            f"{r.stderr.strip()[-500:]}")
  return ""


class SandboxPool:
  """Runs programs in up to `workers` sandboxes at once (threads; each run has its own uid and dir)."""

  def __init__(self, workers: int = 4):
    self._executor = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")

  def submit(self, source: str, **kwargs) -> cf.Future:
    return self._executor.submit(run_python, source, **kwargs)

  def map(self, sources: Iterable[str], **kwargs) -> list[Result]:
    return [f.result() for f in [self.submit(s, **kwargs) for s in sources]]

  def close(self) -> None:
    self._executor.shutdown(wait=True)

  def __enter__(self) -> "SandboxPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
