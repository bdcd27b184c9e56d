"""Freed heap memory goes back to the OS on `host_memory.release`."""
import ctypes

import pytest

from dapo_jax import host_memory


def rss_mb() -> float:
  for line in open("/proc/self/status"):
    if line.startswith("VmRSS"):
      return int(line.split()[1]) / 1024
  raise AssertionError("no VmRSS")


def test_release_returns_freed_heap_pages():
  libc = ctypes.CDLL(None)
  if not hasattr(libc, "malloc_trim"):
    pytest.skip("no malloc_trim in this C library")
  libc.malloc.restype = ctypes.c_void_p
  libc.free.argtypes = [ctypes.c_void_p]
  host_memory.release()
  # 2,000 chunks of 100 KB (below glibc's mmap threshold: heap memory), touched, then freed; the
  # last one stays, so the freed space is inside the heap and not trimmed on free.
  chunks = [libc.malloc(100_000) for _ in range(2000)]
  for c in chunks:
    ctypes.memset(c, 1, 100_000)
  held = rss_mb()
  for c in chunks[:-1]:
    libc.free(c)
  before = rss_mb()
  assert host_memory.release()
  after = rss_mb()
  libc.free(chunks[-1])
  assert before - after > 150, (held, before, after)  # ~200 MB were freed in the heap.


def test_release_trims_again_as_late_frees_land(monkeypatch):
  import time
  calls = []
  monkeypatch.setattr(host_memory, "_malloc_trim", lambda: lambda pad: calls.append(time.perf_counter()))
  t0 = time.perf_counter()
  assert host_memory.release()
  time.sleep(max(host_memory._SETTLE_S) + 0.3)
  assert len(calls) == 1 + len(host_memory._SETTLE_S)
  for at, called in zip(host_memory._SETTLE_S, calls[1:]):
    assert called - t0 >= at


def test_each_xla_compile_ends_with_a_release(monkeypatch):
  import jax
  import jax.numpy as jnp
  calls = []
  host_memory.release_after_compiles()
  monkeypatch.setattr(host_memory, "_malloc_trim", lambda: lambda pad: calls.append(pad))
  f = jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)  # A new function: its first call compiles.
  f(jnp.ones((7, 5))).block_until_ready()
  assert calls, "no release after the compile"
  n = len(calls)
  f(jnp.ones((7, 5))).block_until_ready()  # Cached: no compile, no release.
  assert len(calls) == n
