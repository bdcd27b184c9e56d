"""The image side of Qwen2.5-VL: its vision transformer and the patch merger.

An image [C, S, S] (the processor's pixels) is cut into P = (S/p)^2 patches, listed as the processor
lists them: merge-block-major (each m x m block of neighbouring patches consecutive, blocks row-major).
A still image is `temporal_patch_size` equal frames, so a patch's vector is [C, T, p, p] flattened, and
a bias-free linear map (HF's stride-p Conv3d) embeds it. The patches are then reordered window by window
(`window_order`: windows of `window_size` pixels a side), so that a window's patches are consecutive;
each layer attends within its window, or over the whole image in `full_attention_layers`, with 2D
rotary positions (a patch's row rotates half of each head, its column the other half). The merger
RMS-norms each patch, concatenates each block's m^2 patches, maps them through a GELU MLP to the
language model's width, and puts the M = P/m^2 tokens back in row-major order.

All the reorderings depend on the image size alone, which is fixed per run (`VisionConfig.image_size`):
they are NumPy constants of the compiled program. Every image of a run has the same M tokens, which
keeps the update's and the engine's shapes static (HF's processor keeps each image's aspect ratio and
so varies M; `data.images.pixels` resizes first, so both see the same pixels). Where the tokens
rotate in the language model is `mrope`'s.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dapo_jax.model import layers as layers_lib
from dapo_jax.model.config import VisionConfig


def init_params(vcfg: VisionConfig, embed_dim: int, rng: jax.Array) -> dict:
  """Random tower and merger weights (fp32): layer weights stacked on a leading L axis. Shape letters:
  I a patch's pixels, D the tower's width, F its MLP, G the merged width (m^2 D), E the language model's."""
  Dv, F, L = vcfg.embed_dim, vcfg.mlp_dim, vcfg.num_layers
  G = Dv * vcfg.merge_size ** 2
  keys = iter(jax.random.split(rng, 16))
  normal = lambda *shape: 0.02 * jax.random.normal(next(keys), shape, jnp.float32)
  zeros, ones = (lambda *s: jnp.zeros(s, jnp.float32)), (lambda *s: jnp.ones(s, jnp.float32))
  layers = {"norm1_D": ones(L, Dv), "norm2_D": ones(L, Dv), "gate_DF": normal(L, Dv, F), "gate_bias_F": zeros(L, F),
            "up_DF": normal(L, Dv, F), "up_bias_F": zeros(L, F), "down_FD": normal(L, F, Dv),
            "down_bias_D": zeros(L, Dv)}
  for name in ("q", "k", "v", "o"):
    layers[f"w{name}_DD"] = normal(L, Dv, Dv)
    layers[f"b{name}_D"] = zeros(L, Dv)
  return {"patch_ID": normal(vcfg.num_channels * vcfg.temporal_patch_size * vcfg.patch_size ** 2, Dv),
          "layers": layers, "merge_norm_D": ones(Dv), "merge_fc1_GG": normal(G, G), "merge_fc1_bias_G": zeros(G),
          "merge_fc2_GE": normal(G, embed_dim), "merge_fc2_bias_E": zeros(embed_dim)}


def patches(vcfg: VisionConfig, pixels_ICSS: jax.Array) -> jax.Array:
  """[I, C, S, S] -> [I, P, C*T*p*p]: the processor's flattened patches (merge-block-major; each patch's
  pixels in (channel, frame, row, column) order, its T frames equal)."""
  I, C, S, _ = pixels_ICSS.shape
  p, m, T = vcfg.patch_size, vcfg.merge_size, vcfg.temporal_patch_size
  b = S // (p * m)
  x = pixels_ICSS.reshape(I, C, b, m, p, b, m, p).transpose(0, 2, 5, 3, 6, 1, 4, 7)  # [I, b, b, m, m, C, p, p]
  x = jnp.broadcast_to(x[:, :, :, :, :, :, None], x.shape[:6] + (T, p, p))
  return x.reshape(I, b * b * m * m, C * T * p * p)


