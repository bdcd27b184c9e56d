"""safetensors files and HF checkpoint directories' tensors, on the `safetensors` package.

The package parses and checks every file (header JSON, dtypes, shapes, byte ranges covering the
file) and writes them. Two things are ours: tensors are memory-mapped as NumPy views, bfloat16
included (the package's NumPy API has no bfloat16), and a file the package refuses fails with one
line naming the file and what is wrong in it (`CheckpointError`), not the package's generic reason.
The index of a sharded checkpoint is checked here too.
"""
from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

from dapo_jax import errors
from dapo_jax.paths import outside

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
           "BOOL": np.bool_}
_DTYPE_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class CheckpointError(errors.UserError, ValueError):
  """A checkpoint directory that cannot be read; the message names the file and field."""


# --- one .safetensors file ----------------------------------------------------------------------

_MAX_HEADER = 100_000_000  # The safetensors spec's bound on the JSON header.


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """Memory-maps every tensor of one .safetensors file, once the package has accepted the file."""
  try:
    with safetensors.safe_open(path, framework="np") as f:
      names = list(f.keys())
  except (safetensors.SafetensorError, OSError) as e:
    _read_header(path)  # Raises naming what is wrong, where our checks can tell.
    reason = str(e).removeprefix("Error while deserializing header: ")
    raise CheckpointError(f"{path}: {reason}") from None
  header, data_len = _read_header(path)
  offset = os.path.getsize(path) - data_len
  data = np.memmap(path, dtype=np.uint8, mode="r", offset=offset) if data_len else np.zeros((0,), np.uint8)
  out = {}
  for name in names:
    info = header[name]
    begin, end = info["data_offsets"]
    out[name] = data[begin:end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
  return out


def _read_header(path: str) -> tuple[dict, int]:
  """(header, data length) of a .safetensors file; CheckpointError naming the file if it is malformed."""
  try:
    size = os.path.getsize(path)
  except OSError as e:
    raise CheckpointError(f"{path}: cannot be read ({e.strerror})") from None
  if size < 8:
    raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors file (truncated?)")
  with open(path, "rb") as f:
    (header_len,) = struct.unpack("<Q", f.read(8))
    if header_len > min(size - 8, _MAX_HEADER):
      raise CheckpointError(f"{path}: header length {header_len} does not fit in the file's {size} bytes "
                            "(truncated, or not a safetensors file)")
    raw = f.read(header_len)
  try:
    header = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{path}: header is not valid JSON ({e})") from None
  if not isinstance(header, dict):
    raise CheckpointError(f"{path}: header is a JSON {type(header).__name__}, expected an object")
  data_len = size - 8 - header_len
  for name, info in header.items():
    if name == "__metadata__":
      continue
    _check_entry(path, name, info, data_len)
  return header, data_len


def _check_entry(path: str, name: str, info, data_len: int) -> None:
  where = f"{path}: tensor {name!r}"
  if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
    raise CheckpointError(f"{where}: header entry needs dtype, shape and data_offsets, got {info!r:.100}")
  dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
  if not isinstance(dtype, str) or dtype not in _DTYPES:
    raise CheckpointError(f"{where} has dtype {dtype}, which cannot be read (readable: {sorted(_DTYPES)})")
  ints = lambda xs: isinstance(xs, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                 for x in xs)
  if not ints(shape):
    raise CheckpointError(f"{where}: shape {shape!r:.100} is not a list of non-negative integers")
  if not ints(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
    raise CheckpointError(f"{where}: data_offsets {offsets!r:.100} is not [begin, end] with begin <= end")
  if offsets[1] > data_len:
    raise CheckpointError(f"{where}: data ends at byte {offsets[1]}, past the {data_len} data bytes of the file "
                          "(truncated?)")
  nbytes = int(np.prod(shape, dtype=object)) * np.dtype(_DTYPES[dtype]).itemsize
  if offsets[1] - offsets[0] != nbytes:
    raise CheckpointError(f"{where}: shape {shape} of {dtype} needs {nbytes} bytes, but data_offsets "
                          f"{offsets} span {offsets[1] - offsets[0]}")


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
  """Writes `tensors` as one .safetensors file (the package's writer; bfloat16 through ml_dtypes)."""
  # The package reads each array's buffer as it lies in memory, so it must be contiguous.
  contiguous = {name: np.ascontiguousarray(tensors[name]) for name in sorted(tensors)}
  safetensors.numpy.save_file(contiguous, path, metadata={"format": "pt"})


def read_dir_tensors(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  """All tensors of a model directory and, for error messages, the file each came from."""
  index = os.path.join(path, "model.safetensors.index.json")
  weight_map = None
  if os.path.exists(index):
    weight_map = _read_index(index)
    files = sorted(set(weight_map.values()))
  elif os.path.exists(os.path.join(path, "model.safetensors")):
    files = ["model.safetensors"]
  else:
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json "
                          "(only safetensors checkpoints are supported)")
  tensors, origin = {}, {}
  for fn in files:
    why = outside(path, fn)
    if why:
      raise CheckpointError(f"{index if weight_map else path}: {why}")
    if not os.path.isfile(os.path.join(path, fn)):
      raise CheckpointError(f"{index}: lists {fn!r}, which is not in {path}")
    for name, arr in read_safetensors(os.path.join(path, fn)).items():
      tensors[name], origin[name] = arr, os.path.join(path, fn)
  for name, fn in (weight_map or {}).items():
    if origin.get(name) != os.path.join(path, fn):
      raise CheckpointError(f"{index}: tensor {name!r} is mapped to {fn!r}, which does not hold it")
  return tensors, origin


def _read_index(index: str) -> dict[str, str]:
  """The weight map of a sharded checkpoint's index, checked: tensor name -> file name in the dir."""
  try:
    with open(index) as f:
      weight_map = json.load(f).get("weight_map")
  except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
    raise CheckpointError(f"{index}: not a JSON object ({e})") from None
  if not isinstance(weight_map, dict) or not weight_map or not all(
      isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
    raise CheckpointError(f"{index}: field 'weight_map' must map tensor names to file names")
  for fn in sorted(set(weight_map.values())):
    why = outside(os.path.dirname(index), fn)
    if why:
      raise CheckpointError(f"{index}: weight_map names {why}")
    if os.path.basename(fn) != fn or not fn.endswith(".safetensors"):
      raise CheckpointError(f"{index}: weight_map names {fn!r}; expected a .safetensors file in the same directory")
  return weight_map
