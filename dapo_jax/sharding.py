"""The device mesh and the logical-axis rules that place every array on it.

Mesh axes are (data, fsdp, expert, sequence, tensor). Every array is named by the one-letter shape alphabet
of `datatypes` (`x_BTD`, `wq_DNH`); `LOGICAL` turns those letters into logical axis names
and the rule tables below map logical names onto mesh axes.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import linen as nn
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "expert", "sequence", "tensor")
# Rows are split over these axes. The expert axis holds whole experts of a mixture-of-experts
# model; outside the expert layers its devices work as more data shards.
BATCH_AXES = ("data", "fsdp", "expert")

# One letter per axis (datatypes.py has the full alphabet) -> logical axis name.
LOGICAL = {
    "Q": "batch", "B": "batch", "T": "seq", "C": "seq", "P": "seq", "S": "kv_seq",
    "D": "embed", "F": "mlp", "V": "vocab", "N": "heads", "K": "kv_heads",
    "H": "head_dim", "L": "layers", "E": "expert",
}

Rules = Sequence[tuple[str, Any]]

# Parameters: FSDP shards the model width, tensor parallelism the heads, MLP and vocab.
PARAM_RULES: Rules = (
    ("batch", None), ("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"),
    ("kv_heads", "tensor"), ("vocab", "tensor"), ("seq", None), ("kv_seq", None),
    ("head_dim", None), ("layers", None), ("expert", "expert"),
)
# Activations in the train step: the batch is split over data, fsdp and expert, a row's tokens over
# sequence (the keys and values each shard's queries read are gathered: "kv_seq" stays whole).
ACT_RULES: Rules = (
    ("batch", BATCH_AXES), ("embed", None), ("mlp", "tensor"), ("heads", "tensor"),
    ("kv_heads", "tensor"), ("vocab", "tensor"), ("seq", "sequence"), ("kv_seq", None),
    ("head_dim", None), ("layers", None), ("expert", "expert"),
)
# Sampling keeps whole weights per tensor shard (no FSDP gather per decoded token).
SAMPLING_PARAM_RULES: Rules = tuple((k, None if v == "fsdp" else v) for k, v in PARAM_RULES)


def mesh_devices(mesh_cfg: Mapping[str, int]) -> int | None:
  """The device count a mesh names (the product of its axes), or None when an axis is -1 (the rest)."""
  sizes = [int(mesh_cfg.get(a, 1)) for a in MESH_AXES]
  return None if -1 in sizes else math.prod(sizes)


def mesh_shape(mesh_cfg: Mapping[str, int], num_devices: int) -> dict[str, int]:
  """The (data, fsdp, expert, sequence, tensor) sizes of `mesh_cfg` on `num_devices` devices: one size may be
  -1 for "the rest of the devices", an axis left out has size 1. Raises ValueError naming the mesh."""
  sizes = {a: mesh_cfg.get(a, 1) for a in MESH_AXES}
  for a, v in sizes.items():
    if not isinstance(v, int) or isinstance(v, bool) or not (v >= 1 or v == -1):
      raise ValueError(f"mesh.{a}={v!r}: expected a positive size, or -1 for the rest of the devices")
  unknown = [a for a, v in sizes.items() if v == -1]
  if len(unknown) > 1:
    raise ValueError(f"mesh={sizes}: at most one axis may be -1 (the rest of the devices)")
  fixed = math.prod(v for v in sizes.values() if v != -1)
  if unknown:
    if num_devices % fixed:
      raise ValueError(f"mesh={sizes}: the fixed axes multiply to {fixed}, which does not divide the "
                       f"{num_devices} devices")
    sizes[unknown[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise ValueError(f"mesh={sizes}: data*fsdp*expert*sequence*tensor = {fixed}, but there are {num_devices} "
                     "devices")
  return sizes


def make_mesh(mesh_cfg: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the (data, fsdp, expert, sequence, tensor) mesh of `mesh_shape(mesh_cfg, len(devices))` (other keys,
  e.g. `rollout_devices`, are not axes: see `split_meshes`)."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = mesh_shape({a: int(v) for a, v in mesh_cfg.items()}, len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  try:
    dev_array = mesh_utils.create_device_mesh(shape, devices)
  except Exception:  # Host CPU devices have no topology to optimise for.
    dev_array = np.asarray(devices).reshape(shape)
  return Mesh(dev_array, MESH_AXES)


def split_meshes(mesh_cfg: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> tuple[Mesh, Mesh | None]:
  """(the trainer's mesh, the rollout's mesh or None). With `mesh_cfg["rollout_devices"]` = R > 0 the
  first R devices run the rollout engine and the rest train, each on the mesh of `mesh_cfg`'s axes
  (a -1 axis takes the rest of its own devices); the policy moves over at each rollout step
  (`Rollout.sampling_params`). R = 0: one mesh over every device, shared."""
  devices = list(jax.devices() if devices is None else devices)
  R = int(mesh_cfg.get("rollout_devices", 0) or 0)
  if not R:
    return make_mesh(mesh_cfg, devices), None
  return make_mesh(mesh_cfg, devices[R:]), make_mesh(mesh_cfg, devices[:R])


def batch_shards(mesh_shape: Mapping[str, int]) -> int:
  """How many shards the rows of a batch are split into."""
  return math.prod(mesh_shape.get(a, 1) for a in BATCH_AXES)


def axes_of(letters: str) -> tuple[str, ...]:
  """'BTD' -> ('batch', 'seq', 'embed')."""
  return tuple(LOGICAL[c] for c in letters)


def spec(letters_or_axes: str | Sequence[str | None], rules: Rules = ACT_RULES) -> P:
  """The PartitionSpec of an array named by its shape letters or logical axes."""
  axes = axes_of(letters_or_axes) if isinstance(letters_or_axes, str) else tuple(letters_or_axes)
  return nn.logical_to_mesh_axes(axes, rules)


def constrain(x: jax.Array, letters: str, rules: Rules = ACT_RULES) -> jax.Array:
  """Sharding constraint at a block edge; a no-op outside a mesh context."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, spec(letters, rules))


