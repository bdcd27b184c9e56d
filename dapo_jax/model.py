"""Decoder-only transformer of the Llama / Qwen2 / Qwen3 / Gemma 3 families (flax.linen).

RMSNorm, rotary embeddings (with Llama 3 / linear / YaRN scaling), grouped-query attention
(N query heads share K KV heads, N = K*R), SwiGLU MLP, optional QKV bias (Qwen2), tied or untied
embeddings. Qwen3 adds per-head q/k RMSNorm; Gemma 3 adds (1 + w) norms, post-norms around
attention and MLP, GeGLU, a scaled embedding, sliding-window (local) layers with their own RoPE
base, and logit soft-capping. One layer function serves every family. Layers are stacked with
`nn.scan`, so compile time does not grow with depth and every layer parameter has a leading
L axis. Parameters carry logical axis names derived from their shape-suffixed names.
Parameters live in `param_dtype`, activations in `dtype`; the weight matmuls read their operands in
`matmul_dtype` and accumulate in fp32; logits and softmax are fp32.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import linen as nn

from dapo_jax import kv_cache as kvc
from dapo_jax import sharding

Params = Any
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture and numerics of one model. Frozen, so it can be a static jit argument."""
  vocab_size: int          # V
  embed_dim: int           # D
  mlp_dim: int             # F
  num_layers: int          # L
  num_heads: int           # N
  num_kv_heads: int        # K
  head_dim: int            # H
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  qkv_bias: bool = False   # Qwen2 has it, Llama does not
  tie_embeddings: bool = True
  param_dtype: str = "float32"
  dtype: str = "float32"   # compute dtype: bfloat16 on GPU/TPU, float32 on CPU
  matmul_dtype: str = ""   # operands of the weight matmuls ("" = dtype), fp32 accumulation; bfloat16
                           # with dtype=float32 is mixed precision, 2x the matmul rate of CPUs with
                           # AVX512-BF16 (XLA:CPU runs a bf16 dot with f32 output on its fast path)
  remat: str = "none"      # what the backward pass re-computes: none | full (all but each layer's
                           # input) | dots (all but matmul outputs; the fastest on XLA:CPU too)
  attn_chunk: int = 0      # queries per attention block (0 = all at once); bounds score memory for long rows
  arch: str = "qwen2"      # HF family written by hf.save: qwen2 | llama | qwen3 | gemma3
  qk_norm: bool = False    # RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
  # RoPE scaling of the (global) layers, as HF `rope_scaling`: default | linear | llama3 | yarn.
  rope_type: str = "default"
  rope_factor: float = 1.0             # linear, llama3, yarn: context extension factor
  rope_low_freq_factor: float = 1.0    # llama3
  rope_high_freq_factor: float = 4.0   # llama3
  rope_original_max_pos: int = 8192    # llama3, yarn: pre-training context length
  rope_beta_fast: float = 32.0         # yarn ramp bounds (rotations)
  rope_beta_slow: float = 1.0
  rope_attention_factor: float = 0.0   # yarn: cos/sin scale (0 = 0.1 ln(factor) + 1)
  rope_truncate: bool = True           # yarn: round the correction range to whole dims
  # Local (sliding-window) layers, Gemma 3: they attend to the last `sliding_window` positions
  # (the query's own included) and use RoPE base `rope_local_theta`, unscaled.
  sliding_window: int = 0
  local_layers: tuple[int, ...] = ()   # indices of the local layers
  rope_local_theta: float = 10_000.0
  query_scale: float = 0.0             # attention scores scale by query_scale**-0.5 (0 = head_dim)
  attn_softcap: float = 0.0            # scores -> c*tanh(scores/c) before the softmax (0 = off)
  final_softcap: float = 0.0           # logits -> c*tanh(logits/c) (0 = off)

  def __post_init__(self):
    object.__setattr__(self, "local_layers", tuple(int(l) for l in self.local_layers))
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat={self.remat!r}; expected one of {sorted(REMAT_POLICIES)}")
    if self.arch not in ARCHS:
      raise ValueError(f"model.arch={self.arch!r}; expected one of {ARCHS}")
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"model.rope_type={self.rope_type!r}; expected one of {ROPE_TYPES}")
    if self.rope_type != "default" and self.rope_factor <= 0:
      raise ValueError(f"model.rope_factor={self.rope_factor} must be positive")
    if self.rope_type == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
      raise ValueError(f"model.rope_high_freq_factor={self.rope_high_freq_factor} must exceed "
                       f"model.rope_low_freq_factor={self.rope_low_freq_factor}")
    bad = [l for l in self.local_layers if not 0 <= l < self.num_layers]
    if bad:
      raise ValueError(f"model.local_layers={self.local_layers} names layers outside 0..{self.num_layers - 1}")
    if self.local_layers and self.sliding_window <= 0:
      raise ValueError(f"model.local_layers={self.local_layers} needs model.sliding_window > 0")
    for f in ("param_dtype", "dtype", "matmul_dtype"):
      name = getattr(self, f)
      if f == "matmul_dtype" and not name:
        continue  # "" = dtype
      try:
        jnp.dtype(name)
      except TypeError as e:
        raise ValueError(f"{f}={name!r} is not a dtype name") from e

  @property
  def operand_dtype(self) -> str:
    """The dtype the weight matmuls read their operands in."""
    return self.matmul_dtype or self.dtype

  @property
  def gemma(self) -> bool:
    """Gemma's layer: (1 + w) norms, post-norms, GeGLU, embedding scaled by sqrt(D)."""
    return self.arch == "gemma3"

  @property
  def num_params(self) -> int:
    D, F, N, K, H, V, L = (self.embed_dim, self.mlp_dim, self.num_heads, self.num_kv_heads,
                           self.head_dim, self.vocab_size, self.num_layers)
    per_layer = D * H * (2 * N + 2 * K) + 3 * D * F + 2 * D + (H * (N + 2 * K) if self.qkv_bias else 0)
    per_layer += (2 * H if self.qk_norm else 0) + (2 * D if self.gemma else 0)
    return V * D * (1 if self.tie_embeddings else 2) + L * per_layer + D

  # Presets (Qwen2.5 family, from their HF config.json files).
  @classmethod
  def qwen2_5_32b(cls, **kw) -> "ModelConfig":
    return cls(vocab_size=152_064, embed_dim=5120, mlp_dim=27_648, num_layers=64, num_heads=40,
               num_kv_heads=8, head_dim=128, rope_theta=1e6, norm_eps=1e-5, qkv_bias=True,
               tie_embeddings=False, **kw)

  @classmethod
  def qwen2_5_7b(cls, **kw) -> "ModelConfig":
    return cls(vocab_size=152_064, embed_dim=3584, mlp_dim=18_944, num_layers=28, num_heads=28,
               num_kv_heads=4, head_dim=128, rope_theta=1e6, norm_eps=1e-6, qkv_bias=True,
               tie_embeddings=False, **kw)

  @classmethod
  def qwen2_5_0_5b(cls, **kw) -> "ModelConfig":
    return cls(vocab_size=151_936, embed_dim=896, mlp_dim=4864, num_layers=24, num_heads=14,
               num_kv_heads=2, head_dim=64, rope_theta=1e6, norm_eps=1e-6, qkv_bias=True,
               tie_embeddings=True, **kw)


  @classmethod
  def qwen3_8b(cls, **kw) -> "ModelConfig":
    return cls(vocab_size=151_936, embed_dim=4096, mlp_dim=12_288, num_layers=36, num_heads=32,
               num_kv_heads=8, head_dim=128, rope_theta=1e6, norm_eps=1e-6, qkv_bias=False,
               tie_embeddings=False, arch="qwen3", qk_norm=True, **kw)

  @classmethod
  def llama3_1_8b(cls, **kw) -> "ModelConfig":
    return cls(vocab_size=128_256, embed_dim=4096, mlp_dim=14_336, num_layers=32, num_heads=32,
               num_kv_heads=8, head_dim=128, rope_theta=500_000.0, norm_eps=1e-5, qkv_bias=False,
               tie_embeddings=False, arch="llama", rope_type="llama3", rope_factor=8.0,
               rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_pos=8192, **kw)

  @classmethod
  def gemma3_4b(cls, **kw) -> "ModelConfig":
    """The text model of Gemma 3 4B (every 6th layer global, the rest a 1024-token window)."""
    L = 34
    return cls(vocab_size=262_208, embed_dim=2560, mlp_dim=10_240, num_layers=L, num_heads=8,
               num_kv_heads=4, head_dim=256, rope_theta=1e6, norm_eps=1e-6, qkv_bias=False,
               tie_embeddings=True, arch="gemma3", qk_norm=True, rope_type="linear", rope_factor=8.0,
               sliding_window=1024, local_layers=tuple(l for l in range(L) if (l + 1) % 6),
               rope_local_theta=10_000.0, query_scale=256.0, **kw)


