"""Hands the host allocator's free pages back to the OS between the phases of a step.

On CPU, XLA's buffers (a sampler call's KV cache and decode weights, an update's activations and
gradients) come from the C allocator, and glibc keeps what they free in its arenas: the process's
resident memory then grows towards the sum of the phases' peaks instead of the largest one.
`malloc_trim(0)` after each phase returns those pages (SmolLM2-135M with LoRA, 3 rollout steps:
peak RSS 3.48 -> 2.79 GB at the same step time; docs/benchmarks.md). Where the C library has no
`malloc_trim` (macOS, musl) this is a no-op.

`release_after_compiles` also returns it as each XLA compile ends: a program's first run would otherwise
stand on the compiler's freed working memory (SmolLM2-135M's first update: docs/benchmarks.md).
"""
from __future__ import annotations

import ctypes
import functools
import threading
import time

import jax

# What jax records when XLA has compiled a program, before the program first runs.
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@functools.cache
def _malloc_trim():
  try:
    return ctypes.CDLL(None).malloc_trim
  except (OSError, AttributeError):
    return None


# XLA's runtime threads free a finished program's buffers for up to ~0.3 s after its results are read
# (SmolLM2-135M's update: 0.9 GB more came back 0.1-0.3 s after the first trim), so `release` trims
# again at these delays, in the background, before the next phase stands on those pages.
_SETTLE_S = (0.1, 0.3)


def release() -> bool:
  """Returns the allocator's free memory to the OS now, and again as late frees land (in a background
  thread); False where the C library cannot."""
  trim = _malloc_trim()
  if trim is None:
    return False
  trim(0)
  threading.Thread(target=_trim_later, args=(trim,), daemon=True, name="host_memory.release").start()
  return True


def _trim_later(trim) -> None:
  waited = 0.0
  for at in _SETTLE_S:
    time.sleep(at - waited)
    waited = at
    trim(0)


@functools.cache
def release_after_compiles() -> None:
  """From now on, `release` whenever XLA finishes compiling a program (once per process)."""
  def on_event(event: str, duration: float, **_) -> None:
    if event == _BACKEND_COMPILE_EVENT and (trim := _malloc_trim()) is not None:
      trim(0)
  jax.monitoring.register_event_duration_secs_listener(on_event)
