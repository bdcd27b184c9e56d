"""Orbax checkpoints of the whole run: train state (params, optimizer, counters) plus a JSON
record of everything host-side (rollout step, data-iterator state, carried-over rollouts, seed).

Orbax writes each step to a temporary directory and renames it when complete, so a crash or a
full disk mid-write never leaves a checkpoint that `latest_step` would pick up.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


class CheckpointMismatchError(ValueError):
  pass


class Checkpointer:
  def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                           create=True)
    self.manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(), "extra": ocp.JsonCheckpointHandler()})

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: Any, extra: dict) -> None:
    try:
      self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     extra=ocp.args.JsonSave(extra)), force=True)
    except OSError as e:
      raise OSError(f"checkpoint step {step} could not be written to {self.directory}: {e}; "
                    "earlier checkpoints are untouched") from e

  def wait(self) -> None:
    """Blocks until the async save is on disk; its errors (a full disk, say) surface here."""
    try:
      self.manager.wait_until_finished()
    except OSError:
      raise
    except Exception as e:  # Orbax wraps errors of its background thread.
      cause = e.__cause__ or e.__context__
      if isinstance(cause, OSError):
        raise cause from e
      if "No space left" in str(e):
        raise OSError(28, f"checkpoint write to {self.directory} failed: {e}") from e
      raise

  def check_compatible(self, step: int, abstract_state: Any) -> None:
    """Fails with the parameter's name when the checkpoint was written by another model config."""
    meta = self.manager.item_metadata(step)["state"]
    meta = getattr(meta, "tree", meta)
    want = [(_names(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]]
    have = {_names(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(meta)[0]}
    for path, leaf in want:
      got = have.get(path)
      name = "/".join(path)
      if got is None:
        raise CheckpointMismatchError(f"checkpoint {self.directory}/{step} has no entry {name}; "
                                      "it was written by another config")
      if tuple(getattr(got, "shape", ())) != tuple(leaf.shape):
        raise CheckpointMismatchError(
            f"checkpoint {self.directory}/{step}: {name} has shape {tuple(got.shape)}, but the config "
            f"needs {tuple(leaf.shape)}; it was written by another model config (use a new --workdir)")

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    self.check_compatible(step, abstract_state)
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), extra=ocp.args.JsonRestore()))
    logging.info("restored checkpoint %s/%d", self.directory, step)
    return out["state"], out["extra"]

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def abstract(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), tree, shardings)


def _names(path) -> tuple[str, ...]:
  """A key path as plain names, whether it went through dataclass fields, dicts or tuples."""
  out = []
  for k in path:
    for attr in ("name", "key", "idx"):
      if hasattr(k, attr):
        out.append(str(getattr(k, attr)))
        break
  return tuple(out)