def named(mesh: Mesh, letters_or_axes: str | Sequence[str | None], rules: Rules = ACT_RULES) -> NamedSharding:
  return NamedSharding(mesh, spec(letters_or_axes, rules))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def check_divisible(model_cfg, mesh: Mesh) -> None:
  """Fails early, with the numbers, when a sharded dimension does not divide its mesh axes."""
  t, f, e = mesh.shape["tensor"], mesh.shape["fsdp"], mesh.shape.get("expert", 1)
  checks = {"num_heads": (model_cfg.num_heads, t), "num_kv_heads": (model_cfg.num_kv_heads, t),
            "mlp_dim": (model_cfg.mlp_dim, t), "vocab_size": (model_cfg.vocab_size, t),
            "embed_dim": (model_cfg.embed_dim, f)}
  if model_cfg.vision is not None:  # The tower's width over fsdp, its MLP over tensor.
    v = model_cfg.vision
    checks.update({"vision.embed_dim": (v.embed_dim, f), "vision.mlp_dim": (v.mlp_dim, t)})
  if model_cfg.moe:
    checks.update(num_experts=(model_cfg.num_experts, e), expert_mlp_dim=(model_cfg.expert_mlp_dim, t))
  elif e > 1:
    raise ValueError(f"mesh.expert={e}: a dense model (model.num_experts=0) has no experts to split; "
                     "use mesh.data or mesh.fsdp for these devices")
  bad = [f"model.{k}={n} is not divisible by mesh size {m}" for k, (n, m) in checks.items() if n % m]
  if bad:
    raise ValueError("mesh does not fit the model: " + "; ".join(bad) + f" (mesh {dict(mesh.shape)})")


# --- host <-> global arrays (one code path for 1 process and for many) -------------------------

def put(tree: Any, shardings: Any) -> Any:
  """Host arrays that are identical on every process -> global arrays with the given shardings."""
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)
  if isinstance(shardings, NamedSharding):
    shardings = jax.tree.map(lambda _: shardings, tree)
  return jax.tree.map(lambda x, s: jax.make_array_from_callback(np.shape(x), s, lambda idx: np.asarray(x)[idx]),
                      tree, shardings)


def fetch(tree: Any) -> Any:
  """Global arrays -> the same full NumPy arrays on every process."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  from jax.experimental import multihost_utils
  return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
                      if isinstance(x, jax.Array) else x, tree)


def gather_hosts(x: np.ndarray) -> np.ndarray:
  """Concatenates each process's host-local rows along axis 0, in process order, on every process."""
  if jax.process_count() == 1:
    return np.asarray(x)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(np.asarray(x), tiled=True))
