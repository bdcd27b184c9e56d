"""The one supervised loop of SFT, chat SFT, the reward model and DPO.

    params, last_eval = fit.fit(fit.FitConfig(steps=300), trainer, state, batch_at, workdir,
                                evaluate=..., label="RM", prefix="rm")

Each update trains `trainer`'s objective on `batch_at(step)`, a host batch that depends on the
step alone (a seeded draw), so a run resumed from WORKDIR/checkpoints trains on the same batches
and logs the same metrics as one that was never stopped. Metrics go to TensorBoard and
metrics.jsonl under `prefix/`, progress to the console; `evaluate(params)` runs before training,
every `eval_every` updates and at the end; SIGTERM/SIGINT checkpoint and stop after the update in
flight. `done(step, params)` may end a run early (the SFT warm start's probe); the checkpoint then
says so, and a rerun returns it without training.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import jax
import numpy as np

from dapo_jax import checkpoint as ckpt_lib
from dapo_jax import console, metrics, train_step


@dataclasses.dataclass(frozen=True)
class FitConfig:
  """How long a supervised run trains, and how often it logs, evaluates and checkpoints."""
  steps: int
  eval_every: int = 0      # updates between evaluations (0 = before and at the end only)
  ckpt_every: int = 0      # updates between checkpoints (0 = at the end only)
  keep_ckpts: int = 2
  log_every: int = 10      # updates between logged training metrics (and at the end)
  seed: int = 0            # the run's seed, checked against a checkpoint's


def fit(c: FitConfig, trainer: train_step.Trainer, state: train_step.TrainState, batch_at: Callable[[int], Any],
        workdir: str, *, evaluate: Callable[[Any], dict] | None = None, label: str = "fit", prefix: str = "fit",
        console_keys: dict | None = None, done: Callable[[int, Any], str | None] | None = None,
        eval_line: Callable[[dict], str] = metrics.format_eval) -> tuple[Any, dict]:
  """Trains `state` for `c.steps` updates of `batch_at(step)`, resuming from WORKDIR/checkpoints.

  `console_keys` maps metric names of the objective to their console labels; `done(updates, params)`
  returns a message to end the run early (None to go on). Returns (params, the last evaluation).
  """
  evaluate = evaluate or (lambda params: {})
  keys = console_keys or {}
  writer = metrics.MetricWriter(workdir, enabled=jax.process_index() == 0)
  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), keep=c.keep_ckpts)
  try:
    start, finished = 0, False
    restored = ckpt.restore_latest(ckpt_lib.abstract(state, trainer.state_sharding))
    if restored is not None:
      start, state, extra = restored
      if extra.get("seed", c.seed) != c.seed:
        raise ckpt_lib.CheckpointMismatchError(
            f"checkpoint {ckpt.directory}/{start} was written with seed={extra['seed']}, config has seed={c.seed}")
      finished = bool(extra.get("finished"))
      print(f"Resumed from {ckpt.directory} at update {start}.", flush=True)
    last_eval: dict = {}
    if start == 0:
      last_eval = evaluate(state.params)
      if last_eval:
        writer.scalars(0, last_eval)
        print(f"{label} before training: {eval_line(last_eval)}", flush=True)
    with ckpt_lib.StopRequest() as stop, console.Progress(
        c.steps - start, label, unit="step", enabled=start < c.steps and not finished) as progress:
      for step in range(start, c.steps if not finished else start):
        state, m = trainer.step(state.replace(rollout_step=step), trainer.put_batch(batch_at(step)))
        n = step + 1
        logged = n % c.log_every == 0 or n == c.steps
        if logged or progress.due():  # Fetching the metrics waits for the update: only when shown.
          m = jax.device_get(m)
          if logged:
            writer.scalars(n, {f"{prefix}/{k}": float(v) for k, v in m.items()})
          progress.update(1, **{label_: float(m[k]) for k, label_ in keys.items() if k in m})
        else:
          progress.update(1)
        message = done(n, state.params) if done is not None else None
        finished = message is not None
        if (c.eval_every and n % c.eval_every == 0) or n == c.steps or finished:
          last_eval = evaluate(state.params)
          if last_eval:
            writer.scalars(n, last_eval)
            console.say(f"{label} update {n}: {eval_line(last_eval)}")
        if (c.ckpt_every and n % c.ckpt_every == 0) or n == c.steps or finished or stop.signal:
          ckpt.save(n, state, {"step": n, "seed": c.seed, "finished": finished})
        writer.flush()  # A kill -9 loses nothing that was logged.
        if finished:
          console.say(f"{label} update {n}: {message}")
          break
        if stop.signal:
          console.say(f"Stopped by {stop.signal} after update {n}; checkpoint saved in {ckpt.directory}. "
                       "Run the same command again to resume.")
          break
    ckpt.wait()
    if not last_eval:  # Resumed at the end: evaluate what was restored.
      last_eval = evaluate(state.params)
    return state.params, last_eval
  finally:
    ckpt.close()
    writer.close()


def seeded_choice(seed: int, n: int, k: int) -> Callable[[int], np.ndarray]:
  """step -> `k` distinct indices of `n`, drawn from a generator seeded by (seed, step)."""
  return lambda step: np.random.default_rng([seed, step]).choice(n, k, replace=False)
