"""Images in dataset rows (verl's `images` column), their checks, their places in a prompt, and the drawn
counting task, against hand-made files and a naive count of the drawn pixels."""
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from dapo_jax.data import count_shapes, images
from dapo_jax.data import prompts as data_lib
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.model.config import VisionConfig


def png(colour=(255, 0, 0), size=(10, 6)) -> bytes:
  out = io.BytesIO()
  Image.new("RGB", size, colour).save(out, format="PNG")
  return out.getvalue()


def write_rows(path, rows):
  with open(path, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")


def row(content, imgs, gt="3"):
  return {"prompt": [{"role": "user", "content": content}], "reward_model": {"ground_truth": gt}, "images": imgs}


def test_rows_name_their_images_by_path_or_object(tmp_path):
  (tmp_path / "a.png").write_bytes(png((255, 0, 0)))
  (tmp_path / "b.png").write_bytes(png((0, 0, 255)))
  both = ["a.png", {"path": str(tmp_path / "b.png")}]
  write_rows(tmp_path / "d.jsonl", [row("<image> then <image>: how many?", both), row("no picture", [])])
  exs = data_lib.load_file(str(tmp_path / "d.jsonl"))
  assert exs[0].images == (png((255, 0, 0)), png((0, 0, 255))) and exs[1].images == ()
  assert np.asarray(images.decode(exs[0].images[1]))[0, 0].tolist() == [0, 0, 255]


@pytest.mark.parametrize("content,imgs,message", [
    ("<image> what?", ["missing.png"], r"d.jsonl: row 0: images\[0\]: cannot read"),
    ("<image> what?", [{"bytes": "bm90IGFuIGltYWdl"}], r"row 0: images\[0\]: not a readable image"),
    ("<image> what?", ["broken.png"], r"row 0: images\[0\]: not a readable image"),
    ("<image> and <image>?", ["ok.png"], r"row 0: the prompt has 2 <image> placeholder\(s\) but the row has 1 image"),
    ("what?", ["ok.png"], r"row 0: the prompt has 0 <image> placeholder\(s\) but the row has 1 image"),
    ("<image>", "ok.png", r"row 0: field 'images' must be a list"),
])
def test_a_bad_image_or_placeholder_count_fails_naming_the_row(tmp_path, content, imgs, message):
  (tmp_path / "ok.png").write_bytes(png())
  (tmp_path / "broken.png").write_bytes(png()[:20])  # A cut file.
  write_rows(tmp_path / "d.jsonl", [row(content, imgs)])
  with pytest.raises(data_lib.DataError, match=message):
    data_lib.load_file(str(tmp_path / "d.jsonl"))


def test_marks_expand_to_the_tokenizers_image_tokens(tmp_path):
  tok = tokenizer_lib.train_bpe(str(tmp_path / "tok"), ["how many red shapes"] * 20, vocab_size=300,
                                extra_special=images.IMAGE_TOKENS)
  boi, img, eoi = images.image_token_ids(tok, "model.vision")
  v = VisionConfig(image_size=8, patch_size=2, tokens_per_image=4, image_token_id=img, boi_token_id=boi,
                   eoi_token_id=eoi)
  text = images.expand_marks("a <image> b <image>", tok, v)
  ids = tok(text, add_special_tokens=False)["input_ids"]
  assert ids.count(img) == 8 and ids.count(boi) == 2 and ids.count(eoi) == 2
  first = ids.index(boi)
  assert ids[first:first + 6] == [boi, img, img, img, img, eoi]
  plain = tokenizer_lib.train_bpe(str(tmp_path / "plain"), ["how many"] * 20, vocab_size=300)
  with pytest.raises(ValueError, match="model.vision: the tokenizer has no"):
    images.image_token_ids(plain, "model.vision")


def test_pixels_are_the_processors_and_pad_with_zeros():
  v = VisionConfig(image_size=8, patch_size=2, tokens_per_image=4)
  out = images.pixels(v, [png((255, 0, 0), (20, 10))], num_images=2)
  assert out.shape == (2, 3, 8, 8)
  # Resized to 8 x 8, rescaled to [0, 1] and normalised by mean 0.5, std 0.5: red is (1, -1, -1).
  np.testing.assert_allclose(out[0, :, 3, 3], [1.0, -1.0, -1.0], atol=1e-6)
  assert not out[1].any()


def red_blobs(img) -> int:
  """Connected groups of red pixels (4-neighbour flood fill): a naive count of the red shapes."""
  a = np.asarray(img).astype(int)
  red = (a[..., 0] > 150) & (a[..., 1] < 100) & (a[..., 2] < 100)
  seen, n = np.zeros_like(red), 0
  for y, x in zip(*np.nonzero(red)):
    if seen[y, x]:
      continue
    n += 1
    stack = [(y, x)]
    while stack:
      i, j = stack.pop()
      if 0 <= i < red.shape[0] and 0 <= j < red.shape[1] and red[i, j] and not seen[i, j]:
        seen[i, j] = True
        stack += [(i + 1, j), (i - 1, j), (i, j + 1), (i, j - 1)]
  return n


def test_pan_and_scan_gives_gemma3s_crops_and_text(tmp_path):
  """`data.pan_and_scan`: a tall image's crops follow it, and their pixels are those of transformers'
  processor with `do_pan_and_scan`; its mark becomes the text of transformers' Gemma3Processor; a square
  image, and one whose crops would be too small, stay as they are."""
  import types
  transformers = pytest.importorskip("transformers")
  rng = np.random.default_rng(0)
  pics = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in ((300, 300), (900, 300),
                                                                                        (250, 600))]
  encoded = [images.encode_png(p) for p in pics]
  for i, data in enumerate(encoded):
    (tmp_path / f"{i}.png").write_bytes(data)
  write_rows(tmp_path / "d.jsonl", [row("A <image>, a tall <image> and a wide <image>: how many?",
                                        ["0.png", "1.png", "2.png"])])
  ex, = data_lib.load_file(str(tmp_path / "d.jsonl"), pan_and_scan=True)
  kw = {k: v for k, v in transformers.Gemma3Processor.images_kwargs.items() if k.startswith("pan_and_scan")}
  ref = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})(
      images=pics, do_pan_and_scan=True, return_tensors="np", **kw)
  assert ref["num_crops"].tolist() == [0, 3, 0] and len(ex.images) == 6
  vcfg = VisionConfig(image_size=32, patch_size=4, tokens_per_image=4)
  np.testing.assert_array_equal(images.pixels(vcfg, ex.images, 6), ref["pixel_values"])
  seq = types.SimpleNamespace(full_image_sequence=images.IMAGE_MARK)
  text = [transformers.Gemma3Processor.replace_image_token(seq, ref, i) for i in range(3)]
  assert ex.messages[0]["content"] == f"A {text[0]}, a tall {text[1]} and a wide {text[2]}: how many?"
  assert images.count_marks(ex.messages) == 6
  plain, = data_lib.load_file(str(tmp_path / "d.jsonl"))
  assert plain.images == tuple(encoded) and images.count_marks(plain.messages) == 3


