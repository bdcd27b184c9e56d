"""Qwen2.5-VL's multimodal rotary positions (M-RoPE): where each token of a row with images rotates in
the language model (`ModelConfig.mrope_section`, `layers.rope_table`).

transformers numbers a prompt's positions so that text after an image continues at the
image's start + max(h, w) (h x w merged tokens) rather than its start + h*w, and gives the image's
tokens (start, start + row, start + col) in the (temporal, height, width) sections of the rotary
frequencies. Here each row's positions are those plus one constant per row, the delta its images make:
tokens after the last image keep their ordinary positions, so a decoded token rotates by its place in
the cache alone, as in a text model. Attention depends on differences of positions only, so the logits
are transformers' (`mrope_positions`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dapo_jax.model.config import VisionConfig


def mrope_positions(vcfg: VisionConfig, pos_BT: jax.Array, tokens_BT: jax.Array,
                    images_BME: jax.Array | None = None) -> jax.Array:
  """[3, B, T] (temporal, height, width) rotary positions of rows whose positions are `pos_BT`: an image's
  tokens at (s, s + row, s + col) from its first token's s, text at its own; each token shifted by
  (tokens - max(rows, cols)) of every image not ended before it (the module docstring: transformers'
  positions plus one constant per row, 0 after the last image). An image is a run of placeholders; its
  tokens a row are the last channel of its vectors `images_BME` (`vision.image_features`, the j-th
  placeholder's vector j), or, without them, those of an S x S image."""
  is_image = tokens_BT == vcfg.image_token_id
  seen_BT = jnp.cumsum(is_image, axis=1)  # Placeholders up to and including each token.
  if images_BME is None:
    cols_BT = jnp.full(tokens_BT.shape, vcfg.grid[1], jnp.int32)
  else:
    index_BT = jnp.clip(seen_BT - 1, 0, images_BME.shape[1] - 1)
    cols_BT = jnp.take_along_axis(images_BME[..., -1], index_BT, axis=1).astype(jnp.int32)
  cols_BT = jnp.where(is_image, jnp.maximum(cols_BT, 1), 1)
  before = jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
  after = jnp.pad(is_image, ((0, 0), (0, 1)))[:, 1:]
  first_BT = jax.lax.cummax(jnp.where(is_image & ~before, seen_BT, 0), axis=1)  # Its image's first, counted.
  r_BT = jnp.where(is_image, seen_BT - first_BT, 0)  # A token's place in its image.
  count_BT = r_BT + 1  # At an image's last token: its tokens.
  saved_BT = jnp.where(is_image & ~after, count_BT - jnp.maximum(count_BT // cols_BT, cols_BT), 0)
  shift_BT = jnp.flip(jnp.cumsum(jnp.flip(saved_BT, axis=1), axis=1), axis=1)  # Images ending at or after.
  start_BT = pos_BT - r_BT + shift_BT
  return jnp.stack([start_BT, start_BT + r_BT // cols_BT, start_BT + r_BT % cols_BT])
