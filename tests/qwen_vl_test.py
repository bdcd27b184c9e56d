"""Qwen2.5-VL with images against transformers' `Qwen2_5_VLForConditionalGeneration` (fp32, torch): the
windowed vision transformer and its merger, M-RoPE positions in the language model, HF import and an
export that transformers loads, the image processor's pixels, the sampler's and the engine's prefill."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from dapo_jax import objectives, train_step
from dapo_jax.data import images as images_lib
from dapo_jax.datatypes import RLBatch
from dapo_jax.hf import convert as hf
from dapo_jax.model import layers, qwen_vision, vision
from dapo_jax.model import transformer as model
from dapo_jax.model.config import ModelConfig, VisionConfig
from dapo_jax.rollout import engine, sampling
from tests.vision_test import assert_every_pass_scores_as_teacher_forced, assert_recorded_log_probs_are_teacher_forced

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V, IMG, BOI, EOI = 300, 290, 292, 293
S = 56  # pixels a side: 4 x 4 patches of 14, merged 2 x 2 into M = 4 tokens; windows of 28 pixels: 2 x 2 patches
M = 4


def make_hf_model(path, seed=0, window_size=28):
  torch.manual_seed(seed)
  text = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3]})
  vis = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=14,
             spatial_merge_size=2, temporal_patch_size=2, window_size=window_size, fullatt_block_indexes=[1])
  cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vis, image_token_id=IMG, video_token_id=291,
                                      vision_start_token_id=BOI, vision_end_token_id=EOI, tie_word_embeddings=False)
  cfg._attn_implementation = "eager"
  m = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
  with torch.no_grad():  # No parameter a no-op: random norms and biases.
    for name, p in m.named_parameters():
      if "norm" in name or "ln_q" in name or "bias" in name:
        p.copy_((1.0 if "weight" in name else 0.0) + 0.2 * torch.randn_like(p))
      else:  # Weights large enough that positions and windows move the logits well above rounding.
        p.mul_(4.0)
  m = m.float().eval()
  m.save_pretrained(path)
  with open(f"{path}/config.json") as f:  # The run's one image size (HF's config has none).
    hf_cfg = json.load(f)
  hf_cfg["vision_config"]["image_size"] = S
  with open(f"{path}/config.json", "w") as f:
    json.dump(hf_cfg, f)
  return m


def drawn(seed=0, sizes=((S, S), (S, S), (S, S))):
  rng = np.random.default_rng(seed)
  return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def hf_pixels(imgs):
  """transformers' processor on S x S images: flat patches [I*P, C*T*p*p] and grids [I, 3]."""
  from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
  out = Qwen2VLImageProcessorPil(min_pixels=S * S, max_pixels=S * S)(images=imgs, return_tensors="np")
  return out["pixel_values"], out["image_grid_thw"]


def image(n=1):
  return ([BOI] + [IMG] * M + [EOI]) * n


def batch():
  """Row 0: two images between text; row 1: left-padded, one image."""
  rows = [[5, 6] + image() + [7, 8] + image() + [9, 10, 11], [12] + image() + [13, 14, 15]]
  T = max(map(len, rows))
  tokens = np.array([[0] * (T - len(r)) + r for r in rows])
  mask = np.array([[0] * (T - len(r)) + [1] * len(r) for r in rows])
  return tokens, mask


def torch_logits(m, tokens, mask, flat, grid, position_ids=None):
  kw = {} if position_ids is None else {"position_ids": torch.tensor(position_ids)}
  with torch.no_grad():
    return m(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask), pixel_values=torch.tensor(flat),
             image_grid_thw=torch.tensor(grid), mm_token_type_ids=torch.tensor((tokens == IMG).astype(np.int64)),
             **kw).logits.numpy()


def assert_close_on_real(a, b, mask, rel=1e-4):
  """Logits equal on real positions, but for the image placeholder: ours never emits it."""
  real = mask.astype(bool)
  assert (a[..., IMG] == layers.NEVER).all()
  a, b = np.delete(a, IMG, axis=-1), np.delete(b, IMG, axis=-1)
  assert np.abs(a[real] - b[real]).max() <= rel * np.abs(b[real]).max()


def per_row_pixels(cfg, imgs):
  """[B=2, I=2, C, S, S]: row 0's two images, row 1's one (and a blank slot), through `images.pixels`."""
  encoded = [images_lib.encode_png(im) for im in imgs]
  return np.stack([images_lib.pixels(cfg.vision, encoded[:2], 2), images_lib.pixels(cfg.vision, encoded[2:], 2)])


