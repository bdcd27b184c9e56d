"""Qwen2.5-VL at native resolution (`VisionConfig.native_resolution`): images of different sizes and aspect
ratios keep the grid and the token count transformers' processor gives them, in one compiled tower,
against `Qwen2_5_VLForConditionalGeneration` (fp32, torch); the engine and every pass of the update place
them with their M-RoPE positions."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax import objectives, packing
from dapo_jax.data import images as images_lib
from dapo_jax.datatypes import RLBatch
from dapo_jax.errors import DataError
from dapo_jax.hf import convert as hf
from dapo_jax.model import vision
from dapo_jax.rollout import engine, sampling
from tests.qwen_vl_test import BOI, EOI, IMG, assert_close_on_real, drawn, make_hf_model, torch_logits
from tests.vision_test import assert_every_pass_scores_as_teacher_forced, assert_recorded_log_probs_are_teacher_forced

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

S = 112  # At most 112^2 pixels an image: 8 x 8 patches, 16 tokens; windows of 56 pixels: 2 x 2 tokens.
# (height, width) of row 0's images and row 1's: square, wide, tall, a thin strip, one too small (scaled up).
SIZES = (((112, 112), (56, 112)), ((100, 60), (30, 200), (20, 20)))
GRIDS = (((8, 8), (4, 8)), ((8, 4), (2, 14), (4, 4)))  # transformers' smart_resize of them, in patches


def native_model(path):
  m = make_hf_model(path, window_size=56)
  with open(f"{path}/config.json") as f:
    hf_cfg = json.load(f)
  hf_cfg["vision_config"].update(image_size=S, native_resolution=True)
  with open(f"{path}/config.json", "w") as f:
    json.dump(hf_cfg, f)
  return m


def rows():
  """Row 0: text, two images, text; row 1: left-padded, three images. Each image's placeholders its own count."""
  image = lambda hw: [BOI] + [IMG] * (hw[0] * hw[1] // 4) + [EOI]
  r0 = [5, 6] + image(GRIDS[0][0]) + [7, 8] + image(GRIDS[0][1]) + [9, 10, 11]
  r1 = [12] + image(GRIDS[1][0]) + [13] + image(GRIDS[1][1]) + image(GRIDS[1][2]) + [14, 15]
  T = max(len(r0), len(r1))
  tokens = np.array([[0] * (T - len(r)) + r for r in (r0, r1)])
  mask = np.array([[0] * (T - len(r)) + [1] * len(r) for r in (r0, r1)])
  return tokens, mask


def encoded():
  return [[images_lib.encode_png(im) for im in drawn(seed=b, sizes=sizes)] for b, sizes in enumerate(SIZES)]


def hf_inputs(imgs_per_row):
  """transformers' processor on the rows' images at native resolution: flat patches and grids [n, 3]."""
  from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
  flat = [images_lib.decode(b) for row in imgs_per_row for b in row]
  out = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=S * S)(images=flat, return_tensors="np")
  return out["pixel_values"], out["image_grid_thw"]


def our_features(cfg, params, imgs_per_row):
  pixels = images_lib.batch_pixels(cfg.vision, imgs_per_row, 3)
  grids = images_lib.batch_grids(cfg.vision, imgs_per_row, 3)
  return vision.image_features(cfg.vision, params["vision"], jnp.asarray(pixels), jnp.asarray(grids)), grids


