"""The image side of a vision-language model: Gemma 3's SigLIP vision tower and the projector that pools
its patches into soft tokens (Qwen2.5-VL's tower is `qwen_vision`), and where those tokens enter the
language model.

An image [C, S, S] (the processor's pixels, S = `image_size`) becomes P = (S / patch_size)^2 patch
vectors, a bidirectional transformer encodes them ([P, Dv]), and the projector average-pools them to
M = `tokens_per_image` vectors, normalises and projects them to the language model's width D. A prompt
holds M `image_token_id` tokens per image (the template's placeholder, expanded); `place` puts the
image's vectors at those positions, in order, and `image_attention` lets the tokens of one image see
each other both ways (causal attention elsewhere), as Gemma 3 does.

The tower is pure functions over a dict of stacked weights (params["vision"] of the model): it runs
once per prompt, outside the language model, and its output is an input of every pass that scores a
token.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from dapo_jax.model import layers as layers_lib
from dapo_jax.model import qwen_vision
from dapo_jax.model.config import VisionConfig


def tower_params(params: dict) -> dict:
  """params["vision"] of a model's params, or of an adapted tree's frozen base (`lora`)."""
  return params["base"]["vision"] if "base" in params and "lora" in params else params["vision"]


# Logical axes of the tower's weights by their shape letters: its width (D) and the text model's (E) are
# "embed" (fsdp), its MLP (F) "mlp" (tensor), as in the text model; pixels (I), patches (P) and Qwen's
# merged width (G) stay whole.
_AXES = {"D": "embed", "E": "embed", "F": "mlp", "I": None, "P": None, "G": None}


def logical_axes(name: str, ndim: int) -> tuple[str | None, ...]:
  """A tower weight's logical axes from its name ('fc1_DF' stacked on L -> ('layers', 'embed', 'mlp')); an
  axis named twice (a square weight) is split on its first side only."""
  axes = []
  for c in name.rsplit("_", 1)[1]:
    axes.append(None if _AXES[c] in axes else _AXES[c])
  return ("layers",) * (ndim - len(axes)) + tuple(axes)


def boxed(vparams: dict) -> dict:
  """The tower's weights boxed with their logical axes (`transformer.init_boxed`: they shard as the text
  model's do)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: nn.LogicallyPartitioned(x, logical_axes(path[-1].key, x.ndim)), vparams)


def init_params(vcfg: VisionConfig, embed_dim: int, rng: jax.Array) -> dict:
  """Random tower and projector weights (fp32): layer weights stacked on a leading L axis."""
  if vcfg.kind == "qwen2_5_vl":
    return qwen_vision.init_params(vcfg, embed_dim, rng)
  Dv, F, L, p, C = vcfg.embed_dim, vcfg.mlp_dim, vcfg.num_layers, vcfg.patch_size, vcfg.num_channels
  keys = iter(jax.random.split(rng, 16))
  normal = lambda *shape: 0.02 * jax.random.normal(next(keys), shape, jnp.float32)
  zeros, ones = (lambda *s: jnp.zeros(s, jnp.float32)), (lambda *s: jnp.ones(s, jnp.float32))
  layers = {"ln1_scale_D": ones(L, Dv), "ln1_bias_D": zeros(L, Dv), "ln2_scale_D": ones(L, Dv),
            "ln2_bias_D": zeros(L, Dv), "fc1_DF": normal(L, Dv, F), "fc1_bias_F": zeros(L, F),
            "fc2_FD": normal(L, F, Dv), "fc2_bias_D": zeros(L, Dv)}
  for name in ("q", "k", "v", "o"):
    layers[f"w{name}_DD"] = normal(L, Dv, Dv)
    layers[f"b{name}_D"] = zeros(L, Dv)
  return {"patch_ID": normal(C * p * p, Dv), "patch_bias_D": zeros(Dv), "pos_PD": normal(vcfg.num_patches, Dv),
          "layers": layers, "post_norm_scale_D": ones(Dv), "post_norm_bias_D": zeros(Dv),
          "soft_norm_D": zeros(Dv), "proj_DE": normal(Dv, embed_dim)}


