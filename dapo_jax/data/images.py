"""Images in prompts: read from dataset rows, checked, turned into the vision tower's pixels, and
their places in a prompt's text.

A row names its images in an `images` column (verl's convention): a list whose entries are the image
file's bytes, a path (relative to the dataset file), or {"bytes": ...} (base64 in JSON) / {"path": ...}. Its prompt
marks where each goes with `IMAGE_MARK`, in order. An `Example` holds the encoded images (PNG, JPEG:
the file's own bytes); `pixels` decodes and preprocesses them with the model's image processor from
transformers (`Gemma3ImageProcessorPil` or `Qwen2VLImageProcessorPil`: PIL and NumPy, no torch), and
`expand_marks` writes each mark as the model's begin-of-image token, its placeholders and end-of-image
token: `tokens_per_image` of them, or, for Qwen2.5-VL at native resolution, as many as the image's own
`grid` gives (`batch_grids`: the grids the tower reads with the pixels).
"""
from __future__ import annotations

import base64
import binascii
import functools
import io
import os
from typing import Sequence

import numpy as np

from dapo_jax.errors import ConfigError, DataError

IMAGE_MARK = "<image>"  # Where an image goes in a message's text.
# Begin of image, the placeholder, end of image: Gemma 3's names, which a tokenizer trained here holds too.
IMAGE_TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")
# Qwen2.5-VL's (`VisionConfig.kind` "qwen2_5_vl").
QWEN_IMAGE_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")


def image_tokens(kind: str) -> tuple[str, str, str]:
  """A tower kind's (begin, placeholder, end) token strings."""
  return QWEN_IMAGE_TOKENS if kind == "qwen2_5_vl" else IMAGE_TOKENS


def image_token_ids(tok, field: str, kind: str = "siglip") -> tuple[int, int, int]:
  """The tokenizer's ids of the tower kind's image tokens (`image_tokens`); a ConfigError naming `field`
  if it lacks one."""
  names = image_tokens(kind)
  ids = [tok.convert_tokens_to_ids(t) for t in names]
  missing = [t for t, i in zip(names, ids) if i is None or i == tok.unk_token_id]
  if missing:
    raise ConfigError(f"{field}: the tokenizer has no {missing} token(s) for images")
  return tuple(ids)


def read_entry(entry, base_dir: str, where: str) -> bytes:
  """One `images` entry's encoded bytes, checked to decode; a DataError naming `where` otherwise."""
  if isinstance(entry, dict) and isinstance(entry.get("bytes"), str):  # JSON has no bytes: base64.
    try:
      entry = base64.b64decode(entry["bytes"], validate=True)
    except binascii.Error as e:
      raise DataError(f"{where}: field 'bytes' is a string but not base64 ({e})") from None
  if isinstance(entry, dict):
    entry = entry.get("bytes") or entry.get("path")
  if isinstance(entry, str):
    path = entry if os.path.isabs(entry) else os.path.join(base_dir, entry)
    try:
      with open(path, "rb") as f:
        entry = f.read()
    except OSError as e:
      raise DataError(f"{where}: cannot read {path!r} ({e.strerror or e})") from None
  if not isinstance(entry, (bytes, bytearray)) or not entry:
    raise DataError(f"{where}: expected image bytes, a path, or {{'bytes' | 'path': ...}}, got {type(entry).__name__}")
  decode(bytes(entry), where)
  return bytes(entry)


def pil():
  """The Pillow module, or a one-line error saying how to get it."""
  try:
    import PIL.Image
  except ImportError:
    raise ConfigError("images need Pillow: pip install 'dapo_jax[vision]' (or pillow)") from None
  return PIL.Image


def decode(data: bytes, where: str = "image"):
  """The RGB PIL image of encoded bytes; a DataError naming `where` for a broken file."""
  Image = pil()
  from PIL import UnidentifiedImageError
  try:
    with Image.open(io.BytesIO(data)) as img:
      img.load()
      return img.convert("RGB")
  except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
    raise DataError(f"{where}: not a readable image ({type(e).__name__}: {e})") from None


