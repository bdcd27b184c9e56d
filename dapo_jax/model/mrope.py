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


def mrope_positions(vcfg: VisionConfig, pos_BT: jax.Array, tokens_BT: jax.Array) -> jax.Array:
  """[3, B, T] (temporal, height, width) rotary positions of rows whose positions are `pos_BT`: an image's
  M tokens at (s, s + row, s + col) from its first token's s, text at its own; each token shifted by
  (M - side) for every image not ended before it (the module docstring: transformers' positions plus one
  constant per row, 0 after the last image)."""
  M, (_, side) = vcfg.tokens_per_image, vcfg.grid
  is_image = tokens_BT == vcfg.image_token_id
  seen_BT = jnp.cumsum(is_image, axis=1)
  left_BT = seen_BT[:, -1:] - seen_BT + is_image  # Image tokens at or after each token.
  shift_BT = -(-left_BT // M) * (M - side)
  r_BT = jnp.where(is_image, (seen_BT - 1) % M, 0)  # An image token's place in its image.
  start_BT = pos_BT - r_BT + shift_BT
  return jnp.stack([start_BT, start_BT + r_BT // side, start_BT + r_BT % side])