def _layer_norm(x_IPD: jax.Array, scale_D: jax.Array, bias_D: jax.Array, eps: float) -> jax.Array:
  x32 = x_IPD.astype(jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  return ((x32 - mean) * jax.lax.rsqrt(var + eps) * scale_D[None, None] + bias_D[None, None]).astype(x_IPD.dtype)


def _linear(x_IPD: jax.Array, w_DE: jax.Array, b_E: jax.Array) -> jax.Array:
  return jnp.einsum("IPD,DE->IPE", x_IPD, w_DE) + b_E[None, None]


def patches(vcfg: VisionConfig, pixels_ICSS: jax.Array) -> jax.Array:
  """[I, C, S, S] -> [I, P, C*p*p]: each patch's pixels in (channel, row, column) order, patches row-major
  (a stride-p convolution's view of the image)."""
  I, C, S, _ = pixels_ICSS.shape
  p, g = vcfg.patch_size, S // vcfg.patch_size
  x = pixels_ICSS.reshape(I, C, g, p, g, p).transpose(0, 2, 4, 1, 3, 5)
  return x.reshape(I, g * g, C * p * p)


def encode(vcfg: VisionConfig, vparams: dict, pixels_ICSS: jax.Array) -> jax.Array:
  """The tower's last hidden states [I, P, Dv] (fp32) of I images."""
  Nh = vcfg.num_heads
  eps = vcfg.norm_eps
  x_IPD = _linear(patches(vcfg, pixels_ICSS.astype(jnp.float32)), vparams["patch_ID"], vparams["patch_bias_D"])
  x_IPD = x_IPD + vparams["pos_PD"][None]

  def layer(x_IPD, w):
    I, P, Dv = x_IPD.shape
    h = _layer_norm(x_IPD, w["ln1_scale_D"], w["ln1_bias_D"], eps)
    split = lambda a: a.reshape(I, P, Nh, Dv // Nh)
    q, k, v = (split(_linear(h, w[f"w{n}_DD"], w[f"b{n}_D"])) for n in "qkv")
    scores_INPP = jnp.einsum("IPNH,IQNH->INPQ", q, k) * (Dv // Nh) ** -0.5
    out = jnp.einsum("INPQ,IQNH->IPNH", jax.nn.softmax(scores_INPP, axis=-1), v).reshape(I, P, Dv)
    x_IPD = x_IPD + _linear(out, w["wo_DD"], w["bo_D"])
    h = _layer_norm(x_IPD, w["ln2_scale_D"], w["ln2_bias_D"], eps)
    h = jax.nn.gelu(_linear(h, w["fc1_DF"], w["fc1_bias_F"]), approximate=True)
    return x_IPD + _linear(h, w["fc2_FD"], w["fc2_bias_D"]), None

  x_IPD, _ = jax.lax.scan(layer, x_IPD, vparams["layers"])
  return _layer_norm(x_IPD, vparams["post_norm_scale_D"], vparams["post_norm_bias_D"], eps)


def project(vcfg: VisionConfig, vparams: dict, x_IPD: jax.Array) -> jax.Array:
  """Gemma 3's projector: patches average-pooled to M soft tokens, (1 + w) RMS-normed, projected to the
  language model's width: [I, P, Dv] -> [I, M, D]."""
  I, P, Dv = x_IPD.shape
  g, t = vcfg.image_size // vcfg.patch_size, round(vcfg.tokens_per_image ** 0.5)
  k = g // t
  pooled = x_IPD.reshape(I, t, k, t, k, Dv).mean(axis=(2, 4)).reshape(I, t * t, Dv)
  normed = layers_lib.rms_norm(pooled, vparams["soft_norm_D"], vcfg.norm_eps, plus_one=True)
  return jnp.einsum("IMD,DE->IME", normed.astype(jnp.float32), vparams["proj_DE"])


def image_features(vcfg: VisionConfig, vparams: dict, pixels_BICSS: jax.Array, grids_BI2: jax.Array | None = None
                   ) -> jax.Array:
  """Soft tokens of each row's I images, in order: [B, I, C, S, S] -> [B, I*M, D] (fp32). A row with fewer
  images pads with any pixels (zeros): `place` reads only as many vectors as the row has placeholders.
  Qwen2.5-VL: `grids_BI2` each image's (h, w) patches (None: S x S each; an empty slot (0, 0)), its
  (h/m)(w/m) tokens right after the previous image's, and each vector one more channel, its image's
  tokens a row (`qwen_vision.image_features`, read by `mrope`)."""
  B, I = pixels_BICSS.shape[:2]
  pixels_XCSS = pixels_BICSS.reshape(B * I, *pixels_BICSS.shape[2:])
  if vcfg.kind != "qwen2_5_vl":
    return project(vcfg, vparams, encode(vcfg, vparams, pixels_XCSS)).reshape(B, I * vcfg.tokens_per_image, -1)
  grids_X2 = None if grids_BI2 is None else jnp.asarray(grids_BI2, jnp.int32).reshape(B * I, 2)
  feats_XME = qwen_vision.image_features(vcfg, vparams, pixels_XCSS, grids_X2)
  M = vcfg.tokens_per_image
  if grids_BI2 is None:  # Every image M tokens: end to end.
    return feats_XME.reshape(B, I * M, -1)
  # Image i's tokens right after image i-1's: the j-th placeholder of a row reads vector j.
  count_BI = qwen_vision.merged_tokens(vcfg, grids_X2).reshape(B, I)
  start_BI = jnp.cumsum(count_BI, axis=1) - count_BI
  j_BIM = jnp.arange(M)[None, None]
  to_BIM = jnp.where(j_BIM < count_BI[..., None], start_BI[..., None] + j_BIM, I * M)  # I*M: dropped.
  rows_BIM = jnp.broadcast_to(jnp.arange(B)[:, None, None], to_BIM.shape)
  out = jnp.zeros((B, I * M, feats_XME.shape[-1]), feats_XME.dtype)
  return out.at[rows_BIM, to_BIM].set(feats_XME.reshape(B, I, M, -1), mode="drop")


def with_shapes(vcfg: VisionConfig, embed_dim: int, vectors_QME: np.ndarray) -> np.ndarray:
  """Qwen2.5-VL image vectors as `image_features` gives them: vectors saved before they carried their
  image's shape (D channels, S x S images) get it, S/28 tokens a row; anything else is returned as it is."""
  if vcfg is None or vcfg.kind != "qwen2_5_vl" or vectors_QME.shape[-1] != embed_dim:
    return vectors_QME
  return np.concatenate([vectors_QME, np.full(vectors_QME.shape[:-1] + (1,), vcfg.grid[1], vectors_QME.dtype)], -1)


# `image_features`, compiled once per tower config and pixel shape (the rollout's and the warm start's).
encode_images = jax.jit(image_features, static_argnums=0)


def place(x_BTD: jax.Array, tokens_BT: jax.Array, features_BMD: jax.Array, image_token_id: int) -> jax.Array:
  """Token embeddings with the image placeholders replaced by the row's image vectors, the j-th
  placeholder of a row by vector j (its first D channels: Qwen2.5-VL's carry one more, `image_features`)."""
  is_image_BT = tokens_BT == image_token_id
  index_BT = jnp.clip(jnp.cumsum(is_image_BT, axis=1) - 1, 0, features_BMD.shape[1] - 1)
  placed_BTD = jnp.take_along_axis(features_BMD[..., :x_BTD.shape[-1]], index_BT[..., None], axis=1)
  placed_BTD = placed_BTD.astype(x_BTD.dtype)
  return jnp.where(is_image_BT[..., None], placed_BTD, x_BTD)


def image_blocks(tokens_BT: jax.Array, image_token_id: int) -> jax.Array:
  """[B, T] index of the run of consecutive placeholders (one image) each token is in; -1 for text."""
  is_image = tokens_BT == image_token_id
  starts = is_image & ~jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
  return jnp.where(is_image, jnp.cumsum(starts, axis=1) - 1, -1)


def image_attention(mask_BTS: jax.Array, tokens_BT: jax.Array, image_token_id: int) -> jax.Array:
  """A causal [B, T, T] mask of rows, opened both ways inside each image: a placeholder sees every
  placeholder of its own image (Gemma 3's bidirectional image attention; a sliding window, applied
  after, still bounds how far back a query sees)."""
  block_BT = image_blocks(tokens_BT, image_token_id)
  same_BTS = (block_BT[:, :, None] == block_BT[:, None, :]) & (block_BT[:, :, None] >= 0)
  return mask_BTS | same_BTS
