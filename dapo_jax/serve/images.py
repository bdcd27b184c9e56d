"""Images in chat requests to the policy server: OpenAI's `image_url` content parts, as base64 `data:`
URLs (the server fetches nothing from the network), checked and decoded, and the vision tower that
turns a request's images into the vectors its prompt's placeholders take (`vision.place`).

A message's text keeps `data.images.IMAGE_MARK` where each image part stood, which the prompt's
rendering expands to the model's image tokens, as a training row's marks are.
"""
from __future__ import annotations

import base64
import binascii
import re

import jax
import numpy as np

from dapo_jax import sharding
from dapo_jax.data import images as images_lib
from dapo_jax.errors import DataError
from dapo_jax.model import vision
from dapo_jax.serve.http import APIError

_DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,(.*)", re.S)


def part_image(part: dict, param: str) -> bytes:
  """The encoded image of an `image_url` part ({"type": "image_url", "image_url": {"url":
  "data:image/png;base64,..."}}), checked to decode; a 400 naming `param` otherwise."""
  spec = part.get("image_url")
  url = spec.get("url") if isinstance(spec, dict) else spec
  if not isinstance(url, str):
    raise APIError(400, f"{param}.image_url.url: expected a string", param=f"{param}.image_url.url")
  match = _DATA_URL.fullmatch(url.strip())
  if not match:
    raise APIError(400, f"{param}.image_url.url: expected a data:image/...;base64,... URL (this server fetches "
                   f"nothing), got {url[:40]!r}", param=f"{param}.image_url.url")
  try:
    data = base64.b64decode(match[1], validate=True)
  except (binascii.Error, ValueError) as e:
    raise APIError(400, f"{param}.image_url.url: not base64 ({e})", param=f"{param}.image_url.url") from None
  try:
    images_lib.decode(data, param)
  except DataError as e:
    raise APIError(400, str(e), param=param) from None
  return data


class ImageEncoder:
  """A vision-language policy's tower on the server: each request's images (up to `max_images`) ->
  [max_images * M, D] fp32 vectors in placeholder order (zeros where it has fewer, never placed).
  `pan_and_scan`: a request's images and marks go through Gemma 3's crops first (`images.pan_and_scan`)."""

  def __init__(self, model_cfg, params, max_images: int, mesh=None, pan_and_scan: bool = False):
    self.vcfg, self.max_images, self.pan_and_scan = model_cfg.vision, max_images, pan_and_scan
    self.tower = vision.tower_params(params)
    self.replicated = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    self.width = max_images * self.vcfg.tokens_per_image
    self.dim = model_cfg.embed_dim + (self.vcfg.kind == "qwen2_5_vl")  # Qwen2.5-VL's carry their image's shape

  def vectors(self, images: list[bytes], param: str = "messages") -> np.ndarray:
    if len(images) > self.max_images:
      raise APIError(400, f"{param}: {len(images)} images; this server takes at most {self.max_images} per "
                     "request (--max_images)", param=param)
    if not images:
      return np.zeros((self.width, self.dim), np.float32)
    inputs = [images_lib.batch_pixels(self.vcfg, [images], self.max_images)]
    if self.vcfg.native_resolution:
      inputs.append(images_lib.batch_grids(self.vcfg, [images], self.max_images))
    if self.replicated is not None:
      inputs = [sharding.put(x, self.replicated) for x in inputs]
    return np.asarray(vision.encode_images(self.vcfg, self.tower, *inputs))[0]
