"""The image side of Qwen2.5-VL: its vision transformer and the patch merger.

An image of h x w patches of p pixels (the processor's grid, `data.images.grid`) enters as the
processor's flat patches, listed merge-block-major (each m x m block of neighbouring patches
consecutive, blocks row-major), in the first h*w of P = (S/p)^2 patch slots (`patches` cuts them from
the S x S canvas `data.images.pixels` fills). A still image is `temporal_patch_size` equal frames, so a
patch's vector is [C, T, p, p] flattened, and a bias-free linear map (HF's stride-p Conv3d) embeds it.
Each layer attends within windows of `window_size` pixels a side, or over the whole image in
`full_attention_layers`, with 2D rotary positions (a patch's row rotates half of each head, its column
the other half): transformers reorders the patches window by window and attends over each run, which
is the same attention as masks on the processor's order, the one kept here. The merger RMS-norms each
patch, concatenates each block's m^2 patches and maps them through a GELU MLP to the language model's
width: the image's (h/m)(w/m) tokens, row-major.

Where each patch sits depends on its image's grid, an input: one compiled program serves every size
(`VisionConfig.native_resolution`: each image keeps its aspect ratio, as transformers' processor does),
the images of a batch laid in slots of the largest one. Where the tokens rotate in the language model
is `mrope`'s.
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
  """[I, C, S, S] -> [I, P, C*T*p*p]: the patch slots, as the processor flattens the patches of an S x S
  image (merge-block-major; each patch's pixels in (channel, frame, row, column) order, its T frames
  equal). A smaller image's own patches fill the first slots (`data.images.pixels`)."""
  I, C, S, _ = pixels_ICSS.shape
  p, m, T = vcfg.patch_size, vcfg.merge_size, vcfg.temporal_patch_size
  b = S // (p * m)
  x = pixels_ICSS.reshape(I, C, b, m, p, b, m, p).transpose(0, 2, 5, 3, 6, 1, 4, 7)  # [I, b, b, m, m, C, p, p]
  x = jnp.broadcast_to(x[:, :, :, :, :, :, None], x.shape[:6] + (T, p, p))
  return x.reshape(I, b * b * m * m, C * T * p * p)