def our_logits(cfg, params, tokens, mask, pixels_BICSS):
  feats = vision.image_features(cfg.vision, params["vision"], jnp.asarray(pixels_BICSS))
  return np.asarray(model.logits(cfg, params, jnp.asarray(tokens), jnp.asarray(mask), images_BMD=feats))


def test_the_processors_patches_are_the_towers(tmp_path):
  """`images.pixels` puts the processor's flat patches back in place; `qwen_vision.patches` cuts them again
  exactly. Images of other sizes are resized to S first: the processor then sees them at S x S."""
  vcfg = VisionConfig(kind="qwen2_5_vl", image_size=S, patch_size=14, embed_dim=32, mlp_dim=48, num_layers=1,
                      num_heads=2, tokens_per_image=M, window_size=28)
  imgs = drawn(sizes=((S, S), (40, 90), (120, 70)))
  ours = images_lib.pixels(vcfg, [images_lib.encode_png(im) for im in imgs], 3)
  resized = [im.resize((S, S), Image.Resampling.BICUBIC) for im in imgs]
  flat, grid = hf_pixels(resized)
  assert (grid == [1, 4, 4]).all()
  np.testing.assert_array_equal(np.asarray(qwen_vision.patches(vcfg, jnp.asarray(ours))).reshape(flat.shape), flat)


def test_images_in_prompts_match_transformers(tmp_path):
  m = make_hf_model(str(tmp_path / "hf"))
  cfg, params = hf.load(str(tmp_path / "hf"))
  assert cfg.vision.kind == "qwen2_5_vl" and cfg.vision.tokens_per_image == M and cfg.mrope_section == (2, 3, 3)
  assert cfg.vision.full_attention_layers == (1,) and cfg.arch == "qwen2"
  tokens, mask = batch()
  imgs = drawn()
  pixels = per_row_pixels(cfg, imgs)
  flat, grid = hf_pixels(imgs)
  ref = torch_logits(m, tokens, mask, flat, grid)
  ours = our_logits(cfg, params, tokens, mask, pixels)
  assert_close_on_real(ours, ref, mask)

  # The tower alone: the merged tokens equal transformers' (windows, 2D rotary positions, merger).
  with torch.no_grad():
    hf_feats = torch.cat(m.model.get_image_features(torch.tensor(flat), torch.tensor(grid)).pooler_output).numpy()
  one_each = jnp.asarray(pixels[:, :2].reshape(4, 1, 3, S, S))
  feats = np.asarray(vision.image_features(cfg.vision, params["vision"], one_each))
  feats = feats.reshape(4, M, -1)[[0, 1, 2]].reshape(3 * M, -1)
  np.testing.assert_allclose(feats[:, :-1], hf_feats, atol=1e-5 * np.abs(hf_feats).max())
  assert (feats[:, -1] == S // 28).all()  # Each vector's last channel: its image's tokens a row.
  # Each part matters: the windows (all layers full), and the 3D positions (transformers with 1D ones).
  full = cfg.vision.__class__(**{**cfg.vision.__dict__, "full_attention_layers": (0, 1, 2)})
  no_windows = np.asarray(vision.image_features(full, params["vision"], jnp.asarray(pixels[:1, :1])))[0]
  assert np.abs(no_windows[:, :-1] - hf_feats[:M]).max() > 1e-3 * np.abs(hf_feats).max()
  flat_pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
  plain = torch_logits(m, tokens, mask, flat, grid, position_ids=flat_pos)
  real = mask.astype(bool)
  assert np.abs(np.delete(plain - ref, IMG, -1)[real]).max() > 1e-3 * np.abs(ref).max()

  # Our export: re-imported it is the same model; transformers loads it and agrees.
  hf.save(str(tmp_path / "out"), cfg, params)
  cfg2, params2 = hf.load(str(tmp_path / "out"))
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, params2, params)
  m2 = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
      str(tmp_path / "out"), dtype=torch.float32, attn_implementation="eager").eval()
  np.testing.assert_allclose(torch_logits(m2, tokens, mask, flat, grid)[real], ref[real], atol=1e-5)


