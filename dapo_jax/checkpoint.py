"""Orbax checkpoints of the whole run: train state (params, optimizer, counters) plus a JSON
record of everything host-side (rollout step, data-iterator state, carried-over rollouts, seed).

Orbax writes each step to a temporary directory and renames it when complete, so a crash or a
full disk mid-write never leaves a checkpoint that `latest_step` would pick up. Bytes damaged
after that (a partial overwrite, a truncated file) are caught by a digest saved with each step:
a 64-bit checksum of every array, computed on the devices where the array lives (so only 8 bytes
per array reach the host, and sharded arrays need no gather), and a SHA-256 of the JSON record.
`restore` verifies both; `restore_latest` falls back to the newest intact step.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import signal
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from dapo_jax import console, errors


class CheckpointMismatchError(errors.UserError, ValueError):
  """A checkpoint written by another config (names, shapes, dtypes or seed differ)."""


class CheckpointCorruptError(errors.UserError, ValueError):
  """A checkpoint whose bytes do not match the digest saved with it, or that cannot be read."""


class Checkpointer:
  # Restoring a checkpoint at least this large prints a line before and after (size, seconds).
  announce_bytes = 256 << 20

  def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                           create=True)
    # Arrays are written uncompressed. zstd bought ~7% on float weights and optimizer moments, at
    # the price of an encoded copy of every array held until its write ends: with the host arrays
    # of a CPU run being views of the live buffers (no transfer copy), that copy was the write's
    # whole extra memory, and the slower half of its time.
    arrays = lambda: ocp.PyTreeCheckpointHandler(use_compression=False)  # noqa: E731
    self.manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"state": arrays(), "extra": ocp.JsonCheckpointHandler(),
                       "digest": ocp.JsonCheckpointHandler(), "critic": arrays()})

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def save(self, step: int, state: Any, extra: dict, critic: Any = None) -> None:
    """Starts an async save of `state` and `extra` (and PPO's value-model state `critic`) with their
    digest; `wait()` ends it. The policy's state stays the `state` item whether or not a critic is
    saved beside it, so evaluation and export read every run's checkpoints alike."""
    # The checksums run first, a group of arrays at a time (`state_digest`); only their 8-byte
    # results are fetched. The state is final here (the step's metrics were fetched), so this
    # waits for no training work. Orbax then writes from the live buffers (on CPU its host arrays
    # are views of them, not copies), which is why the loop waits for the write before an update
    # donates them.
    _check_arrays(step, state, "state")
    if critic is not None:
      _check_arrays(step, critic, "critic")
    digest = {"arrays": state_digest(state), "extra": extra_digest(extra)}
    items = dict(state=ocp.args.PyTreeSave(state), extra=ocp.args.JsonSave(extra))
    if critic is not None:
      digest["critic"] = state_digest(critic)
      items["critic"] = ocp.args.PyTreeSave(critic)
    try:
      self.manager.save(step, args=ocp.args.Composite(digest=ocp.args.JsonSave(digest), **items), force=True)
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

  def check_compatible(self, step: int, abstract_state: Any, item: str = "state") -> None:
    """Fails with the parameter's name when the checkpoint was written by another model config.

    Names, shapes and dtypes must all match: no dtype conversion is allowed on restore, because a
    resumed run must continue from exactly the saved values (Orbax would cast silently, e.g. a
    float32 checkpoint into bfloat16 parameters). To change dtypes, export the model and start a
    new run from it.
    """
    meta = self.manager.item_metadata(step)[item]
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
      got_dtype = getattr(got, "dtype", None)
      if got_dtype is not None and _old_counter(np.dtype(got_dtype), leaf):
        logging.warning("checkpoint %s/%d: %s was written as an int64 scalar (a step without an update, "
                        "by an older version); restored as %s", self.directory, step, name,
                        np.dtype(leaf.dtype).name)
      elif got_dtype is not None and np.dtype(got_dtype) != np.dtype(leaf.dtype):
        raise CheckpointMismatchError(
            f"checkpoint {self.directory}/{step}: {name} has dtype {np.dtype(got_dtype).name}, but the config "
            f"needs {np.dtype(leaf.dtype).name}; restoring converts no dtype (set the config's dtype to "
            f"{np.dtype(got_dtype).name}, or export the model and start a new --workdir from it)")

  def restore(self, step: int, abstract_state: Any, abstract_critic: Any = None) -> tuple:
    """(state, extra) of `step`, verified against its digest, or (state, extra, critic) when
    `abstract_critic` asks for the value model too; raises CheckpointCorruptError if damaged."""
    path = self.path(step)
    if abstract_critic is not None and not os.path.isdir(os.path.join(path, "critic")):
      raise CheckpointMismatchError(f"checkpoint {path} has no value model (critic); it was written by a run "
                                    "without dapo.adv_estimator='gae' (use a new --workdir)")
    try:
      self.check_compatible(step, abstract_state)
      if abstract_critic is not None:
        self.check_compatible(step, abstract_critic, "critic")
    except CheckpointMismatchError:
      raise
    except Exception as e:  # Unreadable metadata: the checkpoint itself is damaged.
      raise CheckpointCorruptError(f"checkpoint {path}: metadata cannot be read ({_brief(e)})") from e
    has_digest = os.path.isdir(os.path.join(path, "digest"))
    items = dict(state=_restore_args(abstract_state), extra=ocp.args.JsonRestore())
    if abstract_critic is not None:
      items["critic"] = _restore_args(abstract_critic)
    if has_digest:
      items["digest"] = ocp.args.JsonRestore()
    num_bytes = _dir_bytes(path)
    announce = num_bytes >= self.announce_bytes and jax.process_index() == 0
    with console.timed(f"restoring checkpoint {path} ({console.size(num_bytes)})", enabled=announce):
      try:
        out = self.manager.restore(step, args=ocp.args.Composite(**items))
      except Exception as e:  # Orbax and TensorStore raise many types for unreadable bytes.
        raise CheckpointCorruptError(f"checkpoint {path} cannot be read ({_brief(e)})") from e
    if not has_digest:
      logging.warning("checkpoint %s has no digest (written by an older version); restored unverified", path)
    else:
      _verify(path, out["digest"], out["state"], out["extra"])
      if abstract_critic is not None:
        _verify_arrays(path, out["digest"].get("critic"), out["critic"])
    logging.info("restored checkpoint %s", path)
    if abstract_critic is not None:
      return out["state"], out["extra"], out["critic"]
    return out["state"], out["extra"]

  def restore_latest(self, abstract_state: Any, abstract_critic: Any = None) -> tuple | None:
    """(step, state, extra[, critic]) of the newest intact checkpoint, or None when there is none at all.

    A damaged step is reported with a warning naming its path, and the next older one is tried;
    when every step is damaged, one CheckpointCorruptError names them all.
    """
    steps = self.all_steps()
    damaged = []
    for step in reversed(steps):
      try:
        restored = self.restore(step, abstract_state, abstract_critic)
      except CheckpointCorruptError as e:
        logging.warning("%s; falling back to an older checkpoint", e)
        damaged.append(self.path(step))
        continue
      if damaged:
        self._set_aside(damaged)
      return (step, *restored)
    if damaged:
      raise CheckpointCorruptError(f"every checkpoint in {self.directory} is damaged ({', '.join(damaged)}); "
                                   "delete them to start over, or restore them from a backup")
    return None

  def _set_aside(self, paths: list[str]) -> None:
    """Renames damaged steps newer than the one restored (kept for inspection), so the resumed
    run can write those steps again; Orbax ignores directory names that are not step numbers."""
    if jax.process_index() == 0:
      for p in paths:
        dst, n = f"{p}.damaged", 1
        while os.path.exists(dst):
          dst, n = f"{p}.damaged{n}", n + 1
        os.rename(p, dst)
        logging.warning("moved the damaged checkpoint %s to %s", p, dst)
    self.manager.reload()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def _restore_args(abstract_tree: Any) -> ocp.args.PyTreeRestore:
  """Restore into the shapes, dtypes and shardings of `abstract_tree` (what StandardRestore does)."""
  return ocp.args.PyTreeRestore(abstract_tree, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_tree))