def patch_layout(vcfg: VisionConfig, grids_X2: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Where each of the P patch slots of X images sits: ((row, column) [X, P, 2], window [X, P]). Image x
  is grids_X2[x] = (h, w) patches; its h*w patches fill the first slots in the processor's order (merge
  blocks row-major over its (h/m, w/m) merged grid, each block's m x m patches row-major), and windows of
  `window_size` pixels a side tile the merged grid row-major from the top left, the edge windows cut
  short. A window is numbered by its (row, column) of windows; the slots past h*w are window -1."""
  m = vcfg.merge_size
  slot_P = jnp.arange(vcfg.num_patches)
  block_P, within_P = slot_P // (m * m), slot_P % (m * m)
  cols_X1 = grids_X2[:, 1:] // m  # Merged tokens a row.
  block_row, block_col = block_P[None] // jnp.maximum(cols_X1, 1), block_P[None] % jnp.maximum(cols_X1, 1)
  rc_XP2 = jnp.stack([block_row * m + within_P[None] // m, block_col * m + within_P[None] % m], axis=-1)
  w = vcfg.window_size // m // vcfg.patch_size  # Merged tokens a window side.
  window_XP = (block_row // w) * (vcfg.num_patches + 1) + block_col // w
  real_XP = slot_P[None] < grids_X2[:, :1] * grids_X2[:, 1:]
  return rc_XP2, jnp.where(real_XP, window_XP, -1)


def _rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps) * scale[None, None]


def _linear(x_IPD: jax.Array, w_DE: jax.Array, b_E: jax.Array) -> jax.Array:
  return jnp.einsum("IPD,DE->IPE", x_IPD, w_DE) + b_E[None, None]


def image_features(vcfg: VisionConfig, vparams: dict, pixels_ICSS: jax.Array, grids_I2: jax.Array | None = None
                   ) -> jax.Array:
  """The merged tokens [I, M, E + 1] (fp32) of I images, row-major over each image's merged grid: the
  first (h/m)(w/m) of image i (`grids_I2[i]` = (h, w) patches; None: every image the whole square), each
  with one more channel, its image's merged tokens a row (w/m), which M-RoPE reads (`mrope`)."""
  I = pixels_ICSS.shape[0]
  Dv, Nh, m = vcfg.embed_dim, vcfg.num_heads, vcfg.merge_size
  Hd = Dv // Nh
  if grids_I2 is None:
    grids_I2 = jnp.full((I, 2), vcfg.image_size // vcfg.patch_size, jnp.int32)
  x_IPD = jnp.einsum("IPX,XD->IPD", patches(vcfg, pixels_ICSS.astype(jnp.float32)), vparams["patch_ID"])
  rc_IP2, window_IP = patch_layout(vcfg, jnp.asarray(grids_I2, jnp.int32))
  inv_q = 1.0 / (vcfg.rope_theta ** (np.arange(0, Hd // 2, 2, dtype=np.float32) / (Hd // 2)))
  rc_IP2 = rc_IP2.astype(jnp.float32)
  inv_11q = inv_q[None, None]
  angle_IPh = jnp.concatenate([rc_IP2[..., :1] * inv_11q, rc_IP2[..., 1:] * inv_11q], axis=-1)  # Row half, column half.
  table = (jnp.cos(angle_IPh), jnp.sin(angle_IPh))
  # Each layer attends within a window, or within the whole image; the slots past an image's patches see
  # only each other (never seen by a real patch, never merged into a placed token).
  window_IPP = (window_IP[:, :, None] == window_IP[:, None, :])[:, None]
  image_IPP = ((window_IP[:, :, None] >= 0) == (window_IP[:, None, :] >= 0))[:, None]
  full_L = jnp.asarray([l in vcfg.full_attention_layers for l in range(vcfg.num_layers)])

  def layer(x_IPD, inputs):
    w, full = inputs
    P = x_IPD.shape[1]
    h = _rms_norm(x_IPD, w["norm1_D"], vcfg.norm_eps)
    q, k, v = (_linear(h, w[f"w{n}_DD"], w[f"b{n}_D"]).reshape(I, P, Nh, Hd) for n in "qkv")
    q, k = layers_lib.rope(q, table), layers_lib.rope(k, table)
    scores_INPQ = jnp.einsum("IPNH,IQNH->INPQ", q, k) * Hd ** -0.5
    scores_INPQ = jnp.where(jnp.where(full, image_IPP, window_IPP), scores_INPQ, -jnp.inf)
    out = jnp.einsum("INPQ,IQNH->IPNH", jax.nn.softmax(scores_INPQ, axis=-1), v).reshape(I, P, Dv)
    x_IPD = x_IPD + _linear(out, w["wo_DD"], w["bo_D"])
    h = _rms_norm(x_IPD, w["norm2_D"], vcfg.norm_eps)
    h = jax.nn.silu(_linear(h, w["gate_DF"], w["gate_bias_F"])) * _linear(h, w["up_DF"], w["up_bias_F"])
    return x_IPD + _linear(h, w["down_FD"], w["down_bias_D"]), None

  x_IPD, _ = jax.lax.scan(layer, x_IPD, (vparams["layers"], full_L))
  M = vcfg.tokens_per_image
  x_IMG = _rms_norm(x_IPD, vparams["merge_norm_D"], 1e-6).reshape(I, M, m * m * Dv)  # A merge block's patches.
  h = jax.nn.gelu(_linear(x_IMG, vparams["merge_fc1_GG"], vparams["merge_fc1_bias_G"]), approximate=False)
  out_IME = _linear(h, vparams["merge_fc2_GE"], vparams["merge_fc2_bias_E"])
  cols_IM1 = jnp.broadcast_to((grids_I2[:, None, 1:] // m).astype(jnp.float32), (I, M, 1))
  return jnp.concatenate([out_IME, cols_IM1], axis=-1)


def merged_tokens(vcfg: VisionConfig, grids_I2: jax.Array) -> jax.Array:
  """[I] the merged tokens of each image of grid (h, w) patches: h*w / m^2."""
  return grids_I2[:, 0] * grids_I2[:, 1] // vcfg.merge_size ** 2