def test_images_of_different_sizes_match_transformers(tmp_path):
  m = native_model(str(tmp_path / "hf"))
  cfg, params = hf.load(str(tmp_path / "hf"))
  assert cfg.vision.native_resolution and cfg.vision.tokens_per_image == 16
  imgs = encoded()
  flat, grid_thw = hf_inputs(imgs)
  feats, grids = our_features(cfg, params, imgs)
  assert grid_thw[:, 1:].tolist() == [list(g) for row in GRIDS for g in row]  # The processor's grids.
  assert [list(g) for row in grids for g in row if g.any()] == grid_thw[:, 1:].tolist()

  # The tower: each image's merged tokens, laid end to end in its row, equal transformers' (windows cut at
  # the edges, 2D positions of its own grid); the last channel is its image's tokens a row.
  with torch.no_grad():
    hf_feats = m.model.get_image_features(torch.tensor(flat), torch.tensor(grid_thw)).pooler_output
  hf_rows = [torch.cat(hf_feats[:2]).numpy(), torch.cat(hf_feats[2:]).numpy()]
  scale = max(np.abs(f).max() for f in hf_rows)
  for b, ref in enumerate(hf_rows):
    ours = np.asarray(feats[b, :len(ref)])
    np.testing.assert_allclose(ours[:, :-1], ref, atol=1e-5 * scale)
    cols = [g[1] // 2 for g in GRIDS[b] for _ in range(g[0] * g[1] // 4)]
    np.testing.assert_array_equal(ours[:, -1], cols)

  # The language model: logits on both rows equal transformers' (M-RoPE of each image's own rows and columns).
  tokens, mask = rows()
  ref = torch_logits(m, tokens, mask, flat, grid_thw)
  from dapo_jax.model import transformer as model
  ours = np.asarray(model.logits(cfg, params, jnp.asarray(tokens), jnp.asarray(mask), images_BMD=feats))
  assert_close_on_real(ours, ref, mask)
  # The shapes matter: the same vectors read as S x S images' (8 tokens a row), the logits move.
  square = feats.at[..., -1].set(4.0)
  moved = np.asarray(model.logits(cfg, params, jnp.asarray(tokens), jnp.asarray(mask), images_BMD=square))
  real = mask.astype(bool)
  assert np.abs(np.delete(moved - ref, IMG, -1)[real]).max() > 1e-3 * np.abs(ref).max()

  # An export keeps the switch; transformers loads it and agrees.
  hf.save(str(tmp_path / "out"), cfg, params)
  assert hf.load_config(str(tmp_path / "out")) == cfg
  m2 = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
      str(tmp_path / "out"), dtype=torch.float32, attn_implementation="eager").eval()
  np.testing.assert_allclose(torch_logits(m2, tokens, mask, flat, grid_thw)[real], ref[real], atol=1e-5)


def test_the_engine_and_every_pass_of_the_update_place_them(tmp_path):
  m = native_model(str(tmp_path / "hf"))
  cfg, params = hf.load(str(tmp_path / "hf"))
  tokens, mask = rows()
  imgs = encoded()
  feats, _ = our_features(cfg, params, imgs)
  C, P, G = 5, tokens.shape[1], 3
  # Greedy decoding equals transformers' generate (its later positions continue from the prompt's 3D ones).
  greedy = sampling.generate(cfg, sampling.SamplerConfig(max_new_tokens=C, temperature=0.0), params, tokens, mask,
                             jax.random.key(0), images_QMD=feats)
  flat, grid_thw = hf_inputs(imgs[1:])
  real = mask[1].astype(bool)
  ids = tokens[1][real][None]
  with torch.no_grad():
    out = m.generate(input_ids=torch.tensor(ids), pixel_values=torch.tensor(flat),
                     image_grid_thw=torch.tensor(grid_thw),
                     mm_token_type_ids=torch.tensor((ids == IMG).astype(np.int64)), max_new_tokens=C,
                     do_sample=False, min_new_tokens=C)
  np.testing.assert_array_equal(np.asarray(greedy.tokens_BC[1]), out[0, real.sum():].numpy())
  # The engine's recorded log-probs are those of a teacher-forced forward of prompt + images + completion.
  for kv_layout in ("dense", "paged"):
    eng = engine.Engine(cfg, sampling.SamplerConfig(max_new_tokens=C, temperature=1.0, eos_ids=(1,)), slots=4,
                        prompt_len=P, kv_layout=kv_layout, page_size=4)
    s, stats = eng.generate(params, tokens, mask, G, jax.random.key(2), images_QMD=feats)
    assert stats["prefilled_prompts"] == 2
    assert_recorded_log_probs_are_teacher_forced(cfg, params, tokens, mask, jnp.repeat(feats, G, 0), s)
  # The update's passes, the rows and the shared-prompt layouts.
  for group_size, logits_chunk in ((0, 0), (3, 4)):
    assert_every_pass_scores_as_teacher_forced(dataclasses.replace(cfg, logits_chunk=logits_chunk), params, tokens,
                                               mask, feats, group_size, G=G)

  # Packed micro-batches carry each row's M-RoPE positions of its own images' shapes: the padded loss.
  rng = np.random.default_rng(0)
  B = 2 * G
  s = sampling.generate(cfg, sampling.SamplerConfig(max_new_tokens=C, temperature=1.0, eos_ids=(1,)), params, tokens,
                        mask, jax.random.key(4), num_samples=G, images_QMD=feats)
  cmask = np.asarray(s.mask_BC)
  batch = RLBatch(tokens_BT=np.concatenate([np.repeat(tokens, G, 0), np.asarray(s.tokens_BC)], 1).astype(np.int32),
                  mask_BT=np.concatenate([np.repeat(mask, G, 0), cmask], 1).astype(bool), loss_mask_BC=cmask,
                  old_logp_BC=rng.normal(-4, 0.3, (B, C)).astype(np.float32),
                  adv_B=rng.normal(size=B).astype(np.float32),
                  ref_logp_BC=np.zeros((B, C), np.float32), images_BMD=np.repeat(np.asarray(feats), G, 0))
  obj = objectives.policy_gradient(cfg, objectives.PGConfig())
  parts = packing.packed_microbatches(batch, max_tokens=2 * (P + C), vision=cfg.vision)
  step = jax.jit(jax.value_and_grad(obj.loss, has_aux=True))
  (loss, _), grads = step(params, batch, obj.counts(batch))
  counts = jax.tree.map(lambda *c: sum(c), *[obj.counts(p) for p in parts])
  (loss_p, _), grads_p = jax.tree.map(lambda *x: sum(x), *[step(params, p, counts) for p in parts])
  np.testing.assert_allclose(loss_p, loss, rtol=1e-5, atol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6), grads, grads_p)


