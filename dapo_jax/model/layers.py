"""The layer math of the model families, as pure functions on arrays and dicts of weights.

Weight matmuls in a narrower operand dtype with fp32 accumulation (`matmul`, its own VJP), RMSNorm,
rotary embeddings and their frequency scalings, the attention core (masked fp32 softmax, sliding
windows, soft-capping; einsum or `jax.nn.dot_product_attention`), the mixture-of-experts MLP
(router, dropless grouped-matmul dispatch, expert parallelism), and one transformer `layer` that
teacher forcing, prefill and decode share: `model` supplies the weights (stacked training ones or
fused decode ones) and the attention layout.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from dapo_jax import sharding
from dapo_jax.model import mrope, quant
from dapo_jax.model.config import ModelConfig


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


def dense(spec: str, x: jax.Array, p: dict, name: str, cfg: ModelConfig) -> jax.Array:
  """The weight matmul `einsum(spec, x, p[name])` of a layer, whatever form the weight takes
  (`weight_matmul`), plus its LoRA adapter's output where it has one (`adapter`)."""
  y = weight_matmul(spec, x, p[name], cfg)
  delta = adapter(spec, x, p, name, cfg)
  return y if delta is None else y + delta


def weight_matmul(spec: str, x: jax.Array, w, cfg: ModelConfig) -> jax.Array:
  """`einsum(spec, x, w)`. A float weight is `matmul`. An int8 one ({"int8", "scale"}, see `quant`)
  is dequantized on the fly: (x @ w_int8) * scale, fp32 accumulation, one scale per output
  channel; only the matmul's operand-dtype cast of w_int8 is ever float."""
  if not isinstance(w, dict):
    return matmul(spec, x, w, cfg)
  y = matmul(spec, x, quant.cast_after(w["int8"], x, cfg.operand_dtype), cfg, jnp.float32)
  scale = w["scale"]
  return (y * scale.reshape((1,) * (y.ndim - scale.ndim) + scale.shape)).astype(cfg.dtype)


def adapter(spec: str, x: jax.Array, p: dict, name: str, cfg: ModelConfig) -> jax.Array | None:
  """The LoRA adapter p["lora"][name] = {"a": [in.., r], "b": [r, out..]} of the weight `name`
  (matmul `spec`): p["lora_scale"] * (x @ a) @ b, or None without one. With b = 0 or lora_scale = 0
  it adds exactly 0. With p["lora_dropout"] = (rate, key) (a training forward), the adapter reads
  `adapter_dropout(x, ...)` instead of x."""
  ad = (p.get("lora") or {}).get(name)
  if ad is None:
    return None
  xs, rest = spec.split(",")
  ws, ys = rest.split("->")
  ins = "".join(c for c in ws if c in xs)        # contracted (input) axes of the weight
  keep = "".join(c for c in xs if c not in ins)  # the token axes
  if "lora_dropout" in p:
    x = adapter_dropout(x, *p["lora_dropout"], name)
  h = matmul(f"{xs},{ins}r->{keep}r", x, ad["a"], cfg)
  # As a batch of one: remat "dots" keeps unbatched matmuls' outputs, and this rank-r product is as
  # large as the projection's own; the backward recomputes it instead (SmolLM2-135M's update: 0.4 GB).
  n = next(c for c in "nopqstuvwz" if c not in spec)
  delta = matmul(f"{n}{keep}r,{n}r{ws[len(ins):]}->{n}{ys}", h[None], ad["b"][None], cfg)[0]
  return p["lora_scale"].astype(delta.dtype) * delta


def adapter_dropout(x: jax.Array, rate: jax.Array, key: jax.Array, name: str) -> jax.Array:
  """PEFT's lora_dropout on the input of the adapter on `name`: x * mask / (1 - rate) with
  mask ~ Bernoulli(1 - rate) elementwise, one mask per (layer key, target), as PEFT has one
  dropout module per adapted projection (the target's index among the layer matrices salts the key)."""
  keep = jax.random.bernoulli(jax.random.fold_in(key, list(quant.MATRICES).index(name)), 1.0 - rate, x.shape)
  return jnp.where(keep, x * (1.0 / (1.0 - rate)).astype(x.dtype), jnp.zeros((), x.dtype))


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


def norm_init(cfg: ModelConfig):
  return nn.initializers.zeros if cfg.gemma else nn.initializers.ones


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