def pan_and_scan(messages: Sequence[dict], images: Sequence[bytes], where: str = "image"
                 ) -> tuple[tuple[dict, ...], tuple[bytes, ...]]:
  """Gemma 3's pan-and-scan (`data.pan_and_scan`): each wide or tall image also enters as 2 to 4 crops side
  by side, each one more image the tower sees whole (transformers' `Gemma3ImageProcessorPil.pan_and_scan`
  with `Gemma3Processor`'s defaults). Its mark becomes Gemma 3's text for them, "Here is the original
  image <image> and here are some crops to help you see better <image> <image>"; an image too square or
  too small for crops stays as it is. Returns the messages and the images, crops after their image."""
  Image, crop = pil(), _pan_and_scan_crops()
  out_images, phrases = [], []
  for i, data in enumerate(images):
    chw = np.asarray(decode(data, f"{where}[{i}]")).transpose(2, 0, 1)
    crops = [encode_png(Image.fromarray(np.ascontiguousarray(c.transpose(1, 2, 0)))) for c in crop(chw)]
    out_images += [data] + crops
    phrases.append(IMAGE_MARK if not crops else "Here is the original image " + IMAGE_MARK
                   + " and here are some crops to help you see better " + " ".join([IMAGE_MARK] * len(crops)))
  phrases = iter(phrases)
  out_messages = []
  for m in messages:
    parts = str(m.get("content", "")).split(IMAGE_MARK)
    content = parts[0] + "".join(next(phrases) + part for part in parts[1:])
    out_messages.append(dict(m, content=content))
  return tuple(out_messages), tuple(out_images)


@functools.cache
def _pan_and_scan_crops():
  """[C, H, W] -> its crops: transformers' rule with Gemma3Processor's defaults (made once, not per row)."""
  from transformers import Gemma3ImageProcessorPil, Gemma3Processor
  kw = {k: v for k, v in Gemma3Processor.images_kwargs.items() if k.startswith("pan_and_scan_")}
  return functools.partial(Gemma3ImageProcessorPil().pan_and_scan, **kw)


def count_marks(messages: Sequence[dict]) -> int:
  return sum(str(m.get("content", "")).count(IMAGE_MARK) for m in messages)


def check_marks(messages: Sequence[dict], num_images: int, where: str) -> None:
  marks = count_marks(messages)
  if marks != num_images:
    raise DataError(f"{where}: the prompt has {marks} {IMAGE_MARK} placeholder(s) but the row has {num_images} "
                    "image(s) (field 'images')")


def encode_png(img) -> bytes:
  """A PIL image as PNG bytes (what a drawn example holds)."""
  out = io.BytesIO()
  img.save(out, format="PNG")
  return out.getvalue()


_PROCESSORS: dict[tuple, object] = {}
QWEN_MIN_PIXELS = 56 * 56  # transformers' Qwen2-VL processor's default floor on an image's pixels


def pixels(vcfg, images: Sequence[bytes], num_images: int) -> np.ndarray:
  """[num_images, C, S, S] fp32: `images` through the model's image processor (resized to S =
  `vcfg.image_size`, rescaled, normalised), then zeros up to `num_images` (a prompt with fewer images;
  their vectors are never placed). Qwen2.5-VL with `native_resolution`: each image at its own `grid`, its
  patches in the first of the canvas's patch slots (`qwen_vision.patches`)."""
  if len(images) > num_images:
    raise DataError(f"a prompt has {len(images)} images, more than the {num_images} this batch holds")
  out = np.zeros((num_images, vcfg.num_channels, vcfg.image_size, vcfg.image_size), np.float32)
  if images:
    decoded = [decode(b) for b in images]
    out[:len(images)] = (_qwen_pixels(vcfg, decoded) if vcfg.kind == "qwen2_5_vl" else
                         _processor(vcfg)(images=decoded, return_tensors="np")["pixel_values"])
  return out


def grid(vcfg, data: bytes, where: str = "image") -> tuple[int, int]:
  """(h, w) patches of one image as the tower sees it: transformers' `smart_resize` of its size (a
  multiple of patch x merge a side, QWEN_MIN_PIXELS to S^2 pixels, the aspect ratio kept) with
  `native_resolution`; else S x S. A DataError naming `where` if it fits in no S^2 pixels."""
  side = vcfg.image_size // vcfg.patch_size
  if not vcfg.native_resolution:
    return side, side
  from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
  with pil().open(io.BytesIO(data)) as img:  # The header alone.
    width, height = img.size
  S, f = vcfg.image_size, vcfg.patch_size * vcfg.merge_size
  try:
    h, w = smart_resize(height, width, factor=f, min_pixels=min(QWEN_MIN_PIXELS, S * S), max_pixels=S * S)
  except ValueError as e:
    raise DataError(f"{where}: a {width} x {height} image: {e}") from None
  if h * w > S * S:
    raise DataError(f"{where}: a {width} x {height} image becomes {w} x {h} pixels (multiples of {f}), more than "
                    f"model.vision.image_size^2 = {S}^2: too thin for this size")
  return h // vcfg.patch_size, w // vcfg.patch_size


def batch_grids(vcfg, image_lists: Sequence[Sequence[bytes]], num_images: int = 0) -> np.ndarray:
  """[Q, I, 2] int32: each prompt's images' `grid`, (0, 0) in the slots past them (`batch_pixels`'s I)."""
  I = num_images or max(1, max(map(len, image_lists)))
  out = np.zeros((len(image_lists), I, 2), np.int32)
  for q, ims in enumerate(image_lists):
    for i, data in enumerate(ims):
      out[q, i] = grid(vcfg, data)
  return out


