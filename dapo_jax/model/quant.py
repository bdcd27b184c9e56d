"""Weight-only int8 for a frozen base: symmetric per-output-channel scales, dequantized in the matmul.

A quantized weight is the dict {"int8": w_int8 [.., in.., out..], "scale": fp32 [.., out..]} in
place of the float array, with w ~= w_int8 * scale: every output channel (each column of the
HF [out, in] matrix) has its own scale, max|w| / 127 over its inputs. `layers.dense` computes
(x @ w_int8) * scale, exactly x @ (w_int8 * scale) up to the order of the fp32 rounding.
Only the layers' projection matrices are quantized; embeddings, norms and biases stay in float
(as bitsandbytes' 8-bit loading keeps embeddings and the LM head).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# The layer matrices (stacked [L, in.., out..]) and how many of their axes after L are inputs.
MATRICES = {"wq_DNH": 1, "wk_DKH": 1, "wv_DKH": 1, "wo_NHD": 2, "w_gate_DF": 1, "w_up_DF": 1, "w_down_FD": 1}
KINDS = ("", "int8")


def is_quantized(w) -> bool:
  return isinstance(w, dict) and "int8" in w


def quantize(w: jax.Array, num_in: int, lead: int = 1) -> dict:
  """{"int8", "scale"} of a weight [lead.., in.. (num_in axes), out..]: scale = max|w| / 127 per output
  channel (1 where a channel is all zero), w_int8 = round(w / scale)."""
  w32 = jnp.asarray(w, jnp.float32)
  in_axes = tuple(range(lead, lead + num_in))
  amax = jnp.max(jnp.abs(w32), axis=in_axes, keepdims=True)
  scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  q = jnp.clip(jnp.round(w32 / scale), -127, 127).astype(jnp.int8)
  return {"int8": q, "scale": jnp.squeeze(scale, axis=in_axes)}


def dequantize(w: dict, num_in: int, lead: int = 1) -> jax.Array:
  """The fp32 weight w_int8 * scale of `quantize`'s output."""
  return w["int8"].astype(jnp.float32) * jnp.expand_dims(w["scale"], tuple(range(lead, lead + num_in)))


def cast_after(w_int8: jax.Array, x: jax.Array, dtype) -> jax.Array:
  """w_int8 cast to `dtype` for a matmul with x, as a value XLA can compute only once x exists.

  A bare cast depends on the weight alone, so XLA hoists it out of the sampler's decode loop (and
  schedules every layer's cast up front): the loop then holds a float copy of the whole base (425 MB
  for SmolLM2-135M), the memory int8 storage was meant to save. Selecting between w_int8 and 0 on
  a predicate of x's first element that holds for every float, NaN included (not x > inf), ties
  the cast to x without changing a value, so one layer's float matrix is alive at a time.
  """
  keep = ~(x.reshape(-1)[0] > jnp.inf)
  return jnp.where(keep, w_int8, jnp.zeros((), w_int8.dtype)).astype(dtype)


def quantize_base(params: dict, kind: str = "int8") -> dict:
  """A parameter tree whose layer matrices are int8 (`kind` "int8") or unchanged (`kind` "")."""
  if kind not in KINDS:
    raise ValueError(f"model.base_quant={kind!r}; expected one of {KINDS}")
  if not kind:
    return params
  layers = dict(params["layers"])
  for name, num_in in MATRICES.items():
    if not is_quantized(layers[name]):
      layers[name] = quantize(layers[name], num_in)
  return dict(params, layers=layers)


def dequantize_base(params: dict) -> dict:
  """The float (fp32 for quantized matrices) parameter tree of a possibly quantized one."""
  layers = {k: dequantize(v, MATRICES[k]) if is_quantized(v) else v for k, v in params["layers"].items()}
  return dict(params, layers=layers)


def nbytes(params) -> int:
  """Bytes held by a parameter tree."""
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