def rope_table(pos_BT: jax.Array, cfg: ModelConfig, local: bool = False,
               tokens_BT: jax.Array | None = None, images_BME: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array]:
  """(cos, sin) [B, T, H/2] of the rotary angles, computed once per call and shared by every layer.

  With M-RoPE (`cfg.mrope_section`) and the rows' `tokens_BT`, each frequency section rotates by the
  tokens' (temporal, height, width) positions (`mrope.mrope_positions`), or by `pos_BT` [B, T, 3]
  when it holds them; without either (decoded text) all three are `pos_BT`. `images_BME`: the rows' image
  vectors, whose last channel gives each image's shape (Qwen2.5-VL's, `vision.image_features`)."""
  inv_h, scale = inv_frequencies(cfg, local)
  if cfg.mrope_section and (tokens_BT is not None or pos_BT.ndim == 3):
    section_h = np.repeat(np.arange(3), cfg.mrope_section)  # Which position each frequency rotates by.
    if pos_BT.ndim == 3:  # [B, T, 3]: given (packed rows carry their rows' M-RoPE positions).
      pos_BTh = pos_BT[..., section_h]
    else:
      pos_BTh = jnp.moveaxis(mrope.mrope_positions(cfg.vision, pos_BT, tokens_BT, images_BME), 0, -1)[..., section_h]
    angle_BTh = pos_BTh.astype(jnp.float32) * inv_h[None, None, :]
    return jnp.cos(angle_BTh) * scale, jnp.sin(angle_BTh) * scale
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
              k_layout: str = "BKSH", scale: float | None = None, softcap: float = 0.0,
              impl: str = "einsum") -> jax.Array:
  """The attention core: T queries per head against S keys, masked fp32 softmax, [B, K, R, T, H].

  Grouped-query and heads-major: the R query heads of KV head k read its keys and values. Teacher
  forcing passes keys as [B, K, S, H]; the decode cache keeps them as [B, K, H, S] (`k_layout`), so
  each decoded token contracts a non-minor axis of the cache without a transposed copy. XLA:CPU's
  batched matmuls are about 30% faster on heads-major operands than on token-major ones.
  Scores scale by `scale` (default H**-0.5) and are soft-capped at `softcap` (0 = off).

  `impl` "xla" or "cudnn" runs the core as `jax.nn.dot_product_attention` with that implementation
  (the mask, which carries causality, padding and sliding windows, goes in whole). Soft-capping
  has no place in that API, so soft-capped scores always take the einsum path.
  """
  if impl != "einsum" and not softcap:
    return _dot_product_attention(q_BKRTH, k_BKxx, v_BKSH, mask_BTS, k_layout, scale, impl)
  H = q_BKRTH.shape[-1]
  scores_BKRTS = jnp.einsum(f"BKRTH,{k_layout}->BKRTS", q_BKRTH, k_BKxx,
                            preferred_element_type=jnp.float32)
  scores_BKRTS = soft_cap(scores_BKRTS * (H ** -0.5 if scale is None else scale), softcap)
  probs_BKRTS = masked_softmax(scores_BKRTS, mask_BTS[:, None, None]).astype(q_BKRTH.dtype)
  return jnp.einsum("BKRTS,BKSH->BKRTH", probs_BKRTS, v_BKSH)


def _dot_product_attention(q_BKRTH, k_BKxx, v_BKSH, mask_BTS, k_layout, scale, impl) -> jax.Array:
  """`attention` through `jax.nn.dot_product_attention`: token-major [B, T, N, H] operands, N = K*R
  with the R query heads of KV head k at n = k*R + r (its grouped-query convention and ours)."""
  B, K, R, T, H = q_BKRTH.shape
  q_BTNH = q_BKRTH.transpose(0, 3, 1, 2, 4).reshape(B, T, K * R, H)
  k_BSKH = k_BKxx.transpose(0, 3, 1, 2) if k_layout == "BKHS" else k_BKxx.transpose(0, 2, 1, 3)
  # The API wants one dtype; a bf16 KV cache under fp32 queries is widened, as einsum would promote it.
  k_BSKH, v_BSKH = k_BSKH.astype(q_BTNH.dtype), v_BKSH.transpose(0, 2, 1, 3).astype(q_BTNH.dtype)
  S = k_BSKH.shape[1]
  if impl == "cudnn" and (T % 2 or S % 2):
    # cuDNN's masked kernels take even lengths only (a training row of 2n tokens feeds 2n - 1): one
    # more query, sliced off below, and one more key that no query sees.
    pad = lambda x, n: jnp.pad(x, ((0, 0), (0, n)) + ((0, 0),) * (x.ndim - 2))
    q_BTNH, k_BSKH, v_BSKH = pad(q_BTNH, T % 2), pad(k_BSKH, S % 2), pad(v_BSKH, S % 2)
    mask_BTS = jnp.pad(mask_BTS, ((0, 0), (0, T % 2), (0, S % 2)))
  o_BTNH = jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=mask_BTS[:, None], scale=scale,
                                        implementation=impl)
  return o_BTNH[:, :T].reshape(B, T, K, R, H).transpose(0, 2, 3, 1, 4)


