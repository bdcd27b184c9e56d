"""A task only the image answers: how many red shapes a drawn picture holds (CLEVR-count style).

Each picture is drawn with Pillow: `count` red shapes (1..max_count, uniform, so guessing scores
1 / max_count) and up to `distractors` shapes of other colours, squares or discs, each in its own cell
of a grid. The question is the same for every picture, so the text alone tells nothing. With
`blank=True` every picture is an empty canvas: the control that shows a model reads the image.
"""
from __future__ import annotations

import hashlib

import numpy as np

from dapo_jax.data import images as images_lib
from dapo_jax.data.prompts import Example, in_heldout

QUESTION = f"{images_lib.IMAGE_MARK}\nHow many red shapes are in the image? End with: Answer: <number>"
RED = (220, 30, 30)
DISTRACTOR_COLOURS = ((30, 80, 220), (30, 170, 60), (230, 200, 40))
GRID = 4  # cells a side: at most GRID^2 shapes


def draw(rng: np.random.Generator, count: int, distractors: int, size: int = 64):
  """A `size` x `size` RGB picture of `count` red shapes and `distractors` shapes of other colours."""
  from PIL import ImageDraw
  img = images_lib.pil().new("RGB", (size, size), (255, 255, 255))
  pen = ImageDraw.Draw(img)
  cell = size // GRID
  cells = rng.choice(GRID * GRID, size=count + distractors, replace=False)
  for i, c in enumerate(cells):
    colour = RED if i < count else DISTRACTOR_COLOURS[rng.integers(len(DISTRACTOR_COLOURS))]
    r = int(rng.integers(cell // 4, cell // 2))  # half-width: the shape stays inside its cell
    x, y = (c % GRID) * cell + cell // 2, (c // GRID) * cell + cell // 2
    box = (x - r, y - r, x + r, y + r)
    (pen.ellipse if rng.integers(2) else pen.rectangle)(box, fill=colour)
  return img


def examples(n: int, split: str = "train", *, seed: int = 0, max_count: int = 4, distractors: int = 2,
             size: int = 64, blank: bool = False, heldout_fraction: float = 0.1) -> list[Example]:
  """`n` pictures and questions of one split: a picture is held out by a hash of its pixels
  (`prompts.in_heldout`), so the splits never share one; held-out pictures are distinct."""
  if split not in ("train", "heldout"):
    raise ValueError(f"split={split!r}; expected 'train' or 'heldout'")
  if not 1 <= max_count or max_count + distractors > GRID * GRID:
    raise ValueError(f"max_count={max_count} + distractors={distractors} must be in 1..{GRID * GRID}")
  Image = images_lib.pil()
  rng = np.random.default_rng([seed, 0 if split == "train" else 1, 7])
  out, seen = [], set()
  while len(out) < n:
    count = int(rng.integers(1, max_count + 1))
    img = draw(rng, count, int(rng.integers(0, distractors + 1)), size)
    key = hashlib.sha256(img.tobytes()).hexdigest()
    if in_heldout(key, heldout_fraction) != (split == "heldout") or (split == "heldout" and key in seen):
      continue
    seen.add(key)
    if blank:
      img = Image.new("RGB", (size, size), (255, 255, 255))
    out.append(Example(messages=({"role": "user", "content": QUESTION},), ground_truth=str(count),
                       data_source="count_shapes", index=len(out), images=(images_lib.encode_png(img),)))
  return out