def test_a_random_qwen_vl_model_exports_to_transformers(tmp_path):
  vcfg = VisionConfig(kind="qwen2_5_vl", image_size=S, patch_size=14, embed_dim=16, mlp_dim=24, num_layers=2,
                      num_heads=2, tokens_per_image=M, window_size=28, full_attention_layers=(1,),
                      image_token_id=IMG, boi_token_id=BOI, eoi_token_id=EOI)
  cfg = ModelConfig(vocab_size=V, embed_dim=32, mlp_dim=48, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                    qkv_bias=True, tie_embeddings=False, arch="qwen2", vision=vcfg, mrope_section=(2, 3, 3))
  params = model.init_params(cfg, jax.random.key(0))
  params = jax.tree.map(lambda a: a + 0.2 * jax.random.normal(jax.random.key(1), a.shape, a.dtype), params)
  hf.save(str(tmp_path / "out"), cfg, params)
  m = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
      str(tmp_path / "out"), dtype=torch.float32, attn_implementation="eager").eval()
  tokens, mask = np.array([[3, 4] + image(2) + [5]]), None
  mask = np.ones_like(tokens)
  imgs = drawn(sizes=((S, S), (S, S)))
  flat, grid = hf_pixels(imgs)
  pixels = images_lib.pixels(vcfg, [images_lib.encode_png(im) for im in imgs], 2)[None]
  assert_close_on_real(our_logits(cfg, params, tokens, mask, pixels), torch_logits(m, tokens, mask, flat, grid), mask)


def test_vision_config_checks_its_shapes():
  with pytest.raises(ValueError, match="tokens_per_image=5"):
    VisionConfig(kind="qwen2_5_vl", image_size=S, patch_size=14, tokens_per_image=5, embed_dim=32, num_heads=2)
  with pytest.raises(ValueError, match="image_size=42"):
    VisionConfig(kind="qwen2_5_vl", image_size=42, patch_size=14, tokens_per_image=1, embed_dim=32, num_heads=2)
  vcfg = VisionConfig(kind="qwen2_5_vl", image_size=S, patch_size=14, tokens_per_image=M, embed_dim=32, num_heads=2)
  with pytest.raises(ValueError, match="mrope_section"):
    ModelConfig(vocab_size=V, embed_dim=32, mlp_dim=48, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                qkv_bias=True, vision=vcfg)
  with pytest.raises(ValueError, match="arch 'qwen2'"):
    ModelConfig(vocab_size=V, embed_dim=32, mlp_dim=48, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                arch="llama", vision=vcfg, mrope_section=(2, 3, 3))


def test_the_sampler_and_the_engine_record_teacher_forced_log_probs_and_decode_as_transformers(tmp_path):
  m = make_hf_model(str(tmp_path / "hf"))
  cfg, params = hf.load(str(tmp_path / "hf"))
  tokens, mask = batch()
  imgs = drawn()
  pixels = per_row_pixels(cfg, imgs)
  C, P = 6, tokens.shape[1]
  images = vision.image_features(cfg.vision, params["vision"], jnp.asarray(pixels))
  # Greedy: transformers' own generate (its positions continue from the prompt's 3D ones) picks the same tokens.
  greedy = sampling.generate(cfg, sampling.SamplerConfig(max_new_tokens=C, temperature=0.0), params, tokens, mask,
                             jax.random.key(0), images_QMD=images)
  for b, n in ((0, 2), (1, 1)):
    real = mask[b].astype(bool)
    flat, grid = hf_pixels(imgs[:2] if b == 0 else imgs[2:])
    ids = tokens[b][real][None]
    with torch.no_grad():
      out = m.generate(input_ids=torch.tensor(ids), pixel_values=torch.tensor(flat), image_grid_thw=torch.tensor(grid),
                       mm_token_type_ids=torch.tensor((ids == IMG).astype(np.int64)), max_new_tokens=C,
                       do_sample=False, min_new_tokens=C)
    np.testing.assert_array_equal(np.asarray(greedy.tokens_BC[b]), out[0, real.sum():].numpy())

  # The engine (dense and paged caches, one prefill per group): each recorded log-prob is the
  # teacher-forced one of prompt + images + completion.
  G = 3
  for kv_layout in ("dense", "paged"):
    eng = engine.Engine(cfg, sampling.SamplerConfig(max_new_tokens=C, temperature=1.0, eos_ids=(1,)), slots=4,
                        prompt_len=P, kv_layout=kv_layout, page_size=4)
    s, stats = eng.generate(params, tokens, mask, G, jax.random.key(2), images_QMD=images)
    assert stats["prefilled_prompts"] == 2 and stats["samples"] == 2 * G
    feats = vision.image_features(cfg.vision, params["vision"], jnp.asarray(np.repeat(pixels, G, 0)))
    assert_recorded_log_probs_are_teacher_forced(cfg, params, tokens, mask, feats, s)