def test_marks_expand_to_each_images_tokens_and_bad_images_name_themselves(tmp_path):
  from dapo_jax.data import tokenizer as tokenizer_lib
  from dapo_jax.model.config import VisionConfig
  tok = tokenizer_lib.train_bpe(str(tmp_path / "tok"), ["how many red shapes"] * 20, vocab_size=300,
                                extra_special=images_lib.QWEN_IMAGE_TOKENS)
  boi, img, eoi = images_lib.image_token_ids(tok, "model.vision", "qwen2_5_vl")
  v = VisionConfig(kind="qwen2_5_vl", image_size=S, patch_size=14, embed_dim=32, num_heads=2, tokens_per_image=16,
                   window_size=56, image_token_id=img, boi_token_id=boi, eoi_token_id=eoi, native_resolution=True)
  imgs = encoded()[1]
  ids = tok(images_lib.expand_marks("a <image> b <image><image>", tok, v, imgs), add_special_tokens=False)["input_ids"]
  runs = [len(r) for r in "".join("x" if t == img else " " for t in ids).split()]
  assert runs == [8, 7, 4] and ids.count(boi) == ids.count(eoi) == 3
  square = dataclasses.replace(v, native_resolution=False)  # Without the switch: every image S x S, 16 tokens.
  assert ids.count(img) != tok(images_lib.expand_marks("a <image> b <image><image>", tok, square),
                               add_special_tokens=False)["input_ids"].count(img) == 48
  with pytest.raises(DataError, match="image 1: a 2 x 300 image becomes"):  # Too thin for S^2 pixels.
    images_lib.expand_marks("<image><image>", tok, v, [imgs[0], images_lib.encode_png(drawn(sizes=((300, 2),))[0])])
  with pytest.raises(DataError, match="2 <image> mark"):
    images_lib.expand_marks("<image><image>", tok, v, imgs[:1])


def tiny_native_qwen(path: str):
  """(tokenizer with Qwen2.5-VL's image tokens, a tiny Qwen2.5-VL at native resolution: S = 8, patches of 2)."""
  from dapo_jax import testing
  from dapo_jax.data import tokenizer as tokenizer_lib
  from dapo_jax.model.config import ModelConfig, VisionConfig
  tok = tokenizer_lib.train_bpe(path, testing.corpus(), vocab_size=300, extra_special=images_lib.QWEN_IMAGE_TOKENS)
  boi, img, eoi = images_lib.image_token_ids(tok, "test", "qwen2_5_vl")
  vcfg = VisionConfig(kind="qwen2_5_vl", image_size=8, patch_size=2, embed_dim=16, mlp_dim=24, num_layers=2,
                      num_heads=2, tokens_per_image=4, window_size=4, full_attention_layers=(1,), image_token_id=img,
                      boi_token_id=boi, eoi_token_id=eoi, native_resolution=True)
  return tok, ModelConfig(vocab_size=len(tok), embed_dim=32, mlp_dim=48, num_layers=2, num_heads=4, num_kv_heads=2,
                          head_dim=8, qkv_bias=True, arch="qwen2", vision=vcfg, mrope_section=(2, 1, 1))