def tokens_per_image(vcfg, grid_hw: tuple[int, int]) -> int:
  """The placeholders an image of `grid` (h, w) patches takes: M of Gemma 3, (h/m)(w/m) of Qwen2.5-VL."""
  return vcfg.tokens_per_image if vcfg.kind != "qwen2_5_vl" else grid_hw[0] * grid_hw[1] // vcfg.merge_size ** 2


def placeholders(vcfg, images: Sequence[bytes]) -> int:
  """The placeholders a prompt's `images` take in all (`tokens_per_image` of each one's `grid`)."""
  return sum(tokens_per_image(vcfg, grid(vcfg, data, f"image {i}")) for i, data in enumerate(images))


def _processor(vcfg, min_pixels: int = 0):
  """The model's image processor: for S x S images, or (Qwen2.5-VL) for `min_pixels` to S^2 pixels."""
  key = (vcfg.kind, vcfg.image_size, min_pixels)
  if key not in _PROCESSORS:
    S = vcfg.image_size
    if vcfg.kind == "qwen2_5_vl":
      from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
      _PROCESSORS[key] = Qwen2VLImageProcessorPil(min_pixels=min_pixels or S * S, max_pixels=S * S,
                                                  patch_size=vcfg.patch_size, merge_size=vcfg.merge_size,
                                                  temporal_patch_size=vcfg.temporal_patch_size)
    else:
      from transformers import Gemma3ImageProcessorPil
      _PROCESSORS[key] = Gemma3ImageProcessorPil(size={"height": S, "width": S})
  return _PROCESSORS[key]


def _qwen_pixels(vcfg, decoded: Sequence) -> np.ndarray:
  """[I, C, S, S]: Qwen2.5-VL's processor on each image, its flat patches (frame 0) put in the canvas's
  first patch slots, which `qwen_vision.patches` cuts again, exactly. Without `native_resolution` each
  image is resized to S x S first (the processor's own resize keeps the aspect ratio, so the token count):
  its patches fill every slot, in place."""
  S, p, m, C, T = vcfg.image_size, vcfg.patch_size, vcfg.merge_size, vcfg.num_channels, vcfg.temporal_patch_size
  Image = pil()
  b = S // (p * m)
  slots = np.zeros((len(decoded), b * b * m * m, C, p, p), np.float32)
  for i, img in enumerate(decoded):
    if vcfg.native_resolution:
      out = _processor(vcfg, min(QWEN_MIN_PIXELS, S * S))(images=[img], return_tensors="np")
    else:
      out = _processor(vcfg)(images=[img if img.size == (S, S) else img.resize((S, S), Image.Resampling.BICUBIC)],
                             return_tensors="np")
    flat = out["pixel_values"]  # [h*w, C*T*p*p]
    slots[i, :len(flat)] = flat.reshape(len(flat), C, T, p, p)[:, :, 0]
  x = slots.reshape(len(decoded), b, b, m, m, C, p, p)
  return x.transpose(0, 5, 1, 3, 6, 2, 4, 7).reshape(len(decoded), C, S, S)


def batch_pixels(vcfg, image_lists: Sequence[Sequence[bytes]], num_images: int = 0) -> np.ndarray:
  """[Q, I, C, S, S] fp32: `pixels` of each prompt's images, I = `num_images` (0: the most a prompt has, >= 1)."""
  I = num_images or max(1, max(map(len, image_lists)))
  return np.stack([pixels(vcfg, ims, I) for ims in image_lists])


def expand_marks(text: str, tok, vcfg, images: Sequence[bytes] = ()) -> str:
  """`text` with each `IMAGE_MARK` written as the tokens the model reads for one image: begin, its
  placeholders (`tokens_per_image` of the image's `grid`; `images`: the marks' images, in order, which
  `native_resolution` needs) and end (the tokenizer's own strings for `vcfg`'s token ids, kept whole)."""
  if IMAGE_MARK not in text:
    return text
  boi, img, eoi = tok.convert_ids_to_tokens([vcfg.boi_token_id, vcfg.image_token_id, vcfg.eoi_token_id])
  if not vcfg.native_resolution:
    return text.replace(IMAGE_MARK, boi + img * vcfg.tokens_per_image + eoi)
  parts = text.split(IMAGE_MARK)
  if len(parts) - 1 != len(images):
    raise DataError(f"the prompt has {len(parts) - 1} {IMAGE_MARK} mark(s) for {len(images)} image(s)")
  counts = [tokens_per_image(vcfg, grid(vcfg, data, f"image {i}")) for i, data in enumerate(images)]
  return parts[0] + "".join(boi + img * n + eoi + part for n, part in zip(counts, parts[1:]))
