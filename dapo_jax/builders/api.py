"""The Python API: a DAPO run built from a config, to train, evaluate, sample from and export.

    import dapo_jax
    with dapo_jax.Run("configs/default.py", workdir="runs/nb", **{"train.num_steps": 20}) as run:
      run.train()                                   # held-out accuracy before and after, as launch.train
      run.sample(["What is 38+46?"], temperature=0)  # [["... 84"]]
      run.export("exported/")                       # a directory transformers loads

It is what `python -m launch.train` runs (`builders.dapo`), held open: the run's state, engine and
reward workers live until `close` (or the end of the `with` block). `train(until_step)` trains up to
that rollout step and can be called again to go on; a workdir that holds checkpoints resumes.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
from typing import Sequence

import jax

from dapo_jax import loop as loop_lib
from dapo_jax.builders import record, rl, task
from dapo_jax.errors import ConfigError

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where a config path is looked for when it is not found as given: a checkout's configs/, then the
# installed package's own (dapo_jax/configs).
CONFIG_DIRS = (os.path.join(os.path.dirname(_PACKAGE), "configs"), os.path.join(_PACKAGE, "configs"))


def load_config(path: str = "configs/default.py", **overrides):
  """The ConfigDict of `path[:ARG]` (as `--config` takes it) with `overrides` ("section.field": value,
  as `--config.section.field=value`), locked so that a misspelt field fails."""
  file, _, arg = path.partition(":")
  candidates = [file] + [os.path.join(d, os.path.basename(file)) for d in CONFIG_DIRS]
  found = next((c for c in candidates if os.path.isfile(c)), None)
  if found is None:
    raise ConfigError(f"config file {file!r} not found (looked in ., {', '.join(CONFIG_DIRS)})")
  try:  # Config files import their siblings as `configs`; installed, that is dapo_jax.configs.
    importlib.import_module("configs")
  except ImportError:
    import sys
    sys.modules["configs"] = importlib.import_module("dapo_jax.configs")
  spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(found))[0], found)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config(arg or None)
  cfg.lock()  # Before the overrides: a misspelt field is an error, not a new field.
  return override(cfg, overrides, found)


def override(cfg, overrides: dict, source: str = "config"):
  """`cfg` with `overrides` ("section.field": value) applied; a ConfigError naming a bad one."""
  try:
    cfg.update_from_flattened_dict(dict(overrides))
  except (AttributeError, KeyError, TypeError) as e:
    raise ConfigError(f"{source}: an override names no config field or has the wrong type: {e}") from None
  return cfg


class Run:
  """One DAPO run (see the module doc). `config`: a ConfigDict or a path `file[:ARG]`; `overrides`
  apply to a path's config ("train.num_steps": 20)."""

  def __init__(self, config="configs/default.py", workdir: str = "runs/api", **overrides):
    self.cfg = load_config(config, **overrides) if isinstance(config, str) else override(config, overrides)
    self.workdir = workdir
    self._loop: loop_lib.DAPO = rl.dapo(self.cfg, workdir)  # Builds it all, SFT warm start included.

  # --- what a run is ----------------------------------------------------------------------------

  @property
  def model_config(self):
    return self._loop.rollout.model_cfg

  @property
  def tokenizer(self):
    return self._loop.rollout.tok

  @property
  def params(self):
    """The policy's parameters now (a pytree of arrays on the mesh)."""
    return self._loop.state.params

  # --- what a run does --------------------------------------------------------------------------

  def train(self, until_step: int | None = None) -> dict:
    """Trains up to rollout step `until_step` (default `train.num_steps`), evaluating and checkpointing
    as the config says, and checkpoints at the end; returns the last step's metrics."""
    steps = self.cfg.train.num_steps if until_step is None else until_step
    self._loop.cfg = dataclasses.replace(self._loop.cfg, num_steps=steps)
    return self._loop.run()

  def evaluate(self) -> dict:
    """Held-out metrics of the policy now (val/acc/mean@k, greedy, ...), as a run logs them."""
    return self._loop.evaluate()

  def sample(self, prompts: Sequence[str], k: int = 1, temperature: float | None = None,
             max_new_tokens: int | None = None, seed: int = 0, raw: bool = False) -> list[list[str]]:
    """`k` completions of each prompt by the policy now. A prompt is put as the run's training prompts
    were (the task's instruction and worked examples; `raw=True`: as given, one user turn)."""
    rollout = self._loop.rollout
    put = list(prompts) if raw else [task.user_prompt(self.cfg, p) for p in prompts]
    sampler_cfg = self._loop.evaluator.sampler_cfg
    sampler_cfg = dataclasses.replace(
        sampler_cfg, temperature=sampler_cfg.temperature if temperature is None else temperature,
        max_new_tokens=max_new_tokens or sampler_cfg.max_new_tokens)
    texts = rollout.decode(rollout.generate(rollout.sampling_params(self.params), put, k, jax.random.key(seed),
                                            sampler_cfg))
    return [texts[i * k:(i + 1) * k] for i in range(len(put))]

  def export(self, out_dir: str) -> str:
    """Writes the policy now as a Hugging Face model directory (with its tokenizer); returns it."""
    from dapo_jax.hf import convert as hf
    hf.save(out_dir, self.model_config, jax.device_get(self.params), tokenizer=self.tokenizer)
    return out_dir

  # --- its life ---------------------------------------------------------------------------------

  def close(self) -> None:
    """Stops the reward workers and the checkpointer, and releases the workdir."""
    self._loop.close()
    record.release(self.workdir)

  def __enter__(self) -> "Run":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