def soft_cap(x: jax.Array, c: float) -> jax.Array:
  """Soft-capping c * tanh(x / c) (Gemma); identity for c = 0."""
  return c * jnp.tanh(x / c) if c else x


# The logit of a token the model never emits: finite, so that p * log p stays 0 in an entropy.
NEVER = -1e30


def output_logits(cfg: ModelConfig, logits_XV: jax.Array) -> jax.Array:
  """The lm head's logits as the model's distribution: soft-capped (Gemma), and, in a vision-language
  model, the image placeholder never emitted (it stands for an image's vectors, which only a prompt
  has: a sampled one would be a text token to the sampler but an image slot to a teacher-forced pass)."""
  logits_XV = soft_cap(logits_XV, cfg.final_softcap)
  if cfg.vision is None or cfg.vision.image_token_id >= logits_XV.shape[-1]:
    return logits_XV
  placeholder_V = jnp.arange(logits_XV.shape[-1]) == cfg.vision.image_token_id
  return jnp.where(placeholder_V, jnp.asarray(NEVER, logits_XV.dtype), logits_XV)


def attn_kw(cfg: ModelConfig) -> dict:
  """The score scale and soft-cap of the family and the core's implementation, for `attention`."""
  return dict(scale=cfg.query_scale ** -0.5 if cfg.query_scale else None, softcap=cfg.attn_softcap,
              impl=cfg.attention_impl)


def windowed(mask_BTS: jax.Array, window, offset: int = 0) -> jax.Array:
  """`mask` restricted to keys fewer than `window` positions behind their query (query t sits at
  key index t + offset; left-padded rows are contiguous, so index distance = position distance)."""
  T, S = mask_BTS.shape[-2:]
  if jnp.ndim(offset):  # One offset per row ([B, 1, 1]): rows of a continuous batch.
    return mask_BTS & (jnp.arange(T)[None, :, None] + offset - jnp.arange(S)[None, None, :] < window)
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
                         scale=None, softcap=0.0, impl="einsum", query_offset=0):
  """Attention of B = Q*G completion rows, row qG+g seeing prompt q's keys and then its own.

  The prompt's keys and values are read once per prompt, never repeated G times: against them,
  all G*R*C queries of a (prompt, KV head) pair form one matmul. One softmax over both key blocks,
  as `attention` over the concatenated row would compute. With `window`, completion token c (row
  index P + c) sees only keys fewer than `window` indices behind it. The queries may be a block of
  the completion's ([B, c, K, R, H] from completion token `query_offset` on, mask_BCC [B, c, C]).

  Always einsum, whatever `impl`: `jax.nn.dot_product_attention` takes one key block per row, so
  it could only run this by copying each prompt's keys G times (what this layout exists to avoid).
  """
  del impl
  Q, P = mask_QP.shape
  B, Cq, K, R, H = q_BCKRH.shape
  C = k_BCKH.shape[1]
  G = B // Q
  q_QKGRCH = q_BCKRH.reshape(Q, G, Cq, K, R, H).transpose(0, 3, 1, 4, 2, 5)
  k_QKGCH = k_BCKH.reshape(Q, G, C, K, H).transpose(0, 3, 1, 2, 4)
  v_QKGCH = v_BCKH.reshape(Q, G, C, K, H).transpose(0, 3, 1, 2, 4)
  k_QKPH, v_QKPH = k_QPKH.transpose(0, 2, 1, 3), v_QPKH.transpose(0, 2, 1, 3)
  f32 = dict(preferred_element_type=jnp.float32)
  scores_QKGRCS = jnp.concatenate([jnp.einsum("QKGRCH,QKPH->QKGRCP", q_QKGRCH, k_QKPH, **f32),
                                   jnp.einsum("QKGRCH,QKGSH->QKGRCS", q_QKGRCH, k_QKGCH, **f32)], -1)
  mask_QKGRCS = jnp.concatenate(
      [jnp.broadcast_to(mask_QP[:, None, None, None, None, :], (Q, 1, G, 1, Cq, P)),
       mask_BCC.reshape(Q, 1, G, 1, Cq, C)], -1)
  if window is not None:
    mask_QKGRCS = windowed(mask_QKGRCS, window, offset=P + query_offset)
  scores_QKGRCS = soft_cap(scores_QKGRCS * (H ** -0.5 if scale is None else scale), softcap)
  probs_QKGRCS = masked_softmax(scores_QKGRCS, mask_QKGRCS).astype(q_BCKRH.dtype)
  o_QKGRCH = (jnp.einsum("QKGRCP,QKPH->QKGRCH", probs_QKGRCS[..., :P], v_QKPH)
              + jnp.einsum("QKGRCS,QKGSH->QKGRCH", probs_QKGRCS[..., P:], v_QKGCH))
  return o_QKGRCH.transpose(0, 2, 4, 1, 3, 5).reshape(B, Cq, K, R, H)