def test_drawn_pictures_hold_as_many_red_shapes_as_their_answer():
  exs = count_shapes.examples(40, "train", seed=3, max_count=4)
  answers = [int(ex.ground_truth) for ex in exs]
  assert set(answers) == {1, 2, 3, 4}
  for ex in exs:
    assert images.count_marks(ex.messages) == len(ex.images) == 1
    assert red_blobs(images.decode(ex.images[0])) == int(ex.ground_truth)
  held = count_shapes.examples(40, "heldout", seed=3, max_count=4)
  assert not {ex.images[0] for ex in held} & {ex.images[0] for ex in exs}
  blank = count_shapes.examples(5, "train", seed=3, blank=True)
  assert [ex.ground_truth for ex in blank] == [ex.ground_truth for ex in exs[:5]]
  assert all(red_blobs(images.decode(ex.images[0])) == 0 for ex in blank)


@pytest.mark.slow
def test_a_vision_language_run_places_its_images_in_rollout_update_and_evaluation(tmp_path):
  """The recipe shrunk: a short SFT with images, two rollout steps that update, evaluation, export."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import dapo_jax
  workdir = str(tmp_path / "run")
  overrides = {"train.num_steps": 2, "sft.steps": 20, "model.init": "sft",
               "reward.fn": "dapo_jax.testing:length_reward", "reward.workers": 1}
  with dapo_jax.Run("configs/vlm_count_shapes.py:runlocal", workdir=workdir, **overrides) as run:
    run.train()
    rollout = run._loop.rollout
    assert run.model_config.vision is not None
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      records = [json.loads(line) for line in f]
    updates = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in updates] == [1, 2]
    assert all(np.isfinite(r["actor/loss"]) and r["actor/grad_norm"] > 0 for r in updates)
    assert rollout.vision_prompts > 0
    assert "val/acc/greedy" in run.evaluate()
    out = run.export(str(tmp_path / "exported"))
  m = transformers.AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
  assert type(m).__name__ == "Gemma3ForConditionalGeneration"
  # launch.sample reads a picture for a typed question, and a missing picture is one line.
  pic = tmp_path / "pic.png"
  pic.write_bytes(count_shapes.examples(1, "heldout")[0].images[0])
  root = os.path.join(os.path.dirname(__file__), "..")
  cmd = [sys.executable, "-m", "launch.sample", f"--workdir={workdir}",
         "--prompt=How many red shapes are in the image?", f"--image={pic}", "--temperature=0", "--ground_truth=3"]
  done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  assert "prompt 1/1: '<image>\\nHow many red shapes" in done.stdout and "accuracy" in done.stdout
  done = subprocess.run(cmd[:-3] + ["--image=nope.png"], cwd=root, capture_output=True, text=True, timeout=300)
  assert done.returncode == 1 and "--image=nope.png: cannot read" in done.stderr.strip().splitlines()[-1]


def test_the_warm_start_trains_the_tower_only_when_asked(tmp_path):
  """`sft.train_vision`: the tower runs on each batch's pixels inside the loss, and its weights move;
  without it they stay as initialised and the loss reads vectors computed once."""
  import jax

  from dapo_jax import sharding
  from dapo_jax.model import transformer as model_lib
  from dapo_jax.model.config import ModelConfig
  from dapo_jax.pipelines import sft
  tok = tokenizer_lib.train_bpe(str(tmp_path / "tok"), [ex.messages[0]["content"] + " Answer: 3" for ex in
                                                          count_shapes.examples(50, "train")], vocab_size=300,
                                extra_special=images.IMAGE_TOKENS)
  boi, img, eoi = images.image_token_ids(tok, "model.vision")
  cfg = ModelConfig(vocab_size=320, embed_dim=32, mlp_dim=48, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                    arch="gemma3", qk_norm=True, vision=VisionConfig(
                        image_size=16, patch_size=4, embed_dim=16, mlp_dim=16, num_layers=1, num_heads=2,
                        tokens_per_image=4, image_token_id=img, boi_token_id=boi, eoi_token_id=eoi))
  init = jax.device_get(model_lib.init_params(cfg, jax.random.key(0)))
  exs = count_shapes.examples(64, "train")
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  for train_vision in (False, True):
    s = sft.SFTConfig(steps=3, batch_size=8, seq_len=64, lr=1e-2, warmup_steps=0, num_examples=64,
                      solution_style="direct", completion_only=True, train_vision=train_vision, ckpt_every=0)
    out = jax.device_get(sft.run(s, cfg, tok, exs, mesh, str(tmp_path / f"sft{train_vision}"),
                                 params=jax.tree.map(np.copy, init)))
    moved = [np.abs(a - b).max() > 0 for a, b in zip(jax.tree.leaves(out["vision"]), jax.tree.leaves(init["vision"]))]
    assert all(moved) if train_vision else not any(moved)
    assert np.abs(out["layers"]["wq_DNH"] - init["layers"]["wq_DNH"]).max() > 0


@pytest.mark.parametrize("engine", ["continuous", "static"])
def test_the_tower_runs_once_per_prompt_for_its_group_of_samples(tmp_path, engine):
  """`Rollout.generate` of Q pictures x G samples runs the vision tower on Q prompts (counted), not Q x G."""
  import jax

  from dapo_jax import sharding
  from dapo_jax.model import transformer as model_lib
  from dapo_jax.model.config import ModelConfig
  from dapo_jax.rollout import rollout as rollout_lib
  from dapo_jax.rollout import sampling
  exs = count_shapes.examples(3, "train")
  tok = tokenizer_lib.train_bpe(str(tmp_path / "tok"), [ex.messages[0]["content"] + " Answer: 3" for ex in exs] * 10,
                                vocab_size=300, extra_special=images.IMAGE_TOKENS)
  boi, img, eoi = images.image_token_ids(tok, "model.vision")
  cfg = ModelConfig(vocab_size=320, embed_dim=32, mlp_dim=48, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                    arch="gemma3", qk_norm=True, vision=VisionConfig(
                        image_size=16, patch_size=4, embed_dim=16, mlp_dim=16, num_layers=1, num_heads=2,
                        tokens_per_image=4, image_token_id=img, boi_token_id=boi, eoi_token_id=eoi))
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  r = rollout_lib.Rollout(tok, cfg, mesh, rollout_lib.RolloutConfig(max_prompt_len=96, engine=engine),
                          sampling.SamplerConfig(max_new_tokens=4, eos_ids=(tok.eos_token_id,)))
  samples = r.generate(model_lib.init_params(cfg, jax.random.key(0)), exs, 4, jax.random.key(1))
  assert samples.tokens_BC.shape[0] == 12 and r.vision_prompts == 3