def test_a_rollout_renders_and_encodes_each_image_at_its_own_size(tmp_path):
  """`Rollout`: a prompt's marks become each image's own placeholders, and its vectors are the tower's on
  the image at its grid, laid end to end; a prompt that loses some of them to max_prompt_len is one line."""
  from dapo_jax import sharding
  from dapo_jax.data import prompts as data_lib
  from dapo_jax.model import transformer as model
  from dapo_jax.rollout import rollout as rollout_lib
  tok, cfg = tiny_native_qwen(str(tmp_path))
  vcfg, img = cfg.vision, cfg.vision.image_token_id
  params = model.init_params(cfg, jax.random.key(0))
  pics = [images_lib.encode_png(im) for im in drawn(sizes=((12, 20), (8, 8), (30, 6)))]  # Wide, square, tall.
  ex = [data_lib.Example(messages=({"role": "user", "content": "<image> how many? <image>"},), ground_truth="1",
                         images=tuple(pics[:2])),
        data_lib.Example(messages=({"role": "user", "content": "and <image>"},), ground_truth="2", index=1,
                         images=tuple(pics[2:]))]
  counts = [images_lib.tokens_per_image(vcfg, images_lib.grid(vcfg, b)) for b in pics]
  assert counts == [2, 4, 4]
  mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
  sc = sampling.SamplerConfig(max_new_tokens=4)
  r = rollout_lib.Rollout(tok, cfg, mesh, rollout_lib.RolloutConfig(max_prompt_len=64, max_images=2), sc)
  tokens, _ = r.encode(ex)
  assert [int((t == img).sum()) for t in tokens] == [6, 4]
  vectors = np.asarray(r.image_vectors(params, ex))
  for q, (lo, hi) in enumerate(((0, 2), (2, 3))):
    one = [vision.image_features(vcfg, params["vision"], jnp.asarray(images_lib.batch_pixels(vcfg, [[b]], 1)),
                                 jnp.asarray(images_lib.batch_grids(vcfg, [[b]], 1)))[0] for b in pics[lo:hi]]
    want = np.concatenate([np.asarray(o[:n]) for o, n in zip(one, counts[lo:hi])])
    np.testing.assert_allclose(vectors[q, :len(want)], want, atol=1e-6)
  short = rollout_lib.Rollout(tok, cfg, mesh, rollout_lib.RolloutConfig(max_prompt_len=8, max_images=2), sc)
  with pytest.raises(DataError, match=r"example 0 \(math_dapo\): its encoded prompt holds \d image placeholders, "
                                     "expected 6"):
    short.encode(ex[:1])


def test_vectors_saved_before_they_carried_their_shape_read_back_as_square_images():
  """Carried groups from an older checkpoint (D channels): `vision.with_shapes` gives them S x S images' shape,
  so M-RoPE places them as it did when they were sampled; Gemma 3's vectors and new ones stay as they are."""
  from dapo_jax.model import mrope
  from dapo_jax.model.config import VisionConfig
  vcfg = VisionConfig(kind="qwen2_5_vl", image_size=S, patch_size=14, embed_dim=32, num_heads=2, tokens_per_image=16,
                      window_size=56, image_token_id=IMG)
  old = np.random.default_rng(0).normal(size=(2, 16, 64)).astype(np.float32)
  new = vision.with_shapes(vcfg, 64, old)
  assert new.shape == (2, 16, 65) and (new[..., :64] == old).all() and (new[..., -1] == 4).all()
  assert vision.with_shapes(vcfg, 64, new) is new
  assert vision.with_shapes(dataclasses.replace(vcfg, kind="siglip", tokens_per_image=16), 64, old) is old
  tokens = np.array([[5] + [IMG] * 16 + [6, 7]])
  pos = np.arange(tokens.shape[1])[None]
  np.testing.assert_array_equal(mrope.mrope_positions(vcfg, pos, tokens, jnp.asarray(new[:1])),
                                mrope.mrope_positions(vcfg, pos, tokens))
