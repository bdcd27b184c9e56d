"""Readings of the machine around a timed step, apart from the step: the seconds JAX spent compiling
and Python collecting garbage in it, how fast a core and the memory answer right now, and the
core-seconds this process, the rest of the machine and the hypervisor took."""
import contextlib
import os
import time


@contextlib.contextmanager
def compile_seconds():
  """A list whose last entry accumulates the seconds JAX spends tracing, lowering and compiling
  (the caller appends a new entry per step): what makes one step of a steady run slower than another."""
  import jax
  spent = [0.0]
  events = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
            "/jax/core/compile/backend_compile_duration")

  def listen(event, duration, **_):
    if event in events:
      spent[-1] += duration
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield spent
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


def core_speed(n: int = 200_000) -> float:
  """Seconds of a fixed single-threaded Python loop: how fast a core runs right now, apart from JAX
  (its thread pools, programs and memory): a slower reading is a slower machine."""
  t0 = time.perf_counter()
  total = 0
  for i in range(n):
    total += i * i
  return time.perf_counter() - t0


_MEMORY_PROBE = []  # Two 128 MB buffers, made once: far larger than any cache.


def memory_speed() -> float:
  """Seconds of one single-threaded copy of 128 MB: how fast this machine's memory answers right now,
  which `core_speed` (a loop that lives in a core's L1 cache) cannot see. Slower here and not there:
  memory bandwidth or the last-level cache shared with other work (another tenant of the host)."""
  import numpy as np
  if not _MEMORY_PROBE:
    _MEMORY_PROBE.extend(np.ones(2, np.float32).repeat(1 << 25).reshape(2, -1))
  src, dst = _MEMORY_PROBE
  t0 = time.perf_counter()
  np.copyto(dst, src)
  return time.perf_counter() - t0


def cpu_seconds() -> dict:
  """Core-seconds since boot from /proc: this process's (every thread), the whole machine's busy
  time, and the time the hypervisor gave the virtual cores to others (steal); {} where there is no
  /proc. Differences between two readings say whether a slow step ran on a machine busy with other
  work, or one whose cores were taken away."""
  try:
    hz = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
      user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    with open("/proc/self/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
    minflt, utime, stime = int(fields[7]), int(fields[11]), int(fields[12])
  except (OSError, ValueError):
    return {}
  return {"own": (utime + stime) / hz, "own_system": stime / hz, "page_faults": minflt,
          "busy": (user + nice + system + irq + softirq) / hz, "steal": steal / hz}


@contextlib.contextmanager
def gc_seconds():
  """As `compile_seconds`, for the pauses of Python's garbage collector (in any thread: a collection
  holds the interpreter lock, so every thread waits)."""
  import gc
  spent, started = [0.0], {}

  def listen(phase, info):
    if phase == "start":
      started["t"] = time.perf_counter()
    elif "t" in started:
      spent[-1] += time.perf_counter() - started.pop("t")
  gc.callbacks.append(listen)
  try:
    yield spent
  finally:
    gc.callbacks.remove(listen)