@pytest.mark.parametrize("group_size,logits_chunk", [(0, 0), (3, 4)])
def test_the_update_scores_completions_with_the_prompts_images(tmp_path, group_size, logits_chunk):
  """Every pass that scores a token places the images and the prompts' M-RoPE positions: its log-probs equal
  a teacher-forced forward of prompt + images + completion, in the rows layout and the shared-prompt
  layout (the completions a segment of their own) with chunked logits, through length-bucketed micro-batches."""
  make_hf_model(str(tmp_path / "hf"))
  cfg, params = hf.load(str(tmp_path / "hf"))
  cfg = dataclasses.replace(cfg, logits_chunk=logits_chunk)
  tokens, mask = batch()
  images = vision.image_features(cfg.vision, params["vision"], jnp.asarray(per_row_pixels(cfg, drawn())))
  assert_every_pass_scores_as_teacher_forced(cfg, params, tokens, mask, images, group_size)


def test_two_updates_on_the_mesh_equal_one_device_and_leave_the_tower():
  """Policy-gradient updates of a tiny Qwen2.5-VL on the (data, fsdp, tensor) = (2, 2, 2) mesh equal one
  device's, with the tower's weights sharded there; the tower never changes."""
  from dapo_jax import optim, sharding
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices")
  vcfg = VisionConfig(kind="qwen2_5_vl", image_size=8, patch_size=2, embed_dim=16, mlp_dim=24, num_layers=2,
                      num_heads=2, tokens_per_image=4, window_size=4, full_attention_layers=(1,), image_token_id=63,
                      boi_token_id=61, eoi_token_id=62)
  cfg = ModelConfig(vocab_size=64, embed_dim=32, mlp_dim=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                    qkv_bias=True, arch="qwen2", vision=vcfg, mrope_section=(2, 1, 1))
  params = jax.device_get(model.init_params(cfg, jax.random.key(0)))
  rng = np.random.default_rng(0)
  B, C = 8, 5
  prompt = np.array([3, 61, 63, 63, 63, 63, 62, 7], np.int32)
  tokens = np.concatenate([np.tile(prompt, (B, 1)), rng.integers(1, 60, (B, C))], 1).astype(np.int32)
  images = np.asarray(vision.image_features(vcfg, params["vision"],
                                            jnp.asarray(rng.normal(size=(B, 1, 3, 8, 8)), jnp.float32)))
  zeros = np.zeros((B, C), np.float32)
  batch = RLBatch(tokens_BT=tokens, mask_BT=np.ones(tokens.shape, bool), loss_mask_BC=np.ones((B, C), bool),
                  old_logp_BC=zeros, adv_B=rng.normal(size=B).astype(np.float32), ref_logp_BC=zeros, images_BMD=images)
  out = []
  for shape in ({"data": 1, "fsdp": 1, "tensor": 1}, {"data": 2, "fsdp": 2, "tensor": 2}):
    mesh = sharding.make_mesh(shape, jax.devices()[:int(np.prod(list(shape.values())))])
    trainer = train_step.Trainer(cfg, optim.OptimConfig(lr=1e-2, warmup_steps=0), mesh,
                                 objectives.policy_gradient(cfg, objectives.PGConfig()))
    state = trainer.init(jax.random.key(1), params=jax.tree.map(np.copy, params))
    for step in range(2):
      state, metrics = trainer.step(state.replace(rollout_step=step), trainer.put_batch(batch))
    gate = state.params["vision"]["layers"]["gate_DF"]  # Its width over fsdp, its MLP over tensor.
    assert gate.addressable_shards[0].data.size == gate.size // (shape["fsdp"] * shape["tensor"])
    out.append((jax.device_get(state.params), float(metrics["pg_loss"])))
  (one, loss_one), (mesh8, loss_mesh) = out
  assert loss_one == pytest.approx(loss_mesh, abs=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), one, mesh8)
  jax.tree.map(np.testing.assert_array_equal, one["vision"], params["vision"])
  assert any(np.abs(a - b).max() > 0 for a, b in zip(jax.tree.leaves(one["layers"]), jax.tree.leaves(params["layers"])))


