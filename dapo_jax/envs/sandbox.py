"""Runs untrusted programs (model-written code) in a sandbox the kernel enforces, one per run.

    result = run_python("print(input())", stdin="hi", limits=Limits(cpu_s=2))
    result.exit_code, result.stdout    # 0, "hi\n"

Each run is a bubblewrap (`bwrap`) sandbox: fresh mount, PID, network, IPC, UTS and cgroup namespaces
(the network namespace has only a loopback that is down), and a root holding only what a program
needs, read-only: /usr (without /usr/local), a few files of /etc, the interpreter's prefix with its
site-packages emptied but for `PACKAGES`; then a fresh /proc, a minimal /dev, and two tmpfs of
`disk_mb`: /dev/shm and the working directory /tmp, which holds main.py and the given files. The
host's checkouts, workdirs, home directories and data are not in that root at all.

The program runs (`setpriv`) as an unprivileged uid of its own (60000 + a slot taken under a file
lock) without groups, capabilities or the right to gain privileges, under a seccomp filter that
denies new namespaces, mounts, io_uring, bpf, keyrings, ptrace and the kernel's administration calls
(`SECCOMP_DENIED`), and under per-process rlimits (`prlimit`: CPU, address space, file size, open
files). The sandbox as a whole is one cgroup: one memory budget for everything it holds (processes,
tmpfs, /dev/shm, memfd, SysV shared memory; no swap) and one process budget. The wall-clock limit,
and the end of every run, kill the whole cgroup, which is then removed. Captured output is truncated
at a byte cap while the pipes are drained. Nothing here filters Python: the kernel does the isolation.

This needs root on Linux, bubblewrap, util-linux, libseccomp (through `pyseccomp`) and a writable
cgroup hierarchy (v2, or v1's memory and pids); the first run, and `check_available()`, stop in one
line naming what is missing. The mode "none" runs a plain subprocess with the same rlimits, for
trusted code only (docs/sandbox.md).

The file system view, the seccomp filter and `SandboxError` are `sandbox_host`'s; the cgroups are
`cgroups`'. This module puts them together, once per process, and runs programs in them.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import fcntl
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Iterable, Sequence

from dapo_jax.envs import sandbox_host
from dapo_jax.envs.cgroups import Cgroup, Cgroups
from dapo_jax.envs.sandbox_host import SandboxError

MODES = ("namespaces", "none")
UID_BASE = int(os.environ.get("DAPO_SANDBOX_UID_BASE", "60000"))  # uids UID_BASE..UID_BASE+SLOTS-1
SLOTS = 1000
_PIDS_OF_BWRAP = 2  # bwrap's monitor and the namespace's init, counted in pids.max beside the program's
# The program's whole environment (python -I ignores PYTHON* variables anyway).
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
        "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclasses.dataclass(frozen=True)
class Limits:
  cpu_s: float = 5          # CPU seconds per process, whole (RLIMIT_CPU; SIGXCPU, SIGKILL a second later)
  wall_s: float = 10        # wall-clock seconds for the whole run
  memory_mb: int = 512      # everything the sandbox holds (cgroup; tmpfs and memfd included), and each
                            # process's address space (RLIMIT_AS)
  processes: int = 32       # processes and threads of the whole sandbox (cgroup pids.max)
  output_bytes: int = 65536 # captured stdout and stderr, each; the rest is read and dropped
  file_mb: int = 16         # largest file it may write (RLIMIT_FSIZE)
  disk_mb: int = 64         # its working directory (a tmpfs) and /dev/shm, each (within memory_mb)
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
  out_of_memory: bool = False    # the sandbox's memory budget was exhausted and a process killed for it

  @property
  def ok(self) -> bool:
    return self.exit_code == 0 and not self.timed_out


@dataclasses.dataclass
class Job:
  """One program for `run_all`: `stdin` is text, or a host fd to read from; `stdout` a host fd to
  write to instead of being captured; `pass_fds` further host fds it inherits (same numbers)."""
  argv: list[str]
  stdin: str | int = ""
  files: dict[str, str] | None = None
  limits: Limits = Limits()
  stdout: int | None = None
  pass_fds: tuple[int, ...] = ()

  @classmethod
  def python(cls, source: str, args: Sequence[str] = (), **kwargs) -> "Job":
    """`source` as main.py under `python3 -I -B` (with `files` beside it), given `args`."""
    files = dict(kwargs.pop("files", None) or {}, **{"main.py": source})
    return cls([sandbox_host.interpreter(), "-I", "-B", "main.py", *args], files=files, **kwargs)


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


# --- the host's sandbox: tools, filter, file system view, cgroups ---------------------------------

@dataclasses.dataclass
class _Host:
  sh: str
  bwrap: str
  setpriv: str
  prlimit: str
  seccomp: bytes
  view: list[str]
  cgroups: Cgroups


_host_cache: _Host | None = None
_host_lock = threading.Lock()


def _host() -> _Host:
  """What every sandbox of this process shares, checked once; SandboxError in one line otherwise."""
  global _host_cache
  with _host_lock:
    if _host_cache is None:
      try:
        _host_cache = _build_host()
      except SandboxError as e:
        raise SandboxError(f"{e}; or set DAPO_SANDBOX=none (reward.sandbox='none') to run trusted code "
                           "without isolation") from None
    return _host_cache


def _build_host() -> _Host:
  if not sys.platform.startswith("linux"):
    raise SandboxError(f"sandbox: it needs Linux (this is {sys.platform})")
  tools = {}
  for tool, package in (("sh", "dash"), ("bwrap", "bubblewrap"), ("setpriv", "util-linux"), ("prlimit", "util-linux")):
    found = shutil.which(tool)
    if found is None:
      raise SandboxError(f"sandbox: {tool} not found (apt-get install {package})")
    tools[tool] = os.path.realpath(found)
  if os.geteuid() != 0:
    raise SandboxError(f"sandbox: it must run as root (uid 0) to build namespaces, cgroups and switch uids; "
                       f"this process is uid {os.geteuid()}")
  import pwd  # noqa: PLC0415
  taken = [u.pw_name for u in pwd.getpwall() if UID_BASE <= u.pw_uid < UID_BASE + SLOTS]
  if taken:
    raise SandboxError(f"sandbox: users {taken} have uids in the sandbox's range {UID_BASE}..{UID_BASE + SLOTS - 1}; "
                       "set DAPO_SANDBOX_UID_BASE to a free range")
  seccomp = sandbox_host.seccomp_program()
  return _Host(sh=tools["sh"], bwrap=tools["bwrap"], setpriv=tools["setpriv"], prlimit=tools["prlimit"],
               seccomp=seccomp, view=sandbox_host.view([tools["setpriv"], tools["prlimit"]]), cgroups=Cgroups())


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
  return run_all([Job.python(source, stdin=stdin, limits=limits, files=files)], sandbox=sandbox)[0]


def run(argv: list[str], *, stdin: str = "", limits: Limits = Limits(), files: dict[str, str] | None = None,
        sandbox: str | None = None) -> Result:
  """Runs `argv` (absolute program path) in a fresh sandbox whose working directory holds `files`."""
  return run_all([Job(list(argv), stdin=stdin, files=files, limits=limits)], sandbox=sandbox)[0]


def run_all(jobs: Sequence[Job], *, sandbox: str | None = None, primary: int | None = None) -> list[Result]:
  """Runs `jobs` at once, each in its own sandbox: programs that talk through pipes given as their
  stdin, stdout or `pass_fds` (this closes the host's copies of those fds once the sandboxes hold
  them). Once job `primary` has ended, the others get a second to end, then are killed."""
  mode = sandbox or default_mode()
  if mode not in MODES:
    raise ValueError(f"sandbox={mode!r}; expected one of {MODES}")
  given = {fd for job in jobs for fd in [job.stdin, job.stdout, *job.pass_fds] if isinstance(fd, int)}
  runs: list[_Run] = []
  try:
    for job in jobs:
      for name in job.files or {}:
        if name.startswith("/") or not os.path.normpath(os.path.join("/tmp", name)).startswith("/tmp/"):
          raise ValueError(f"file name {name!r} leaves the working directory")
    if mode == "none":
      _warn_unsandboxed()
    host = _host() if mode == "namespaces" else None
    for job in jobs:
      runs.append(_Run(job, host))
      runs[-1].start()
    for fd in given:  # The sandboxes hold them now; with no copy left here, EOF means the other side ended.
      os.close(fd)
    given = set()
    _wait(runs, primary)
    return [r.result() for r in runs]
  finally:
    for fd in given:
      os.close(fd)
    errors = []
    for r in runs:
      try:
        r.cleanup()
      except SandboxError as e:
        errors.append(e)
    if errors:
      raise errors[0]


def _memfd(data: bytes) -> int:
  fd = os.memfd_create("sandbox", os.MFD_CLOEXEC)
  os.write(fd, data)
  os.lseek(fd, 0, os.SEEK_SET)
  return fd


class _Run:
  """One job's sandbox: started, read from, ended, cleaned up."""

  def __init__(self, job: Job, host: _Host | None):
    self.job, self.host = job, host
    self.slot: _Slot | None = None
    self.cgroup: Cgroup | None = None
    self.proc: subprocess.Popen | None = None
    self.status_r: int | None = None   # bwrap's --json-status-fd, read end
    self.work_dir: str | None = None   # mode "none" only
    self.bufs: dict = {}
    self.truncated = self.killed_at_wall = self.stopped = False
    self.start_time = self.end_time = 0.0

  def start(self) -> None:
    job, own_fds = self.job, []   # own_fds: made here, closed here once the child has them
    try:
      stdin = job.stdin
      if not isinstance(stdin, int):
        stdin = _memfd(stdin.encode())
        own_fds.append(stdin)
      if self.host is None:
        cmd, pass_fds = self._unsandboxed_command(), list(job.pass_fds)
        cwd, env = self.work_dir, self._unsandboxed_env()
      else:
        cmd, extra = self._sandboxed_command(own_fds)
        pass_fds, cwd, env = list(job.pass_fds) + extra, "/", _ENV
      self.start_time = time.monotonic()
      self.proc = subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE if job.stdout is None else job.stdout,
                                   stderr=subprocess.PIPE, cwd=cwd, env=env, start_new_session=True, close_fds=True,
                                   pass_fds=pass_fds)
    finally:
      for fd in own_fds:
        os.close(fd)
    self.bufs = {p: bytearray() for p in (self.proc.stdout, self.proc.stderr) if p is not None}

  def _sandboxed_command(self, own_fds: list[int]) -> tuple[list[str], list[int]]:
    """The command line, and the fds (in `own_fds` too) bwrap reads: seccomp, files, status."""
    host, job, limits = self.host, self.job, self.job.limits
    self.slot = _Slot()
    self.cgroup = host.cgroups.create(f"run-{self.slot.uid}", memory=limits.memory_mb << 20,
                                      pids=limits.processes + _PIDS_OF_BWRAP)
    extra = []

    def fd_of(data: bytes) -> str:
      fd = _memfd(data)
      own_fds.append(fd)
      extra.append(fd)
      return str(fd)

    size = str(limits.disk_mb << 20)
    args = [host.bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup",
            "--die-with-parent", "--new-session", "--hostname", "sandbox",
            "--proc", "/proc", "--dev", "/dev", "--size", size, "--perms", "1777", "--tmpfs", "/dev/shm",
            "--size", size, "--perms", "1777", "--tmpfs", "/tmp",
            # After /tmp's tmpfs, so an interpreter installed under /tmp (a virtualenv there) stays visible.
            *host.view]
    made = set()
    for name, text in sorted((job.files or {}).items()):
      parts = os.path.normpath(name).split("/")
      for i in range(1, len(parts)):
        if (d := "/tmp/" + "/".join(parts[:i])) not in made:
          made.add(d)
          args += ["--perms", "0777", "--dir", d]
      args += ["--perms", "0666", "--file", fd_of(text.encode()), "/tmp/" + "/".join(parts)]
    self.status_r, status_w = os.pipe2(os.O_CLOEXEC)
    own_fds.append(status_w)
    extra.append(status_w)
    uid, cpu = self.slot.uid, max(1, int(round(limits.cpu_s)))
    args += ["--remount-ro", "/", "--chdir", "/tmp", "--json-status-fd", str(status_w),
             "--seccomp", fd_of(host.seccomp), "--",
             host.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs", "--inh-caps=-all",
             "--bounding-set=-all", "--",
             host.prlimit, f"--cpu={cpu}:{cpu + 1}", f"--as={limits.memory_mb << 20}",
             f"--fsize={limits.file_mb << 20}", f"--nofile={limits.open_files}", "--core=0", "--", *job.argv]
    # The shell moves itself into the cgroup, then becomes bwrap: all that bwrap starts is inside.
    join = 'for f; do [ "$f" = -- ] && break; echo $$ > "$f" || exit 125; shift; done; shift; exec "$@"'
    return [host.sh, "-c", join, "sh", *self.cgroup.procs_files, "--", *args], extra

  def _unsandboxed_command(self) -> list[str]:
    job, limits = self.job, self.job.limits
    self.work_dir = tempfile.mkdtemp(prefix="dapo_sandbox_")
    for name, text in (job.files or {}).items():
      path = os.path.join(self.work_dir, os.path.normpath(name))
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, "w") as f:
        f.write(text)
    cpu = max(1, int(round(limits.cpu_s)))
    return ["prlimit", f"--cpu={cpu}:{cpu + 1}", f"--as={limits.memory_mb << 20}", f"--fsize={limits.file_mb << 20}",
            f"--nofile={limits.open_files}", "--core=0", "--", *job.argv]

  def _unsandboxed_env(self) -> dict[str, str]:
    return dict(_ENV, HOME=self.work_dir, TMPDIR=self.work_dir)

  def kill(self) -> None:
    """Kills the whole sandbox: every process of its cgroup, and its session on the host."""
    if self.cgroup is not None:
      self.cgroup.kill()
    try:
      os.killpg(self.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass

  def result(self) -> Result:
    text = lambda p: self.bufs[p].decode("utf-8", "replace") if p in self.bufs else ""
    code = self.proc.returncode
    r = Result(exit_code=code, stdout=text(self.proc.stdout), stderr=text(self.proc.stderr),
               timed_out=self.killed_at_wall, killed_by_signal=None, truncated=self.truncated,
               wall_s=self.end_time - self.start_time, mode="namespaces" if self.host else "none")
    if self.host is None:
      if code is not None and code < 0:
        r.exit_code, r.killed_by_signal = None, -code
    else:
      r.uid, r.out_of_memory = self.slot.uid, self.cgroup.oom_kills() > 0
      status = self._status()
      if "exit-code" in status:  # bwrap reports a death by signal N as 128+N.
        code = status["exit-code"]
        if code > 128 and code - 128 < signal.NSIG:
          r.exit_code, r.killed_by_signal = None, code - 128
        else:
          r.exit_code = code
      elif self.killed_at_wall or self.stopped or r.out_of_memory:  # Killed with its whole sandbox.
        r.exit_code, r.killed_by_signal = None, signal.SIGKILL
      else:  # The program never started.
        raise SandboxError("sandbox: bwrap could not build the sandbox: "
                           + (" | ".join(r.stderr.strip().splitlines()[-3:]) or f"exit status {code}"))
    r.timed_out = r.timed_out or r.killed_by_signal == signal.SIGXCPU
    return r

  def _status(self) -> dict:
    """bwrap's --json-status-fd: its `exit-code` is written only when the program was started."""
    data = b""
    os.set_blocking(self.status_r, False)
    try:
      while chunk := os.read(self.status_r, 65536):
        data += chunk
    except BlockingIOError:
      pass
    status = {}
    for line in data.decode("utf-8", "replace").splitlines():
      try:
        status.update(json.loads(line))
      except ValueError:
        pass
    return status

  def cleanup(self) -> None:
    try:
      if self.proc is not None:
        for pipe in (self.proc.stdout, self.proc.stderr):
          if pipe is not None:
            pipe.close()
        if self.proc.poll() is None:
          self.kill()
          self.proc.wait()
      if self.cgroup is not None:
        self.cgroup.remove()
    finally:
      if self.status_r is not None:
        os.close(self.status_r)
        self.status_r = None
      if self.slot is not None:
        self.slot.release()
        self.slot = None
      if self.work_dir is not None:
        shutil.rmtree(self.work_dir, ignore_errors=True)
        self.work_dir = None


def _wait(runs: list[_Run], primary: int | None) -> None:
  """Drains every run's output until all have ended; kills each at its wall limit (its whole
  cgroup), and the others a second after `primary` has ended."""
  sel = selectors.DefaultSelector()
  owner = {}
  for r in runs:
    for pipe in r.bufs:
      sel.register(pipe, selectors.EVENT_READ)
      owner[pipe] = r
  deadline = {r: r.start_time + r.job.limits.wall_s for r in runs}
  give_up = {}  # Past this, stop reading a killed run's pipes (a process outside it may hold them).
  try:
    while True:
      now = time.monotonic()
      for r in runs:
        if r.end_time == 0.0 and r.proc.poll() is not None:
          r.end_time = now
      if primary is not None and runs[primary].end_time:
        for r in runs:
          if not r.end_time and not r.stopped:
            r.stopped, deadline[r] = True, min(deadline[r], now + 1.0)
      for r in runs:
        if not r.end_time and now >= deadline[r] and r not in give_up:
          r.killed_at_wall = not r.stopped
          r.kill()
          give_up[r] = now + 1.0
      for key in list(sel.get_map().values()):
        if owner[key.fileobj] in give_up and now >= give_up[owner[key.fileobj]]:
          sel.unregister(key.fileobj)
      reading = {owner[key.fileobj] for key in sel.get_map().values()}
      running = [r for r in runs if not r.end_time]
      if not running and not reading:
        break
      wake = [deadline[r] for r in running if r not in give_up] + [t for r, t in give_up.items() if r in reading]
      timeout = max(0.0, min(wake, default=now + 0.01) - now)
      if any(r not in reading for r in running) or not reading:
        timeout = min(timeout, 0.005)  # Its pipes are closed: poll for its exit.
      for key, _ in sel.select(timeout=timeout):
        r = owner[key.fileobj]
        data = os.read(key.fd, 65536)
        if not data:
          sel.unregister(key.fileobj)
          continue
        buf, room = r.bufs[key.fileobj], r.job.limits.output_bytes - len(r.bufs[key.fileobj])
        r.truncated = r.truncated or len(data) > room
        buf += data[:max(room, 0)]
  finally:
    sel.close()
  for r in runs:
    r.proc.wait()


# --- availability and pools ---------------------------------------------------------------------

_available: str | None = None  # "" once checked and fine; else the reason


def check_available() -> None:
  """Raises SandboxError (a RuntimeError), one line naming what is missing, when this host cannot
  build the sandbox; runs a test program once per process otherwise."""
  global _available
  if _available is None:
    _available = _why_unavailable()
  if _available:
    raise SandboxError(_available)


def _why_unavailable() -> str:
  try:
    _host()
    r = run_python("import socket; print('ok')", limits=Limits(cpu_s=5, wall_s=20), sandbox="namespaces")
  except SandboxError as e:
    return str(e)
  if r.stdout.strip() != "ok":
    return (f"sandbox: a test program failed in the sandbox (exit {r.exit_code}, signal {r.killed_by_signal}): "
            + " | ".join(r.stderr.strip().splitlines()[-3:]))
  return ""


class SandboxPool:
  """Runs programs in up to `workers` sandboxes at once (threads; each run has its own uid and cgroup)."""

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