def window_order(vcfg: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
  """(the merged tokens' order window by window [M], each reordered patch's window [P]): windows of
  `window_size` pixels a side tile the merged grid row-major, the edge windows cut short."""
  _, b = vcfg.grid
  w = vcfg.window_size // vcfg.merge_size // vcfg.patch_size
  order, window = [], []
  for top in range(0, b, w):
    for left in range(0, b, w):
      block = [r * b + c for r in range(top, min(top + w, b)) for c in range(left, min(left + w, b))]
      order += block
      window += [top * b + left] * (len(block) * vcfg.merge_size ** 2)  # A window's id: its first token.
  return np.asarray(order, np.int32), np.asarray(window, np.int32)


def patch_positions(vcfg: VisionConfig) -> np.ndarray:
  """[P, 2] (row, column) of each patch, in the processor's merge-block-major order."""
  g, b = vcfg.grid
  m = vcfg.merge_size
  rows, cols = np.meshgrid(np.arange(g), np.arange(g), indexing="ij")
  block = lambda a: a.reshape(b, m, b, m).transpose(0, 2, 1, 3).reshape(-1)
  return np.stack([block(rows), block(cols)], axis=-1)


def _rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps) * scale[None, None]


def _linear(x_IPD: jax.Array, w_DE: jax.Array, b_E: jax.Array) -> jax.Array:
  return jnp.einsum("IPD,DE->IPE", x_IPD, w_DE) + b_E[None, None]


def image_features(vcfg: VisionConfig, vparams: dict, pixels_ICSS: jax.Array) -> jax.Array:
  """The merged tokens [I, M, E] (fp32) of I images, row-major, as the language model takes them."""
  I = pixels_ICSS.shape[0]
  Dv, Nh, m2 = vcfg.embed_dim, vcfg.num_heads, vcfg.merge_size ** 2
  Hd = Dv // Nh
  order_M, window_P = window_order(vcfg)
  M = order_M.size
  x_IPD = jnp.einsum("IPX,XD->IPD", patches(vcfg, pixels_ICSS.astype(jnp.float32)), vparams["patch_ID"])
  x_IPD = x_IPD.reshape(I, M, m2, Dv)[:, order_M].reshape(I, M * m2, Dv)  # Window by window.
  rc_P2 = patch_positions(vcfg).reshape(M, m2, 2)[order_M].reshape(M * m2, 2)
  inv_q = 1.0 / (vcfg.rope_theta ** (np.arange(0, Hd // 2, 2, dtype=np.float32) / (Hd // 2)))
  angle_Ph = np.concatenate([rc_P2[:, :1] * inv_q, rc_P2[:, 1:] * inv_q], axis=-1)  # Row half, column half.
  table = (jnp.cos(angle_Ph)[None], jnp.sin(angle_Ph)[None])
  window_PP = jnp.asarray(window_P[:, None] == window_P[None, :])
  full_L = jnp.asarray([l in vcfg.full_attention_layers for l in range(vcfg.num_layers)])

  def layer(x_IPD, inputs):
    w, full = inputs
    P = x_IPD.shape[1]
    h = _rms_norm(x_IPD, w["norm1_D"], vcfg.norm_eps)
    q, k, v = (_linear(h, w[f"w{n}_DD"], w[f"b{n}_D"]).reshape(I, P, Nh, Hd) for n in "qkv")
    q, k = layers_lib.rope(q, table), layers_lib.rope(k, table)
    scores_INPQ = jnp.einsum("IPNH,IQNH->INPQ", q, k) * Hd ** -0.5
    scores_INPQ = jnp.where(full | window_PP, scores_INPQ, -jnp.inf)
    out = jnp.einsum("INPQ,IQNH->IPNH", jax.nn.softmax(scores_INPQ, axis=-1), v).reshape(I, P, Dv)
    x_IPD = x_IPD + _linear(out, w["wo_DD"], w["bo_D"])
    h = _rms_norm(x_IPD, w["norm2_D"], vcfg.norm_eps)
    h = jax.nn.silu(_linear(h, w["gate_DF"], w["gate_bias_F"])) * _linear(h, w["up_DF"], w["up_bias_F"])
    return x_IPD + _linear(h, w["down_FD"], w["down_bias_D"]), None

  x_IPD, _ = jax.lax.scan(layer, x_IPD, (vparams["layers"], full_L))
  x_IMG = _rms_norm(x_IPD, vparams["merge_norm_D"], 1e-6).reshape(I, M, m2 * Dv)
  h = jax.nn.gelu(_linear(x_IMG, vparams["merge_fc1_GG"], vparams["merge_fc1_bias_G"]), approximate=False)
  out_IME = _linear(h, vparams["merge_fc2_GE"], vparams["merge_fc2_bias_E"])
  return out_IME[:, np.argsort(order_M)]  # Back to row-major.