def _tiny_qwen_vl():
  vcfg = VisionConfig(kind="qwen2_5_vl", image_size=8, patch_size=2, embed_dim=16, mlp_dim=24, num_layers=2,
                      num_heads=2, tokens_per_image=4, window_size=4, full_attention_layers=(1,), image_token_id=63,
                      boi_token_id=61, eoi_token_id=62)
  return ModelConfig(vocab_size=64, embed_dim=32, mlp_dim=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     qkv_bias=True, arch="qwen2", vision=vcfg, mrope_section=(2, 1, 1))


def _packable_rows(G: int, seed: int = 0, C: int = 6):
  """Eight rows, G per prompt: every prompt begins with the same text and an image, one has two images,
  two the same text and different images; left padding; random vectors for the placeholders."""
  rng = np.random.default_rng(seed)
  img = [61] + [63] * 4 + [62]
  texts = [[3, 4] + img + [9, 7, 8], [3, 4] + img + [9, 7, 8], [3, 4] + img + [10], [3, 4] + img + [11, 12] + img + [5]]
  P, B = max(map(len, texts)), 8
  prompts = [texts[b // G % 4] if G > 1 else texts[b % 4] for b in range(B)]
  group_images = np.concatenate([rng.normal(size=(B, 8, 32)), np.full((B, 8, 1), 2.0)], -1).astype(np.float32)
  images = np.stack([group_images[b // G] for b in range(B)])
  cmask = np.arange(C)[None] < np.array([3, 6, 1, 5, 6, 2, 4, 6])[:, None]
  tokens = np.array([[0] * (P - len(p)) + p for p in prompts])
  pmask = np.array([[0] * (P - len(p)) + [1] * len(p) for p in prompts], bool)
  tokens = np.concatenate([tokens, np.where(cmask, rng.integers(1, 60, (B, C)), 0)], 1).astype(np.int32)
  return RLBatch(tokens_BT=tokens, mask_BT=np.concatenate([pmask, cmask], 1), loss_mask_BC=cmask,
                 old_logp_BC=rng.normal(-4, 0.3, (B, C)).astype(np.float32),
                 adv_B=rng.normal(size=B).astype(np.float32),
                 ref_logp_BC=np.zeros((B, C), np.float32), images_BMD=images)


@pytest.mark.parametrize("G,block", [(1, 0), (2, 0), (2, 4)])
def test_packed_rows_carry_their_m_rope_positions_and_give_the_padded_loss_and_gradients(G, block):
  """Packed micro-batches (dense, or over block pairs) of rows with images: each token rotates by its row's
  M-RoPE positions, images stay causal, prompts share no beginning; the objective summed over them is the
  padded batch's (loss, metrics, gradients)."""
  from dapo_jax import packing
  cfg = _tiny_qwen_vl()
  params = model.init_params(cfg, jax.random.key(3))
  params = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.key(4), a.shape, a.dtype), params)
  batch = _packable_rows(G)
  obj = objectives.policy_gradient(cfg, objectives.PGConfig(kl_coef=0.1))
  parts = packing.packed_microbatches(batch, max_tokens=64, block=block, vision=cfg.vision)
  assert len(parts) > 1
  for p in parts:
    pk = p.packed
    assert pk.image_MT is None and pk.mrope_MT3 is not None
    assert not ((pk.prompts_MT == 0) & (pk.segments_MT > 0)).any()  # No shared beginning.
  step = jax.jit(jax.value_and_grad(obj.loss, has_aux=True))
  (loss, metrics), grads = step(params, batch, obj.counts(batch))
  counts = jax.tree.map(lambda *c: sum(c), *[obj.counts(p) for p in parts])
  (loss_p, metrics_p), grads_p = jax.tree.map(lambda *x: sum(x), *[step(params, p, counts) for p in parts])
  np.testing.assert_allclose(loss_p, loss, rtol=1e-5, atol=1e-6)
  for k in metrics:
    np.testing.assert_allclose(metrics_p[k], metrics[k], rtol=1e-5, atol=1e-6, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6), grads, grads_p)
  # The positions matter: packed with their rows' 1D positions in all three sections, the loss is another.
  flat = [p.replace(packed=p.packed.replace(mrope_MT3=np.repeat(p.packed.positions_MT[..., None], 3, -1)))
          for p in parts]
  assert abs(sum(float(step(params, p, counts)[0][0]) for p in flat) - float(loss)) > 1e-5
