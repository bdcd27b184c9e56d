"""Console lines of long phases: `Progress` (count, bar, rate, ETA), `say` and `timed`.

Every library message a user is meant to read goes through here (diagnostics go to `logging`):

    with console.Progress(len(tensors), "GGUF tensors", unit="tensor") as p:
      for t in tensors:
        ...
        p.update(1)

prints, at most every `every_s` seconds and once at the end,

    GGUF tensors [########............]  120/291 tensor  35.2 tensor/s  ETA 5s
"""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable, TextIO

WIDTH = 20  # characters of the bar


def bar(done: float, total: float) -> str:
  filled = int(WIDTH * min(done / total, 1.0)) if total > 0 else WIDTH
  return "[" + "#" * filled + "." * (WIDTH - filled) + "]"


def duration(seconds: float) -> str:
  """12s, 3m04s, 2h05m: short and fixed-order, for rates and ETAs."""
  s = int(round(max(seconds, 0.0)))
  if s < 60:
    return f"{s}s"
  if s < 3600:
    return f"{s // 60}m{s % 60:02d}s"
  return f"{s // 3600}h{s // 60 % 60:02d}m"


def size(num_bytes: float) -> str:
  for unit in ("B", "KB", "MB", "GB"):
    if num_bytes < 1024 or unit == "GB":
      return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
    num_bytes /= 1024
  return ""


def say(message: str, stream: TextIO | None = None) -> None:
  """One line for the user, flushed at once (a long run's output is often piped to a file)."""
  print(message, file=stream or sys.stdout, flush=True)


class Progress:
  """Progress of `total` units of work: `update(n, **values)` after each piece.

  A line is printed on the first update, then at most every `every_s` seconds, and when the
  count reaches `total` (or on `close`); `values` (e.g. loss=0.53) are appended to it. The rate
  and ETA are measured from the first update, so a compile in the first piece does not make
  the ETA of the rest look long for the whole phase.
  """

  def __init__(self, total: int, label: str, unit: str = "it", every_s: float = 10.0,
               stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic,
               enabled: bool = True):
    self.total, self.label, self.unit, self.every_s = int(total), label, unit, every_s
    self.stream, self.clock, self.enabled = stream, clock, enabled
    self.n = 0
    self.start = clock()
    self._first: tuple[float, int] | None = None  # (time, count) just after the first update
    self._last_print = -float("inf")
    self._printed_n = -1
    self._closed = False
    self.values: dict[str, float] = {}

  def __enter__(self) -> "Progress":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def rate(self) -> float:
    """Units per second since the first update (over the whole phase until the second one)."""
    now = self.clock()
    t0, n0 = self._first if self._first is not None and self.n > self._first[1] else (self.start, 0)
    return (self.n - n0) / max(now - t0, 1e-9)

  def line(self) -> str:
    rate = self.rate()
    parts = [f"{self.label} {bar(self.n, self.total)} {self.n:>{len(str(self.total))}}/{self.total} {self.unit}",
             f"{rate:.0f} {self.unit}/s" if rate >= 100 else f"{rate:.3g} {self.unit}/s" if rate >= 1
             else f"{1 / max(rate, 1e-9):.3g} s/{self.unit}"]
    if self.n < self.total and not self._closed:
      parts.append(f"ETA {duration((self.total - self.n) / max(rate, 1e-9))}")
    else:
      parts.append(f"{'in' if self.n >= self.total else 'stopped after'} {duration(self.clock() - self.start)}")
    parts += [f"{k.replace('_', ' ')} {v:.3g}" for k, v in self.values.items()]
    return "  ".join(parts)

  def due(self, n: int = 1) -> bool:
    """Whether `update(n)` will print: fetch the values to show (a host sync) only then."""
    return (self.n + n >= self.total or self._printed_n < 0
            or self.clock() - self._last_print >= self.every_s)

  def update(self, n: int = 1, **values: float) -> None:
    self.n += n
    if self._first is None:
      self._first = (self.clock(), self.n)
    self.values.update({k: float(v) for k, v in values.items()})
    now = self.clock()
    if self.n >= self.total or self._printed_n < 0 or now - self._last_print >= self.every_s:
      self._print(now)

  def close(self) -> None:
    """Prints the final line unless it already was printed."""
    self._closed = True
    if self._printed_n != self.n:
      self._print(self.clock())

  def _print(self, now: float) -> None:
    self._last_print, self._printed_n = now, self.n
    if self.enabled:
      say(self.line(), self.stream)


@contextlib.contextmanager
def timed(label: str, stream: TextIO | None = None, enabled: bool = True):
  """`label ...` before a one-piece phase and `label: done in 12s` after it; the caller may add
  to the closing line with `info["detail"] = "3.2 GB"`."""
  info = {"detail": ""}
  t0 = time.monotonic()
  if enabled:
    say(f"{label} ...", stream)
  yield info
  if enabled:
    detail = f" ({info['detail']})" if info["detail"] else ""
    say(f"{label}: done in {time.monotonic() - t0:.1f}s{detail}", stream)
