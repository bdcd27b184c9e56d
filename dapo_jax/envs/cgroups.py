"""One cgroup per sandbox: it holds all the sandbox's processes, so one memory budget (tmpfs, memfd
and shared memory included; no swap) and one process budget cover everything the sandbox starts,
and one kill reaches all of it.

cgroup v2: ROOT/dapo_sandbox/NAME with memory.max and pids.max; v1: the same under the memory and
pids hierarchies. ROOT is /sys/fs/cgroup unless `ROOT_ENV` names another.
"""
import errno
import os
import signal
import time

from dapo_jax.envs.sandbox_host import SandboxError

ROOT_ENV = "DAPO_SANDBOX_CGROUP_ROOT"  # where the cgroup file systems are mounted; /sys/fs/cgroup


def _write(path: str, value: str) -> None:
  with open(path, "w") as f:
    f.write(value)


def _read_pids(path: str) -> list[int]:
  try:
    with open(path) as f:
      return [int(line) for line in f.read().split()]
  except FileNotFoundError:
    return []


class Cgroups:
  """Where the sandboxes' cgroups are made. cgroup v2: DIR/dapo_sandbox/NAME with memory.max and
  pids.max; v1: the same under the memory and pids hierarchies (below this process's own memory
  cgroup, so an outer limit still holds). Raises SandboxError in one line when neither can be used."""

  def __init__(self):
    root = os.environ.get(ROOT_ENV) or "/sys/fs/cgroup"
    self.v2 = os.path.exists(os.path.join(root, "cgroup.controllers"))
    own = {}
    try:
      with open("/proc/self/cgroup") as f:
        for line in f.read().splitlines():
          _, controllers, path = line.split(":", 2)
          for c in controllers.split(",") if controllers else [""]:
            own[c] = path.lstrip("/")
    except OSError:
      pass
    if self.v2:
      with open(os.path.join(root, "cgroup.controllers")) as f:
        available = f.read().split()
      if not {"memory", "pids"} <= set(available):
        raise SandboxError(f"sandbox: the cgroup v2 hierarchy at {root} lacks the memory or pids controller "
                           f"(it has {available})")
      self.parents = {"": os.path.join(root, "dapo_sandbox")}
      self._enable = [root, self.parents[""]]
    else:
      if not all(os.path.exists(os.path.join(root, c, "cgroup.procs")) for c in ("memory", "pids")):
        raise SandboxError(f"sandbox: no usable cgroup under {root}: neither cgroup v2 (cgroup.controllers) "
                           f"nor v1's memory and pids hierarchies ({ROOT_ENV} sets the root)")
      self.parents = {}
      for c in ("memory", "pids"):
        base = os.path.join(root, c, own.get(c, ""))
        self.parents[c] = os.path.join(base if os.path.isdir(base) else os.path.join(root, c), "dapo_sandbox")
      self._enable = []
    try:
      for parent in self.parents.values():
        os.makedirs(parent, exist_ok=True)
      for path in self._enable:  # v2: the controllers must be on in each parent's subtree_control.
        with open(os.path.join(path, "cgroup.subtree_control")) as f:
          if not {"memory", "pids"} <= set(f.read().split()):
            _write(os.path.join(path, "cgroup.subtree_control"), "+memory +pids")
    except OSError as e:
      raise SandboxError(f"sandbox: cannot create a memory cgroup under {root}: {e}") from None

  def create(self, name: str, memory: int, pids: int) -> "Cgroup":
    """A new group `name` that may hold `memory` bytes (no swap) and `pids` processes and threads."""
    group = Cgroup([os.path.join(p, name) for p in self.parents.values()], self.v2)
    group.remove()  # A group of a process that died mid-run holds this slot's name: clear it.
    try:
      for d in group.dirs:
        os.mkdir(d)
      if self.v2:
        _write(os.path.join(group.dirs[0], "memory.max"), str(memory))
        if os.path.exists(os.path.join(group.dirs[0], "memory.swap.max")):
          _write(os.path.join(group.dirs[0], "memory.swap.max"), "0")
        _write(os.path.join(group.dirs[0], "pids.max"), str(pids))
      else:
        memory_dir, pids_dir = group.dirs
        _write(os.path.join(memory_dir, "memory.limit_in_bytes"), str(memory))
        if os.path.exists(os.path.join(memory_dir, "memory.memsw.limit_in_bytes")):
          _write(os.path.join(memory_dir, "memory.memsw.limit_in_bytes"), str(memory))  # No swap past it.
        _write(os.path.join(pids_dir, "pids.max"), str(pids))
    except OSError as e:
      group.remove()
      raise SandboxError(f"sandbox: cannot create a memory cgroup under {os.path.dirname(group.dirs[0])}: {e}") \
          from None
    return group


class Cgroup:
  """One sandbox's group: its directory in each hierarchy (one on v2; memory's and pids' on v1)."""

  def __init__(self, dirs: list[str], v2: bool):
    self.dirs, self.v2 = dirs, v2

  @property
  def procs_files(self) -> list[str]:
    return [os.path.join(d, "cgroup.procs") for d in self.dirs]

  def pids(self) -> set[int]:
    return {pid for path in self.procs_files for pid in _read_pids(path)}

  def kill(self, wait_s: float = 3.0) -> None:
    """SIGKILLs every process in the group until none is left (new children included)."""
    deadline = time.monotonic() + wait_s
    if self.v2 and os.path.exists(os.path.join(self.dirs[0], "cgroup.kill")):
      try:
        _write(os.path.join(self.dirs[0], "cgroup.kill"), "1")
      except OSError:
        pass
    while pids := self.pids():
      for pid in pids:
        try:
          os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
      if time.monotonic() > deadline:
        raise SandboxError(f"sandbox: processes {sorted(pids)} survived their sandbox ({self.dirs[0]})")
      time.sleep(0.005)

  def oom_kills(self) -> int:
    """How many processes the kernel killed for the group's memory limit."""
    path = os.path.join(self.dirs[0], "memory.events" if self.v2 else "memory.oom_control")
    try:
      with open(path) as f:
        fields = dict(line.split() for line in f.read().splitlines() if len(line.split()) == 2)
    except OSError:
      return 0
    return int(fields.get("oom_kill", 0))

  def remove(self) -> None:
    """Kills what is left and removes the group (its memory, tmpfs included, is freed)."""
    if not any(os.path.isdir(d) for d in self.dirs):
      return
    self.kill()
    for d in self.dirs:
      for attempt in range(200):  # Exiting tasks keep a group busy for a moment.
        try:
          os.rmdir(d)
          break
        except FileNotFoundError:
          break
        except OSError as e:
          if e.errno != errno.EBUSY or attempt == 199:
            raise SandboxError(f"sandbox: cannot remove the cgroup {d}: {e}") from None
          self.kill()
          time.sleep(0.005)