ARCHS = ("qwen2", "llama", "qwen3", "gemma3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _param(module: nn.Module, name: str, shape, init, cfg: ModelConfig):
  """A parameter whose logical axes come from its shape suffix: 'wq_DNH' -> (embed, heads, head_dim)."""
  letters = name.rsplit("_", 1)[1]
  init = nn.with_logical_partitioning(init, sharding.axes_of(letters))
  return module.param(name, init, shape, jnp.dtype(cfg.param_dtype)).astype(cfg.dtype)


_normal = nn.initializers.normal(0.02)


def matmul(spec: str, x: jax.Array, w: jax.Array, cfg: ModelConfig, out_dtype=None) -> jax.Array:
  """A weight matmul `einsum(spec, x, w)`: operands in `matmul_dtype`, fp32 accumulation, result in
  `out_dtype` (default `dtype`). Its gradients accumulate in fp32 too (see `_matmul_bwd`)."""
  return _matmul(spec, jnp.dtype(cfg.operand_dtype), jnp.dtype(out_dtype or cfg.dtype), x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _matmul(spec, operand, out_dtype, x, w):
  return _matmul_fwd(spec, operand, out_dtype, x, w)[0]


def _matmul_fwd(spec, operand, out_dtype, x, w):
  x_op, w_op = x.astype(operand), w.astype(operand)
  y = jnp.einsum(spec, x_op, w_op, preferred_element_type=jnp.float32).astype(out_dtype)
  # Empty arrays carry the primal dtypes, which the gradients are returned in.
  return y, (x_op, w_op, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _matmul_bwd(spec, operand, out_dtype, res, g):
  """Input gradient from operands in the operand dtype. The weight gradient contracts the token
  axis of both operands, a layout XLA:CPU runs only in fp32 (a bf16 dot there is upcast anyway,
  or fails): on CPU it multiplies in fp32, on GPU/TPU in the operand dtype."""
  x_op, w_op, x_like, w_like = res
  xs, rest = spec.split(",")
  ws, ys = rest.split("->")
  g_op = g.astype(operand)
  dx = jnp.einsum(f"{ys},{ws}->{xs}", g_op, w_op, preferred_element_type=jnp.float32)
  if jax.default_backend() == "cpu":
    x_op, g_op = x_op.astype(jnp.float32), g.astype(jnp.float32)
  dw = jnp.einsum(f"{xs},{ys}->{ws}", x_op, g_op, preferred_element_type=jnp.float32)
  return dx.astype(x_like.dtype), dw.astype(w_like.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def rms_norm(x: jax.Array, scale_D: jax.Array, eps: float, plus_one: bool = False) -> jax.Array:
  """RMS normalisation over the last axis, in fp32, with the HF reference's order of casts.

  `plus_one` (Gemma): the weight is stored as an offset from 1, and the product is taken in fp32
  before the cast (Llama casts first).
  """
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  scale = scale_D.reshape((1,) * (x.ndim - 1) + (-1,))
  if plus_one:
    return (x32 * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
  return x32.astype(x.dtype) * scale


def norm(cfg: ModelConfig, x: jax.Array, scale: jax.Array) -> jax.Array:
  """The family's RMSNorm."""
  return rms_norm(x, scale, cfg.norm_eps, plus_one=cfg.gemma)


def _norm_init(cfg: ModelConfig):
  return nn.initializers.zeros if cfg.gemma else nn.initializers.ones


class RMSNorm(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    scale_D = _param(self, "scale_D", (x_BTD.shape[-1],), _norm_init(self.cfg), self.cfg)
    return norm(self.cfg, x_BTD, scale_D)


def inv_frequencies(cfg: ModelConfig, local: bool = False) -> tuple[jax.Array, float]:
  """Rotary inverse frequencies [H/2] and the cos/sin scale, as HF's `rope_type` computes them.

  Local (sliding-window) layers use `rope_local_theta` and no scaling.
  """
  H = cfg.head_dim
  theta = cfg.rope_local_theta if local else cfg.rope_theta
  inv_h = 1.0 / (theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
  kind, factor = ("default" if local else cfg.rope_type), cfg.rope_factor
  if kind == "linear":
    return inv_h / factor, 1.0
  if kind == "llama3":
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old = cfg.rope_original_max_pos
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen_h = 2 * math.pi / inv_h
    scaled_h = jnp.where(wavelen_h > old / low, inv_h / factor, inv_h)
    smooth_h = (old / wavelen_h - low) / (high - low)
    smoothed_h = (1 - smooth_h) * scaled_h / factor + smooth_h * scaled_h
    medium_h = (wavelen_h >= old / high) & (wavelen_h <= old / low)
    return jnp.where(medium_h, smoothed_h, scaled_h), 1.0
  if kind == "yarn":
    old = cfg.rope_original_max_pos
    corr = lambda rot: H * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(theta))
    lo, hi = corr(cfg.rope_beta_fast), corr(cfg.rope_beta_slow)
    if cfg.rope_truncate:
      lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, H - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp_h = jnp.clip((jnp.arange(H // 2, dtype=jnp.float32) - lo) / (hi - lo), 0, 1)
    keep_h = 1 - ramp_h  # 1: extrapolate (high frequencies), 0: interpolate
    inv = inv_h / factor * (1 - keep_h) + inv_h * keep_h
    attn = cfg.rope_attention_factor or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv, attn
  return inv_h, 1.0


def rope_table(pos_BT: jax.Array, cfg: ModelConfig, local: bool = False) -> tuple[jax.Array, jax.Array]:
  """(cos, sin) [B, T, H/2] of the rotary angles, computed once per call and shared by every layer."""
  inv_h, scale = inv_frequencies(cfg, local)
  angle_BTh = pos_BT[:, :, None].astype(jnp.float32) * inv_h[None, None, :]
  return jnp.cos(angle_BTh) * scale, jnp.sin(angle_BTh) * scale


def rope(x_BTNH: jax.Array, table: tuple[jax.Array, jax.Array]) -> jax.Array:
  """Rotary embedding, HF "rotate half" convention (first and second halves pair up).

  Any [B, T, ..., H] array works: the angles broadcast over the axes between T and H.
  """
  H = x_BTNH.shape[-1]
  middle = (slice(None), slice(None)) + (None,) * (x_BTNH.ndim - 3)
  cos, sin = table[0][middle], table[1][middle]
  x = x_BTNH.astype(jnp.float32)
  x1, x2 = x[..., : H // 2], x[..., H // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTNH.dtype)


def attention(q_BKRTH: jax.Array, k_BKxx: jax.Array, v_BKSH: jax.Array, mask_BTS: jax.Array,
              k_layout: str = "BKSH", scale: float | None = None, softcap: float = 0.0) -> jax.Array:
  """The attention core: T queries per head against S keys, masked fp32 softmax, [B, K, R, T, H].

  Grouped-query and heads-major: the R query heads of KV head k read its keys and values. Teacher
  forcing passes keys as [B, K, S, H]; the decode cache keeps them as [B, K, H, S] (`k_layout`), so
  each decoded token contracts a non-minor axis of the cache without a transposed copy. XLA:CPU's
  batched matmuls are about 30% faster on heads-major operands than on token-major ones.
  Scores scale by `scale` (default H**-0.5) and are soft-capped at `softcap` (0 = off).
  """
  H = q_BKRTH.shape[-1]
  scores_BKRTS = jnp.einsum(f"BKRTH,{k_layout}->BKRTS", q_BKRTH, k_BKxx,
                            preferred_element_type=jnp.float32)
  scores_BKRTS = _cap(scores_BKRTS * (H ** -0.5 if scale is None else scale), softcap)
  probs_BKRTS = masked_softmax(scores_BKRTS, mask_BTS[:, None, None]).astype(q_BKRTH.dtype)
  return jnp.einsum("BKRTS,BKSH->BKRTH", probs_BKRTS, v_BKSH)


def _cap(x: jax.Array, c: float) -> jax.Array:
  """Soft-capping c * tanh(x / c) (Gemma); identity for c = 0."""
  return c * jnp.tanh(x / c) if c else x


def attn_kw(cfg: ModelConfig) -> dict:
  """The score scale and soft-cap of the family, for `attention`."""
  return dict(scale=cfg.query_scale ** -0.5 if cfg.query_scale else None, softcap=cfg.attn_softcap)


def windowed(mask_BTS: jax.Array, window, offset: int = 0) -> jax.Array:
  """`mask` restricted to keys fewer than `window` positions behind their query (query t sits at
  key index t + offset; left-padded rows are contiguous, so index distance = position distance)."""
  T, S = mask_BTS.shape[-2:]
  dist_TS = jnp.arange(T)[:, None] + offset - jnp.arange(S)[None, :]
  return mask_BTS & (dist_TS < window).reshape((1,) * (mask_BTS.ndim - 2) + (T, S))


def masked_softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax over the last axis (fp32) of the scores whose mask is True."""
  return jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(jnp.float32).min), axis=-1)


def attend_rows(q_BTKRH, k_BSKH, v_BSKH, mask_BTS, **kw):
  """`attention` for token-major projections: [B, T, K, R, H] queries -> [B, T, K, R, H]."""
  q_BKRTH = q_BTKRH.transpose(0, 2, 3, 1, 4)
  k_BKSH, v_BKSH = k_BSKH.transpose(0, 2, 1, 3), v_BSKH.transpose(0, 2, 1, 3)
  return attention(q_BKRTH, k_BKSH, v_BKSH, mask_BTS, **kw).transpose(0, 3, 1, 2, 4)


def attend_shared_prompt(q_BCKRH, k_BCKH, v_BCKH, mask_BCC, k_QPKH, v_QPKH, mask_QP, window=None,
                         scale=None, softcap=0.0):
  """Attention of B = Q*G completion rows, row qG+g seeing prompt q's keys and then its own.

  The prompt's keys and values are read once per prompt, never repeated G times: against them,
  all G*R*C queries of a (prompt, KV head) pair form one matmul. One softmax over both key blocks,
  as `attention` over the concatenated row would compute. With `window`, completion token c (row
  index P + c) sees only keys fewer than `window` indices behind it.
  """
  Q, P = mask_QP.shape
  B, C, K, R, H = q_BCKRH.shape
  G = B // Q
  q_QKGRCH = q_BCKRH.reshape(Q, G, C, K, R, H).transpose(0, 3, 1, 4, 2, 5)
  k_QKGCH = k_BCKH.reshape(Q, G, C, K, H).transpose(0, 3, 1, 2, 4)
  v_QKGCH = v_BCKH.reshape(Q, G, C, K, H).transpose(0, 3, 1, 2, 4)
  k_QKPH, v_QKPH = k_QPKH.transpose(0, 2, 1, 3), v_QPKH.transpose(0, 2, 1, 3)
  f32 = dict(preferred_element_type=jnp.float32)
  scores_QKGRCS = jnp.concatenate([jnp.einsum("QKGRCH,QKPH->QKGRCP", q_QKGRCH, k_QKPH, **f32),
                                   jnp.einsum("QKGRCH,QKGSH->QKGRCS", q_QKGRCH, k_QKGCH, **f32)], -1)
  mask_QKGRCS = jnp.concatenate(
      [jnp.broadcast_to(mask_QP[:, None, None, None, None, :], (Q, 1, G, 1, C, P)),
       mask_BCC.reshape(Q, 1, G, 1, C, C)], -1)
  if window is not None:
    mask_QKGRCS = windowed(mask_QKGRCS, window, offset=P)
  scores_QKGRCS = _cap(scores_QKGRCS * (H ** -0.5 if scale is None else scale), softcap)
  probs_QKGRCS = masked_softmax(scores_QKGRCS, mask_QKGRCS).astype(q_BCKRH.dtype)
  o_QKGRCH = (jnp.einsum("QKGRCP,QKPH->QKGRCH", probs_QKGRCS[..., :P], v_QKPH)
              + jnp.einsum("QKGRCS,QKGSH->QKGRCH", probs_QKGRCS[..., P:], v_QKGCH))
  return o_QKGRCH.transpose(0, 2, 4, 1, 3, 5).reshape(B, C, K, R, H)


# --- One layer, shared by teacher forcing, prefill and decode ---------------------------------------
# `layer` runs on flattened tokens X (every row and position of a call) with a dict of one layer's
# weights: the stacked training weights (`Block`) or the fused decode weights (`decode_params`).
# How queries meet keys (rows, a shared prompt, a KV cache) is the caller's `attend` function.

def project_qkv(cfg: ModelConfig, p: dict, h_XD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Queries [X, K, R, H], keys and values [X, K, H] (before rotary embedding)."""
  N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  R = N // K
  if "wqkv_DKEH" in p:  # Decode weights: one matmul (E = R + 2: the R queries of KV head k, its key, its value).
    qkv_XKEH = matmul("XD,DKEH->XKEH", h_XD, p["wqkv_DKEH"], cfg)
    if p["bqkv_KEH"] is not None:
      qkv_XKEH += p["bqkv_KEH"][None]
    return _qk_norm(cfg, p, qkv_XKEH[:, :, :R], qkv_XKEH[:, :, R]) + (qkv_XKEH[:, :, R + 1],)
  q_XNH = matmul("XD,DNH->XNH", h_XD, p["wq_DNH"], cfg)
  k_XKH = matmul("XD,DKH->XKH", h_XD, p["wk_DKH"], cfg)
  v_XKH = matmul("XD,DKH->XKH", h_XD, p["wv_DKH"], cfg)
  if cfg.qkv_bias:
    q_XNH += p["bq_NH"][None]
    k_XKH += p["bk_KH"][None]
    v_XKH += p["bv_KH"][None]
  return _qk_norm(cfg, p, q_XNH.reshape(-1, K, R, H), k_XKH) + (v_XKH,)


def _qk_norm(cfg: ModelConfig, p: dict, q_XKRH: jax.Array, k_XKH: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Qwen3 / Gemma 3: RMSNorm over each head's query and key (before RoPE)."""
  if not cfg.qk_norm:
    return q_XKRH, k_XKH
  return norm(cfg, q_XKRH, p["q_norm_H"]), norm(cfg, k_XKH, p["k_norm_H"])


def mlp(cfg: ModelConfig, p: dict, h_XD: jax.Array) -> jax.Array:
  """SwiGLU: down(silu(gate(h)) * up(h)) (GeGLU with tanh GELU for Gemma); gate and up fused into
  one matmul in decode weights."""
  if "w_gate_up_D2F" in p:
    gate_up_X2F = matmul("XD,DGF->XGF", h_XD, p["w_gate_up_D2F"], cfg)
    gate_XF, up_XF = gate_up_X2F[:, 0], gate_up_X2F[:, 1]
  else:
    gate_XF = matmul("XD,DF->XF", h_XD, p["w_gate_DF"], cfg)
    up_XF = matmul("XD,DF->XF", h_XD, p["w_up_DF"], cfg)
  act = functools.partial(jax.nn.gelu, approximate=True) if cfg.gemma else nn.silu
  return matmul("XF,FD->XD", act(gate_XF) * up_XF, p["w_down_FD"], cfg)


def layer(cfg: ModelConfig, p: dict, x_XD: jax.Array, attend: Callable) -> tuple[jax.Array, Any]:
  """Pre-norm block on flattened tokens: x + attn(norm(x)), then x + mlp(norm(x)); Gemma also
  normalises each branch's output (post-norms) before adding it.

  `attend(q_XKRH, k_XKH, v_XKH) -> (o_XNH, aux)` applies rotary embeddings and attention as the
  caller lays its tokens out; `aux` (e.g. the keys and values written to a cache) is returned.
  """
  h_XD = norm(cfg, x_XD, p["attn_norm"]["scale_D"])
  o_XNH, aux = attend(*project_qkv(cfg, p, h_XD))
  a_XD = matmul("XNH,NHD->XD", o_XNH, p["wo_NHD"], cfg)
  if cfg.gemma:
    a_XD = norm(cfg, a_XD, p["post_attn_norm"]["scale_D"])
  x_XD = x_XD + a_XD
  m_XD = mlp(cfg, p, norm(cfg, x_XD, p["mlp_norm"]["scale_D"]))
  if cfg.gemma:
    m_XD = norm(cfg, m_XD, p["post_mlp_norm"]["scale_D"])
  return x_XD + m_XD, aux


class Block(nn.Module):
  """One layer's parameters (training layout), applied to one or two segments of rows.

  Layout "rows": one segment [B, T, D]. Layout "shared_prompt": Q prompts [Q, P, D] and their
  B = Q*G completions [B, C, D], completion row qG+g continuing prompt q (a rollout group shares one
  prompt forward). Dense layers run on every token of every segment at once; only attention sees
  the segments. With `emit_kv` (rows), also returns this call's keys and values ([B, K, T, H] each).
  `local` (scanned over layers, a traced bool) selects the sliding window and the local RoPE table.
  """
  cfg: ModelConfig
  layout: str = "rows"
  emit_kv: bool = False

  @nn.compact
  def __call__(self, segments: tuple, shared: tuple, local: jax.Array):
    cfg = self.cfg
    D, N, K, H, F = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    tables, local_tables, masks = shared
    window = None
    if cfg.local_layers:  # Local layers: the window and their own rotary table.
      window = jnp.where(local, cfg.sliding_window, jnp.iinfo(jnp.int32).max)
      tables = jax.tree.map(lambda g, l: jnp.where(local, l, g), tables, local_tables)
      masks = (windowed(masks[0], window),) + tuple(masks[1:])
    p = {"attn_norm": {"scale_D": _scale_param(self, "attn_norm")}}
    p["wq_DNH"] = _param(self, "wq_DNH", (D, N, H), _normal, cfg)
    p["wk_DKH"] = _param(self, "wk_DKH", (D, K, H), _normal, cfg)
    p["wv_DKH"] = _param(self, "wv_DKH", (D, K, H), _normal, cfg)
    if cfg.qk_norm:
      p["q_norm_H"] = _param(self, "q_norm_H", (H,), _norm_init(cfg), cfg)
      p["k_norm_H"] = _param(self, "k_norm_H", (H,), _norm_init(cfg), cfg)
    if cfg.qkv_bias:
      zeros = nn.initializers.zeros
      p["bq_NH"] = _param(self, "bq_NH", (N, H), zeros, cfg)
      p["bk_KH"] = _param(self, "bk_KH", (K, H), zeros, cfg)
      p["bv_KH"] = _param(self, "bv_KH", (K, H), zeros, cfg)
    p["wo_NHD"] = _param(self, "wo_NHD", (N, H, D), _normal, cfg)
    p["mlp_norm"] = {"scale_D": _scale_param(self, "mlp_norm")}
    if cfg.gemma:
      p["post_attn_norm"] = {"scale_D": _scale_param(self, "post_attn_norm")}
      p["post_mlp_norm"] = {"scale_D": _scale_param(self, "post_mlp_norm")}
    p["w_gate_DF"] = _param(self, "w_gate_DF", (D, F), _normal, cfg)
    p["w_up_DF"] = _param(self, "w_up_DF", (D, F), _normal, cfg)
    p["w_down_FD"] = _param(self, "w_down_FD", (F, D), _normal, cfg)

    shapes = [s.shape[:2] for s in segments]
    sizes = [b * t for b, t in shapes]

    def per_segment(a_X, *trailing):
      """[X, ...] -> one [rows, T, ...] array per segment."""
      parts = jnp.split(a_X, list(itertools.accumulate(sizes))[:-1]) if len(sizes) > 1 else [a_X]
      return [a.reshape(b, t, *trailing) for a, (b, t) in zip(parts, shapes)]

    def attend(q_XKRH, k_XKH, v_XKH):
      R = N // K
      qs = [rope(q, t) for q, t in zip(per_segment(q_XKRH.reshape(-1, N, H), N, H), tables)]
      qs = [q.reshape(*q.shape[:2], K, R, H) for q in qs]
      ks = [rope(k, t) for k, t in zip(per_segment(k_XKH, K, H), tables)]
      vs = per_segment(v_XKH, K, H)
      if self.layout == "rows":
        outs = [self._attend_rows(qs[0], ks[0], vs[0], masks[0])]
      else:  # Prompts attend among themselves; completions to their prompt, then to themselves.
        mask_QPP, mask_BCC = masks  # mask_QPP is windowed already; its last row is not.
        kw = attn_kw(cfg)
        outs = [attend_rows(qs[0], ks[0], vs[0], mask_QPP, **kw),
                attend_shared_prompt(qs[1], ks[1], vs[1], mask_BCC, ks[0], vs[0], shared[2][0][:, -1],
                                     window=window, **kw)]
      kv = (ks[0].transpose(0, 2, 1, 3), vs[0].transpose(0, 2, 1, 3)) if self.emit_kv else None
      return jnp.concatenate([o.reshape(-1, N, H) for o in outs]), kv

    # Dense projections run on flattened tokens: 2-D matmuls whose gradients XLA computes
    # without transposed copies.
    x_XD = jnp.concatenate([s.reshape(-1, D) for s in segments])
    x_XD, kv = layer(cfg, p, x_XD, attend)
    return tuple(sharding.constrain(s, "BTD") for s in per_segment(x_XD, D)), kv

  def _attend_rows(self, q_BTKRH, k_BTKH, v_BTKH, mask_BTS):
    B, T, K, R, H = q_BTKRH.shape
    c = self.cfg.attn_chunk
    kw = attn_kw(self.cfg)
    if not (c and T > c and T % c == 0):
      return attend_rows(q_BTKRH, k_BTKH, v_BTKH, mask_BTS, **kw)
    # Query blocks, each rematerialised: scores never exceed [B, K, R, c, S] in memory.
    q_nBcKRH = jnp.moveaxis(q_BTKRH.reshape(B, T // c, c, K, R, H), 1, 0)
    mask_nBcS = jnp.moveaxis(mask_BTS.reshape(B, T // c, c, -1), 1, 0)
    block = jax.checkpoint(lambda qm: attend_rows(qm[0], k_BTKH, v_BTKH, qm[1], **kw))
    return jnp.moveaxis(jax.lax.map(block, (q_nBcKRH, mask_nBcS)), 0, 1).reshape(B, T, K, R, H)


def _scale_param(module: nn.Module, name: str) -> jax.Array:
  """An RMSNorm scale stored as {name: {"scale_D": ...}} (the parameter tree HF import expects)."""
  return RMSNormScale(module.cfg, name=name)()


class RMSNormScale(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self) -> jax.Array:
    return _param(self, "scale_D", (self.cfg.embed_dim,), _norm_init(self.cfg), self.cfg)


HEADS = ("lm", "scalar")


class Transformer(nn.Module):
  """The trunk (embedding, scanned layers, final norm) and a head on it.

  Head "lm": logits [B, T, V] (fp32). Head "scalar": one value per position [B, T] (fp32) from a
  D-vector `score_D` (a reward model's or value model's head). Inputs are one segment of rows
  (layout "rows") or (prompts, completions) (layout "shared_prompt", see `Block`): then the outputs
  are those at the positions predicting each completion token, [B, C, ...].
  """
  cfg: ModelConfig
  head: str = "lm"
  layout: str = "rows"
  emit_kv: bool = False  # also return every layer's keys/values: ([L, B, K, T, H], [L, B, K, T, H])

  @nn.compact
  def __call__(self, tokens: tuple, pos: tuple, masks: tuple, logits_from: int = 0):
    cfg = self.cfg
    embed_VD = _param(self, "embed_VD", (cfg.vocab_size, cfg.embed_dim), _normal, cfg)
    x = tuple(sharding.constrain(embed(cfg, embed_VD, t), "BTD") for t in tokens)

    block = Block
    if cfg.remat != "none":
      block = nn.remat(Block, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)
    layers = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                     in_axes=(nn.broadcast, 0), length=cfg.num_layers,
                     metadata_params={nn.PARTITION_NAME: "layers"})
    tables = tuple(rope_table(p, cfg) for p in pos)
    local_tables = tuple(rope_table(p, cfg, local=True) for p in pos) if cfg.local_layers else None
    local_L = jnp.asarray([l in cfg.local_layers for l in range(cfg.num_layers)])
    x, kv = layers(cfg, self.layout, self.emit_kv, name="layers")(x, (tables, local_tables, masks), local_L)

    if self.layout == "shared_prompt":
      # Completion token 0 is predicted at the prompt's last position, token t at completion t-1.
      x_QPD, x_BCD = x
      G = x_BCD.shape[0] // x_QPD.shape[0]
      x_BTD = jnp.concatenate([jnp.repeat(x_QPD[:, -1:], G, axis=0), x_BCD[:, :-1]], axis=1)
    else:
      x_BTD = x[0][:, logits_from:]  # Skip unneeded unembeddings.
    x_BTD = RMSNorm(cfg, name="final_norm")(x_BTD)
    if self.head == "scalar":
      score_D = _param(self, "score_D", (cfg.embed_dim,), nn.initializers.zeros, cfg)
      out = matmul("BTD,D->BT", x_BTD, score_D, cfg, jnp.float32)
    elif cfg.tie_embeddings:
      out = sharding.constrain(_cap(matmul("BTD,VD->BTV", x_BTD, embed_VD, cfg, jnp.float32), cfg.final_softcap), "BTV")
    else:
      unembed_DV = _param(self, "unembed_DV", (cfg.embed_dim, cfg.vocab_size), _normal, cfg)
      out = sharding.constrain(_cap(matmul("BTD,DV->BTV", x_BTD, unembed_DV, cfg, jnp.float32), cfg.final_softcap),
                               "BTV")
    return (out, kv) if self.emit_kv else out


def embed(cfg: ModelConfig, embed_VD: jax.Array, tokens: jax.Array) -> jax.Array:
  """Token embeddings; Gemma scales them by sqrt(D), the factor rounded to the compute dtype as HF does."""
  x = jnp.take(embed_VD, tokens, axis=0)
  return x * jnp.asarray(cfg.embed_dim ** 0.5, x.dtype) if cfg.gemma else x


def init_params(cfg: ModelConfig, rng: jax.Array, head: str = "lm") -> Params:
  """Random parameters (unboxed: plain arrays in `param_dtype`)."""
  return nn.meta.unbox(init_boxed(cfg, rng, head))


def init_boxed(cfg: ModelConfig, rng: jax.Array, head: str = "lm") -> Params:
  """Random parameters boxed with their logical axes (`nn.get_partition_spec` reads them): the one
  source of parameter shardings (under `jax.eval_shape`, nothing is computed)."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  return Transformer(cfg, head).init(rng, (tokens,), (tokens,), (jnp.ones((1, 1, 1), bool),))["params"]


def positions(mask_BT: jax.Array) -> jax.Array:
  """Position ids of left-padded rows: 0 at the first real token (padding gets 0)."""
  return jnp.maximum(jnp.cumsum(mask_BT.astype(jnp.int32), axis=-1) - 1, 0)


def forward(cfg: ModelConfig, params: Params, tokens_BT, pos_BT, mask_BTS, logits_from: int = 0,
            emit_kv: bool = False, head: str = "lm"):
  """Teacher-forced outputs of the head (fp32 logits [B, T', V], or values [B, T']) for positions
  >= logits_from (static).

  With `emit_kv`, returns (out, (k_LBKTH, v_LBKTH)): every layer's keys and values, to fill a cache.
  """
  return Transformer(cfg, head, "rows", emit_kv).apply(
      {"params": params}, (tokens_BT,), (pos_BT,), (mask_BTS,), logits_from)


def causal_mask(mask_BT: jax.Array) -> jax.Array:
  """[B, T, T] attention mask of rows attending to themselves: causal, real keys only."""
  T = mask_BT.shape[1]
  return jnp.tril(jnp.ones((T, T), bool))[None] & mask_BT.astype(bool)[:, None, :]


def logits(model_cfg: ModelConfig, params: Params, tokens_BT: jax.Array, mask_BT: jax.Array,
           logits_from: int = 0) -> jax.Array:
  """Teacher-forced logits [B, T, V] (fp32) of left-padded rows; mask 1 = real token.

  With `logits_from`, only positions logits_from..T-1 are unembedded ([B, T - logits_from, V]).
  """
  return forward(model_cfg, params, tokens_BT, positions(mask_BT), causal_mask(mask_BT), logits_from=logits_from)


def completion_logits(model_cfg: ModelConfig, params: Params, prompt_QP: jax.Array, prompt_mask_QP: jax.Array,
                      completion_BC: jax.Array, completion_mask_BC: jax.Array, head: str = "lm") -> jax.Array:
  """Logits [B, C, V] (fp32) predicting each completion token, for G = B/Q completions per prompt.

  Equals `logits` on the rows [prompt q | completion qG+g] (positions P-1 .. P+C-2), but each
  prompt's tokens pass through the model once rather than G times.
  """
  G = completion_BC.shape[0] // prompt_QP.shape[0]
  C = completion_BC.shape[1]
  prompt_len_B = jnp.repeat(jnp.sum(prompt_mask_QP, axis=-1, dtype=jnp.int32), G)
  pos_BC = prompt_len_B[:, None] + jnp.arange(C)[None, :]
  return Transformer(model_cfg, head, "shared_prompt").apply(
      {"params": params}, (prompt_QP, completion_BC), (positions(prompt_mask_QP), pos_BC),
      (causal_mask(prompt_mask_QP), causal_mask(completion_mask_BC)))


# --- Cached decoding -----------------------------------------------------------------------------
# The teacher-forced model keeps its layers stacked for `nn.scan`. The decode loop instead reads a
# per-layer copy of the weights, made once per `generate` call, with q/k/v fused into one matrix
# and gate/up into another: each decoded token then runs three matmuls fewer per layer and never
# slices a stacked weight or cache (a slice inside the loop is a copy on every token).

def decode_params(cfg: ModelConfig, params: Params) -> dict:
  """Per-layer weights for `decode_step`: matrices in the matmul dtype, the rest in the compute dtype.

  layers[l]: attn_norm, wqkv_DKEH (E = R + 2: the R query heads of KV group k, then its key and
  its value, so tensor parallelism splits K), bqkv_KEH (None without bias), wo_NHD, mlp_norm,
  w_gate_up_D2F, w_down_FD: what `layer` reads. Also embed_VD, final_scale_D and unembed_DV.
  """
  D, N, K, H, L = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
  R = N // K
  cast = lambda x: x.astype(cfg.dtype)
  cast_w = lambda x: x.astype(cfg.operand_dtype)
  p = params["layers"]
  wqkv_LDKEH = jnp.concatenate([p["wq_DNH"].reshape(L, D, K, R, H), p["wk_DKH"][:, :, :, None],
                                p["wv_DKH"][:, :, :, None]], axis=3)
  bqkv_LKEH = None
  if cfg.qkv_bias:
    bqkv_LKEH = jnp.concatenate([p["bq_NH"].reshape(L, K, R, H), p["bk_KH"][:, :, None],
                                 p["bv_KH"][:, :, None]], axis=2)
  w_gate_up_LD2F = jnp.stack([p["w_gate_DF"], p["w_up_DF"]], axis=2)
  layers = [dict(attn_norm=dict(scale_D=cast(p["attn_norm"]["scale_D"][l])), wqkv_DKEH=cast_w(wqkv_LDKEH[l]),
                 bqkv_KEH=None if bqkv_LKEH is None else cast(bqkv_LKEH[l]), wo_NHD=cast_w(p["wo_NHD"][l]),
                 mlp_norm=dict(scale_D=cast(p["mlp_norm"]["scale_D"][l])), w_gate_up_D2F=cast_w(w_gate_up_LD2F[l]),
                 w_down_FD=cast_w(p["w_down_FD"][l]))
            for l in range(L)]
  for l, layer_p in enumerate(layers):  # Family extras: q/k norms, post-norms.
    layer_p.update({k: cast(p[k][l]) for k in ("q_norm_H", "k_norm_H") if k in p})
    layer_p.update({k: dict(scale_D=cast(p[k]["scale_D"][l])) for k in ("post_attn_norm", "post_mlp_norm") if k in p})
  # A tied unembedding is transposed once here, so each token's logits are a plain [B,D]x[D,V] matmul.
  unembed_DV = params["embed_VD"].T if cfg.tie_embeddings else params["unembed_DV"]
  return dict(layers=layers, embed_VD=cast(params["embed_VD"]), final_scale_D=cast(params["final_norm"]["scale_D"]),
              unembed_DV=cast_w(unembed_DV))


def decode_step(cfg: ModelConfig, dparams: dict, tok_B: jax.Array, pos_B: jax.Array, cache: kvc.KVCache,
                index: jax.Array) -> tuple[jax.Array, kvc.KVCache]:
  """One token per row through the cache: writes slot `index` of every layer, returns (logits_BV fp32, cache).

  `cache.mask_BS` must already mark slot `index` (see `kv_cache.write_mask`); a row attends to
  every marked slot, which are exactly its real tokens up to and including this one (local layers:
  the last `sliding_window` of them; a row's real slots are contiguous, so slot distance is
  position distance).
  """
  tables = {False: rope_table(pos_B[:, None], cfg)}
  mask_B1S = cache.mask_BS[:, None, :]
  masks = {False: mask_B1S}
  if cfg.local_layers:
    tables[True] = rope_table(pos_B[:, None], cfg, local=True)
    masks[True] = windowed(mask_B1S, cfg.sliding_window, offset=index)
  x_BD = embed(cfg, dparams["embed_VD"], tok_B)
  ks, vs = [], []
  for l, (p, k_BKHS, v_BKSH) in enumerate(zip(dparams["layers"], cache.k, cache.v)):
    local = l in cfg.local_layers
    def attend(q_BKRH, k_BKH, v_BKH, k_BKHS=k_BKHS, v_BKSH=v_BKSH, table=tables[local], mask_B1S=masks[local]):
      k_BKHS, v_BKSH = kvc.update(k_BKHS, v_BKSH, rope(k_BKH[:, :, None], table), v_BKH[:, :, None], index)
      o_BKRH = attention(rope(q_BKRH, table)[:, :, :, None], k_BKHS, v_BKSH, mask_B1S, k_layout="BKHS",
                         **attn_kw(cfg))[:, :, :, 0]
      return o_BKRH.reshape(o_BKRH.shape[0], -1, o_BKRH.shape[-1]), (k_BKHS, v_BKSH)
    x_BD, (k_BKHS, v_BKSH) = layer(cfg, p, x_BD, attend)
    ks.append(k_BKHS)
    vs.append(v_BKSH)
  x_BD = norm(cfg, x_BD, dparams["final_scale_D"])
  logits_BV = _cap(matmul("BD,DV->BV", x_BD, dparams["unembed_DV"], cfg, jnp.float32), cfg.final_softcap)
  return logits_BV, cache.replace(k=ks, v=vs)