def attend_after_contexts(q_BCKRH, k_BCKH, v_BCKH, mask_BCC, contexts, scale=None, softcap=0.0, impl="einsum"):
  """Attention of B rows to blocks of keys they share, then to their own: `contexts` is a sequence
  of (k_ZSKH, v_ZSKH, mask_ZS), Z dividing B, row b seeing entry b // (B / Z) of each (e.g. a prefix
  every row shares, Z = 1, then each group's prompt, Z = Q). One softmax over every block, as
  `attention` over the concatenated row would compute; each shared block is read once per entry,
  never copied per row. Always einsum (see `attend_shared_prompt`)."""
  del impl
  B, C, K, R, H = q_BCKRH.shape
  f32 = dict(preferred_element_type=jnp.float32)
  scores, masks = [], []
  for k_ZSKH, _, mask_ZS in contexts:
    Z, S = mask_ZS.shape
    q_ZgCKRH = q_BCKRH.reshape(Z, B // Z, C, K, R, H)
    scores.append(jnp.einsum("ZgCKRH,ZSKH->ZgKRCS", q_ZgCKRH, k_ZSKH, **f32).reshape(B, K, R, C, S))
    masks.append(jnp.broadcast_to(jnp.repeat(mask_ZS, B // Z, axis=0)[:, None, None, None, :], (B, 1, 1, C, S)))
  scores.append(jnp.einsum("BCKRH,BSKH->BKRCS", q_BCKRH, k_BCKH, **f32))
  masks.append(mask_BCC[:, None, None])
  scores_BKRCS = soft_cap(jnp.concatenate(scores, -1) * (H ** -0.5 if scale is None else scale), softcap)
  probs_BKRCS = masked_softmax(scores_BKRCS, jnp.concatenate(masks, -1)).astype(q_BCKRH.dtype)
  o_BCKRH, start = 0, 0
  for k_ZSKH, v_ZSKH, mask_ZS in contexts:
    Z, S = mask_ZS.shape
    probs_ZgKRCS = probs_BKRCS[..., start:start + S].reshape(Z, B // Z, K, R, C, S)
    o_BCKRH += jnp.einsum("ZgKRCS,ZSKH->ZgCKRH", probs_ZgKRCS, v_ZSKH).reshape(B, C, K, R, H)
    start += S
  return o_BCKRH + jnp.einsum("BKRCS,BSKH->BCKRH", probs_BKRCS[..., start:], v_BCKH)


# --- One layer, shared by teacher forcing, prefill and decode ---------------------------------------
# `layer` runs on flattened tokens X (every row and position of a call) with a dict of one layer's
# weights: the stacked training weights (`Block`) or the fused decode weights (`decode_params`).
# How queries meet keys (rows, a shared prompt, a KV cache) is the caller's `attend` function.

def project_qkv(cfg: ModelConfig, p: dict, h_XD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Queries [X, K, R, H], keys and values [X, K, H] (before rotary embedding)."""
  N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  R = N // K
  if "wqkv_DKJH" in p:  # Decode weights: one matmul (J = R + 2: the R queries of KV head k, its key, its value).
    qkv_XKJH = weight_matmul("XD,DKJH->XKJH", h_XD, p["wqkv_DKJH"], cfg)
    if p["bqkv_KJH"] is not None:
      qkv_XKJH += p["bqkv_KJH"][None]
    q_XKRH, k_XKH, v_XKH = qkv_XKJH[:, :, :R], qkv_XKJH[:, :, R], qkv_XKJH[:, :, R + 1]
    if "lora" in p:  # Unmerged adapters (an int8 base's decode weights, see `model.decode_params`).
      q_XKRH, k_XKH, v_XKH = (y if d is None else y + d.reshape(y.shape) for y, d in (
          (q_XKRH, adapter("XD,DNH->XNH", h_XD, p, "wq_DNH", cfg)),
          (k_XKH, adapter("XD,DKH->XKH", h_XD, p, "wk_DKH", cfg)),
          (v_XKH, adapter("XD,DKH->XKH", h_XD, p, "wv_DKH", cfg))))
    return _qk_norm(cfg, p, q_XKRH, k_XKH) + (v_XKH,)
  q_XNH = dense("XD,DNH->XNH", h_XD, p, "wq_DNH", cfg)
  k_XKH = dense("XD,DKH->XKH", h_XD, p, "wk_DKH", cfg)
  v_XKH = dense("XD,DKH->XKH", h_XD, p, "wv_DKH", cfg)
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
    gate_up_X2F = weight_matmul("XD,DGF->XGF", h_XD, p["w_gate_up_D2F"], cfg)
    gate_XF, up_XF = gate_up_X2F[:, 0], gate_up_X2F[:, 1]
    if "lora" in p:  # Unmerged adapters (see `project_qkv`).
      gate_XF, up_XF = (y if d is None else y + d for y, d in (
          (gate_XF, adapter("XD,DF->XF", h_XD, p, "w_gate_DF", cfg)), (up_XF, adapter("XD,DF->XF", h_XD, p, "w_up_DF", cfg))))
  else:
    gate_XF = dense("XD,DF->XF", h_XD, p, "w_gate_DF", cfg)
    up_XF = dense("XD,DF->XF", h_XD, p, "w_up_DF", cfg)
  act = functools.partial(jax.nn.gelu, approximate=True) if cfg.gemma else nn.silu
  return dense("XF,FD->XD", act(gate_XF) * up_XF, p, "w_down_FD", cfg)


# --- Mixture of experts ------------------------------------------------------------------------------
# E experts; each of the X tokens goes to k of them: A = X*k (token, expert) assignments. The
# lower-case k (the router's top-k) is the one letter outside the shape alphabet's capitals.

def route(cfg: ModelConfig, p: dict, h_XD: jax.Array, replay_Xk: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The router: (probabilities [X, E] fp32, the k most probable experts [X, k], their gates [X, k]).

  Softmax over all E experts in fp32, then top-k; with `norm_topk_prob` the k gates are
  renormalised to sum to 1 (else they are the raw probabilities, as Qwen3-30B-A3B's config says).
  Routing replay: a token whose `replay_Xk` row holds experts (>= 0; -1 = none) goes to those instead
  of its top-k, gated by this router's probabilities of them (renormalised alike), so the gradient
  still reaches the router through the gates.
  """
  logits_XE = matmul("XD,DE->XE", h_XD, p["router_DE"], cfg, jnp.float32)
  probs_XE = jax.nn.softmax(logits_XE, axis=-1)
  gate_Xk, expert_Xk = jax.lax.top_k(probs_XE, cfg.experts_per_token)
  if replay_Xk is not None:
    replay_Xk = replay_Xk.astype(jnp.int32)
    replayed_X1 = replay_Xk[:, :1] >= 0
    expert_Xk = jnp.where(replayed_X1, replay_Xk, expert_Xk)
    gate_Xk = jnp.where(replayed_X1, jnp.take_along_axis(probs_XE, jnp.maximum(replay_Xk, 0), axis=-1), gate_Xk)
  if cfg.norm_topk_prob:
    gate_Xk = gate_Xk / jnp.sum(gate_Xk, axis=-1, keepdims=True)
  return probs_XE, expert_Xk, gate_Xk


def _grouped(x_AI: jax.Array, w_EIO: jax.Array, sizes_E: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Row groups times their expert's matrix: the first sizes_E[0] rows by w[0], the next sizes_E[1]
  by w[1], ... (rows past the groups give 0). Operands in the matmul dtype, fp32 accumulation."""
  op = cfg.operand_dtype
  y = jax.lax.ragged_dot(x_AI.astype(op), w_EIO.astype(op), sizes_E, preferred_element_type=jnp.float32)
  return y.astype(cfg.dtype)


def expert_mlp(cfg: ModelConfig, p: dict, x_XD: jax.Array, expert_Xk: jax.Array, gate_Xk: jax.Array) -> jax.Array:
  """sum_j gate[x, j] * SwiGLU_e(x) with e = expert[x, j]: every assignment is computed (dropless,
  no capacity), exactly.

  The X*k assignments are sorted by expert, so each expert's rows are contiguous; one grouped
  matmul per weight (`ragged_dot`, group e = the rows of expert e) runs all experts; the rows are
  unsorted and each token's k outputs summed with its gates. Expert ids outside 0..E-1 (E = the
  experts in `p`: another shard's) sort last, fall in no group and contribute nothing.
  """
  X, k = expert_Xk.shape
  E = p["w_gate_EDF"].shape[0]
  expert_A = expert_Xk.reshape(-1)
  order_A = jnp.argsort(expert_A, stable=True)
  sizes_E = jax.ops.segment_sum(jnp.ones_like(expert_A), expert_A, num_segments=E)  # Drops ids >= E.
  x_AD = jnp.take(x_XD, order_A // k, axis=0)
  gate_AF = _grouped(x_AD, p["w_gate_EDF"], sizes_E, cfg)
  up_AF = _grouped(x_AD, p["w_up_EDF"], sizes_E, cfg)
  y_AD = _grouped(nn.silu(gate_AF) * up_AF, p["w_down_EFD"], sizes_E, cfg)
  y_XkD = jnp.take(y_AD, jnp.argsort(order_A), axis=0).reshape(X, k, -1)
  gate_Xk = jnp.where(expert_Xk < E, gate_Xk, 0).astype(y_XkD.dtype)
  return jnp.einsum("XkD,Xk->XD", y_XkD, gate_Xk)


EXPERT_WEIGHTS = ("w_gate_EDF", "w_up_EDF", "w_down_EFD")


def experts(cfg: ModelConfig, p: dict, x_XD: jax.Array, expert_Xk: jax.Array, gate_Xk: jax.Array) -> jax.Array:
  """`expert_mlp` on the mesh, whose `expert` axis holds E/n experts per device, in blocks of
  `expert_chunk` tokens per device.

  Expert parallelism as a sharded MLP: the n devices of an expert group gather their tokens (and
  routes), each runs its own experts on the assignments routed to them, and a reduce-scatter sums
  the partial outputs and returns each device its own tokens. Every assignment is computed once,
  on the device holding its expert; there is no capacity, hence nothing is dropped. Being
  dropless, a device's dispatch buffers hold every assignment of the group's tokens (one expert may
  receive them all): n * chunk * k rows, which the chunk bounds. The layer is written per device
  (`shard_map`): FSDP shards of the experts are gathered, tensor parallelism splits each expert's F
  and sums the partial outputs.
  """
  mesh = jax.sharding.get_abstract_mesh()
  w = {name: p[name] for name in EXPERT_WEIGHTS}
  if mesh.empty or mesh.size == 1:
    return _blocks(cfg, x_XD, expert_Xk, gate_Xk, w, n=1)
  batch = tuple(a for a in sharding.BATCH_AXES if a in mesh.axis_names)
  X, shards = x_XD.shape[0], math.prod(mesh.shape[a] for a in batch)
  x_XD, expert_Xk, gate_Xk = (_pad_rows(a, -X % shards) for a in (x_XD, expert_Xk, gate_Xk))
  n = mesh.shape.get("expert", 1)
  has = lambda a: a if a in mesh.axis_names else None

  def shard(x_XD, expert_Xk, gate_Xk, w):
    if has("fsdp"):
      w = {k: jax.lax.all_gather(v, "fsdp", axis=2 if k == "w_down_EFD" else 1, tiled=True) for k, v in w.items()}
    y_XD = _blocks(cfg, x_XD, expert_Xk, gate_Xk, w, n)
    return jax.lax.psum(y_XD, "tensor") if has("tensor") else y_XD

  rows = P(batch)
  w_specs = {"w_gate_EDF": P(has("expert"), has("fsdp"), has("tensor")),
             "w_up_EDF": P(has("expert"), has("fsdp"), has("tensor")),
             "w_down_EFD": P(has("expert"), has("tensor"), has("fsdp"))}
  y_XD = jax.shard_map(shard, in_specs=(rows, rows, rows, w_specs), out_specs=rows,
                       axis_names=set(mesh.axis_names))(x_XD, expert_Xk, gate_Xk, w)
  return y_XD[:X]


def _blocks(cfg: ModelConfig, x_XD, expert_Xk, gate_Xk, w: dict, n: int) -> jax.Array:
  """One device's tokens through the experts, in blocks of `expert_chunk` tokens, each block's
  buffers rematerialised in the backward pass (one block's live at a time). With n > 1 the
  device's experts are the `expert` axis index's E/n, and its tokens those of its expert group."""
  def block(x_XD, expert_Xk, gate_Xk):
    if n == 1:
      return expert_mlp(cfg, w, x_XD, expert_Xk, gate_Xk)
    x_XD, expert_Xk, gate_Xk = (jax.lax.all_gather(a, "expert", axis=0, tiled=True) for a in (x_XD, expert_Xk, gate_Xk))
    E = w["w_gate_EDF"].shape[0]
    local_Xk = expert_Xk - jax.lax.axis_index("expert") * E
    local_Xk = jnp.where((local_Xk >= 0) & (local_Xk < E), local_Xk, E)
    y_XD = expert_mlp(cfg, w, x_XD, local_Xk, gate_Xk)
    return jax.lax.psum_scatter(y_XD, "expert", scatter_dimension=0, tiled=True)

  c, X = cfg.expert_chunk, x_XD.shape[0]
  if not c or X <= c:
    return block(x_XD, expert_Xk, gate_Xk)
  args = tuple(_pad_rows(a, -X % c).reshape(-1, c, *a.shape[1:]) for a in (x_XD, expert_Xk, gate_Xk))
  y_nXD = jax.lax.map(jax.checkpoint(lambda a: block(*a)), args)
  return y_nXD.reshape(-1, y_nXD.shape[-1])[:X]


def _pad_rows(a: jax.Array, pad: int) -> jax.Array:
  return jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)) if pad else a


def feed_forward(cfg: ModelConfig, p: dict, h_XD: jax.Array, replay_Xk: jax.Array | None = None
                 ) -> tuple[jax.Array, Any]:
  """The layer's MLP, or its experts when it has a router: (output, routing) where routing is
  (probs_XE, expert_Xk) of an expert layer (the load statistics read it; the experts the tokens went
  to, `replay_Xk`'s where it holds some: `route`) and None otherwise."""
  if "router_DE" not in p:
    return mlp(cfg, p, h_XD), None
  probs_XE, expert_Xk, gate_Xk = route(cfg, p, h_XD, replay_Xk)
  return experts(cfg, p, h_XD, expert_Xk, gate_Xk), (probs_XE, expert_Xk)


def layer(cfg: ModelConfig, p: dict, x_XD: jax.Array, attend: Callable, replay_Xk: jax.Array | None = None
          ) -> tuple[jax.Array, Any, Any]:
  """Pre-norm block on flattened tokens: x + attn(norm(x)), then x + mlp(norm(x)); Gemma also
  normalises each branch's output (post-norms) before adding it. Returns (x, aux, routing).

  `attend(q_XKRH, k_XKH, v_XKH) -> (o_XNH, aux)` applies rotary embeddings and attention as the
  caller lays its tokens out; `aux` (e.g. the keys and values written to a cache) is returned, and
  so is the routing of an expert layer (`feed_forward`; `replay_Xk`: experts to route to, `route`).
  """
  h_XD = norm(cfg, x_XD, p["attn_norm"]["scale_D"])
  o_XNH, aux = attend(*project_qkv(cfg, p, h_XD))
  a_XD = dense("XNH,NHD->XD", o_XNH, p, "wo_NHD", cfg)
  if cfg.gemma:
    a_XD = norm(cfg, a_XD, p["post_attn_norm"]["scale_D"])
  x_XD = x_XD + a_XD
  m_XD, routing = feed_forward(cfg, p, norm(cfg, x_XD, p["mlp_norm"]["scale_D"]), replay_Xk)
  if cfg.gemma:
    m_XD = norm(cfg, m_XD, p["post_mlp_norm"]["scale_D"])
  return x_XD + m_XD, aux, routing