# --- digests -------------------------------------------------------------------------------------

def _bits(x_: jax.Array) -> jax.Array:
  """The raw bits of an array as uint32 (one word per element; 64-bit dtypes fold both halves)."""
  if jax.dtypes.issubdtype(x_.dtype, jax.dtypes.prng_key):
    x_ = jax.random.key_data(x_)
  if x_.dtype == jnp.bool_:
    x_ = x_.astype(jnp.uint8)
  size = x_.dtype.itemsize
  if size == 8:
    w = jax.lax.bitcast_convert_type(x_, jnp.uint32)  # [..., 2]
    return w[..., 0] ^ (w[..., 1] * jnp.uint32(0x9E3779B1))
  return jax.lax.bitcast_convert_type(x_, {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[size]).astype(jnp.uint32)


def _mix(h: jax.Array) -> jax.Array:
  """murmur3's 32-bit finaliser: every input bit flips about half the output bits."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _checksum(x_: jax.Array) -> jax.Array:
  """[2] uint32: sum(w_i * (2i+1)) and sum(mix(w_i ^ mix(i))) over the flat index i, mod 2**32.

  Wrapping integer sums are exact in any order, so the value does not depend on the sharding or
  the device. The first sum changes whenever any single word changes (2i+1 is odd, hence
  invertible mod 2**32); the second, non-linear one makes moved or swapped blocks show too.
  """
  w = _bits(x_)
  idx = jnp.zeros(w.shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(w.ndim)):
    idx = idx + jax.lax.broadcasted_iota(jnp.uint32, w.shape, axis) * jnp.uint32(stride % 2**32)
    stride *= w.shape[axis]
  return jnp.stack([jnp.sum(w * (2 * idx + 1), dtype=jnp.uint32),
                    jnp.sum(_mix(w ^ _mix(idx + jnp.uint32(0x6A09E667))), dtype=jnp.uint32)])


@functools.partial(jax.jit)
def _checksums(tree: Any) -> Any:
  return jax.tree.map(_checksum, tree)


# Arrays checksummed per program. XLA:CPU does not fuse the elementwise words into the sums (it
# rewrites a long reduction into a chain of reduce-windows), so a program holds two word arrays
# (uint32, one word per element) per input array: checksumming the whole state in one program cost
# twice its size in host memory, the peak of a CPU fine-tune. In groups of this many bytes of
# words, the extra memory is twice one group (or the largest array). Accelerators fuse the sums;
# for them the groups only add a few dispatches.
DIGEST_GROUP_BYTES = 64 << 20


def state_digest(state: Any) -> dict[str, str]:
  """{array path: 16 hex digits}: a checksum of every array of `state`, computed where it lives."""
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  sums, group, group_bytes = [], [], 0
  for _, leaf in leaves:
    group.append(leaf)
    group_bytes += 4 * leaf.size  # One uint32 word per element (`_bits`), whatever the dtype.
    if group_bytes >= DIGEST_GROUP_BYTES:
      sums += jax.device_get(_checksums(group))  # Fetched before the next group starts: one at a time.
      group, group_bytes = [], 0
  sums += jax.device_get(_checksums(group)) if group else []
  return {"/".join(_names(p)): f"{int(s[0]):08x}{int(s[1]):08x}" for (p, _), s in zip(leaves, sums)}


def extra_digest(extra: dict) -> str:
  return hashlib.sha256(json.dumps(extra, sort_keys=True).encode()).hexdigest()


def _verify(path: str, digest: dict, state: Any, extra: dict) -> None:
  if not isinstance(digest, dict) or not isinstance(digest.get("arrays"), dict):
    raise CheckpointCorruptError(f"checkpoint {path}: its digest file is damaged")
  if extra_digest(extra) != digest.get("extra"):
    raise CheckpointCorruptError(f"checkpoint {path}: the run record (extra) does not match its digest")
  _verify_arrays(path, digest["arrays"], state)


def _verify_arrays(path: str, digest: dict | None, state: Any) -> None:
  if not isinstance(digest, dict):
    raise CheckpointCorruptError(f"checkpoint {path}: its digest file is damaged")
  got = state_digest(state)
  bad = [name for name, d in got.items() if digest.get(name) != d]
  if bad:
    raise CheckpointCorruptError(f"checkpoint {path}: {len(bad)} array(s) do not match their digest "
                                 f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")


def _old_counter(got: np.dtype, leaf) -> bool:
  """A scalar int32 counter that an older version saved from a Python int (int64): the one dtype
  change restore allows, since its value fits and its digest was taken of the int32 value."""
  return got == np.int64 and np.dtype(leaf.dtype) == np.int32 and tuple(leaf.shape) == ()


def _check_arrays(step: int, tree: Any, item: str) -> None:
  """Every leaf must carry its own dtype: a Python number would be written as int64 or float64, and
  the resume, which converts no dtype, would refuse the checkpoint."""
  for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not hasattr(leaf, "dtype"):
      raise TypeError(f"checkpoint step {step}: {item} entry {'/'.join(_names(p))} is a Python "
                      f"{type(leaf).__name__} ({leaf!r}), not an array of the state's dtype")


def _dir_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def _brief(e: Exception) -> str:
  """The first line of an error, short enough for a one-line message."""
  text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
  return f"{type(e).__name__}: {text[:200]}"


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


class StopRequest:
  """SIGTERM / SIGINT ask a run to checkpoint and stop at its next safe point (after a step);
  `signal` names the one received (None until then)."""

  def __init__(self):
    self.signal = None
    self._old = {}

  def __enter__(self):
    for s in (signal.SIGTERM, signal.SIGINT):
      try:
        self._old[s] = signal.signal(s, self._handle)
      except ValueError:  # Not the main thread (e.g. a notebook worker): no handler.
        pass
    return self

  def _handle(self, signum, frame):
    self.signal = signal.Signals(signum).name

  def __exit__(self, *exc):
    for s, h in self._old.items():
      signal.signal(s, h)
