"""Gemma 3 with images against transformers' `Gemma3ForConditionalGeneration` (fp32, torch): the SigLIP
tower, the projector, image vectors at their placeholders and bidirectional attention inside an image;
HF import and an export that transformers loads; the sampler's prefill with images."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from dapo_jax import objectives, packing, rlhf_objectives, train_step
from dapo_jax.datatypes import RLBatch
from dapo_jax.hf import convert as hf
from dapo_jax.model import layers, vision
from dapo_jax.model import transformer as model
from dapo_jax.model.config import ModelConfig, VisionConfig
from dapo_jax.rollout import engine, sampling

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V, BOI, EOI, IMG = 300, 297, 298, 299
M = 4  # soft tokens per image


def make_hf_model(path, seed=0):
  torch.manual_seed(seed)
  text = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, sliding_window=8, max_position_embeddings=128,
              layer_types=["sliding_attention", "full_attention"])
  vis = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=32,
             patch_size=4, vision_use_head=False)
  cfg = transformers.Gemma3Config(text_config=text, vision_config=vis, mm_tokens_per_image=M, image_token_index=IMG,
                                  boi_token_index=BOI, eoi_token_index=EOI)
  cfg._attn_implementation = "eager"
  m = transformers.Gemma3ForConditionalGeneration(cfg)
  with torch.no_grad():  # No parameter a no-op: random norms (Gemma's are offsets from 1) and biases.
    for name, p in m.named_parameters():
      if "norm" in name or "bias" in name:
        p.copy_((1.0 if "vision_tower" in name and "weight" in name else 0.0) + 0.2 * torch.randn_like(p))
  m = m.float().eval()
  m.save_pretrained(path)
  return m


def images_of_different_sizes(seed=0):
  """Three drawn images of three sizes, through Gemma 3's own image processor (PIL, no torch)."""
  rng = np.random.default_rng(seed)
  imgs = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in ((40, 70), (20, 20), (64, 32))]
  processor = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
  return processor(images=imgs, return_tensors="np")["pixel_values"]


def image(n=1):
  return ([BOI] + [IMG] * M + [EOI]) * n


def batch():
  """Row 0: two images between text; row 1: left-padded, one image. The window (8) is shorter than the rows."""
  rows = [[5, 6] + image() + [7, 8] + image() + [9, 10, 11], [12] + image() + [13, 14, 15]]
  T = max(map(len, rows))
  tokens = np.array([[0] * (T - len(r)) + r for r in rows])
  mask = np.array([[0] * (T - len(r)) + [1] * len(r) for r in rows])
  return tokens, mask


def torch_logits(m, tokens, mask, pixels):
  pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
  with torch.no_grad():
    return m(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos),
             pixel_values=torch.tensor(pixels), token_type_ids=torch.tensor((tokens == IMG).astype(np.int64))
             ).logits.numpy()


def assert_close_on_real(a, b, mask, rel=1e-4):
  """Logits equal on real positions, but for the image placeholder: ours never emits it."""
  real = mask.astype(bool)
  assert (a[..., IMG] == layers.NEVER).all()
  a, b = np.delete(a, IMG, axis=-1), np.delete(b, IMG, axis=-1)
  assert np.abs(a[real] - b[real]).max() <= rel * np.abs(b[real]).max()


def our_logits(cfg, params, tokens, mask, pixels_BICSS):
  feats = vision.image_features(cfg.vision, params["vision"], jnp.asarray(pixels_BICSS))
  return np.asarray(model.logits(cfg, params, jnp.asarray(tokens), jnp.asarray(mask), images_BMD=feats))


def test_images_in_prompts_match_transformers(tmp_path):
  m = make_hf_model(str(tmp_path / "hf"))
  cfg, params = hf.load(str(tmp_path / "hf"))
  assert cfg.vision == VisionConfig(image_size=32, patch_size=4, embed_dim=32, mlp_dim=48, num_layers=2, num_heads=4,
                                    tokens_per_image=M, image_token_id=IMG, boi_token_id=BOI, eoi_token_id=EOI)
  tokens, mask = batch()
  pixels = images_of_different_sizes()  # [3, C, S, S]: row 0's two images, then row 1's one.
  ref = torch_logits(m, tokens, mask, pixels)
  per_row = np.stack([pixels[:2], np.stack([pixels[2], np.zeros_like(pixels[2])])])  # [B, I=2, C, S, S]
  ours = our_logits(cfg, params, tokens, mask, per_row)
  assert_close_on_real(ours, ref, mask)
  # Each part matters: without the images, or with causal attention inside them, the logits differ.
  no_images = np.asarray(model.logits(cfg, params, jnp.asarray(tokens), jnp.asarray(mask)))
  assert np.abs(no_images - ref)[..., :IMG][mask.astype(bool)].max() > 0.1 * np.abs(ref).max()
  feats = vision.image_features(cfg.vision, params["vision"], jnp.asarray(per_row))
  causal = np.asarray(model.forward(cfg, params, jnp.asarray(tokens), model.positions(jnp.asarray(mask)),
                                    model.causal_mask(jnp.asarray(mask)), images_BMD=feats))
  assert np.abs(causal - ref)[..., :IMG][mask.astype(bool)].max() > 1e-3 * np.abs(ref).max()

  # Our export: re-imported it is the same model; transformers loads it and agrees.
  hf.save(str(tmp_path / "out"), cfg, params)
  cfg2, params2 = hf.load(str(tmp_path / "out"))
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, params2, params)
  m2 = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(tmp_path / "out"), dtype=torch.float32,
                                                                   attn_implementation="eager").eval()
  real = mask.astype(bool)
  np.testing.assert_allclose(torch_logits(m2, tokens, mask, pixels)[real], ref[real], atol=1e-5)


def test_a_random_vision_language_model_exports_to_transformers(tmp_path):
  text = ModelConfig(vocab_size=V, embed_dim=32, mlp_dim=48, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                     arch="gemma3", qk_norm=True, rope_theta=1e6, local_layers=(0,), sliding_window=6,
                     query_scale=16.0, vision=VisionConfig(image_size=16, patch_size=4, embed_dim=16, mlp_dim=24,
                                                           num_layers=1, num_heads=2, tokens_per_image=M,
                                                           image_token_id=IMG, boi_token_id=BOI, eoi_token_id=EOI))
  params = model.init_params(text, jax.random.key(0))
  params = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(1), a.shape, a.dtype), params)
  hf.save(str(tmp_path / "out"), text, params)
  m = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(tmp_path / "out"), dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
  tokens = np.array([[3, 4] + image() + [5]])
  mask = np.ones_like(tokens)
  pixels = np.random.default_rng(0).normal(size=(1, 1, 3, 16, 16)).astype(np.float32)
  assert_close_on_real(our_logits(text, params, tokens, mask, pixels), torch_logits(m, tokens, mask, pixels[0]), mask)


def test_vision_config_checks_its_shapes():
  with pytest.raises(ValueError, match="tokens_per_image=5"):
    VisionConfig(image_size=32, patch_size=4, tokens_per_image=5)
  with pytest.raises(ValueError, match="image_size=30"):
    VisionConfig(image_size=30, patch_size=4, tokens_per_image=4)


def test_the_sampler_sees_the_images_and_records_teacher_forced_log_probs(tmp_path):
  m = make_hf_model(str(tmp_path / "hf"))
  cfg, params = hf.load(str(tmp_path / "hf"))
  tokens, mask = batch()
  pixels = images_of_different_sizes()
  per_row = np.stack([pixels[:2], np.stack([pixels[2], np.zeros_like(pixels[2])])])
  C = 6
  # Greedy: transformers' own generate on the same images picks the same tokens.
  images = vision.image_features(cfg.vision, params["vision"], jnp.asarray(per_row))
  greedy = sampling.generate(cfg, sampling.SamplerConfig(max_new_tokens=C, temperature=0.0), params, tokens, mask,
                             jax.random.key(0), images_QMD=images)
  for b, (row, n) in enumerate(((0, 2), (1, 1))):
    real = mask[row].astype(bool)
    with torch.no_grad():
      out = m.generate(input_ids=torch.tensor(tokens[row][real][None]), pixel_values=torch.tensor(per_row[row, :n]),
                       token_type_ids=torch.tensor((tokens[row][real][None] == IMG).astype(np.int64)),
                       max_new_tokens=C, do_sample=False, min_new_tokens=C)
    np.testing.assert_array_equal(np.asarray(greedy.tokens_BC[b]), out[0, real.sum():].numpy())

  # Sampled (G = 3 per prompt): each recorded log-prob is the teacher-forced one of prompt + images + completion.
  G = 3
  s = sampling.generate(cfg, sampling.SamplerConfig(max_new_tokens=C, temperature=1.0), params, tokens, mask,
                        jax.random.key(1), num_samples=G, images_QMD=images)
  rows = np.concatenate([np.repeat(tokens, G, 0), np.asarray(s.tokens_BC)], 1)
  rows_mask = np.concatenate([np.repeat(mask, G, 0), np.asarray(s.mask_BC)], 1)
  feats = vision.image_features(cfg.vision, params["vision"], jnp.asarray(np.repeat(per_row, G, 0)))
  logits = model.logits(cfg, params, jnp.asarray(rows), jnp.asarray(rows_mask), images_BMD=feats)
  P = tokens.shape[1]
  logp = jax.nn.log_softmax(logits[:, P - 1:-1], -1)
  teacher = np.take_along_axis(np.asarray(logp), np.asarray(s.tokens_BC)[..., None], -1)[..., 0]
  np.testing.assert_allclose(np.where(s.mask_BC, s.logp_BC, 0), np.where(s.mask_BC, teacher, 0), atol=1e-5)


@pytest.mark.parametrize("kv_layout", ["dense", "paged"])
def test_the_engine_prefills_a_group_once_with_its_images_and_records_teacher_forced_log_probs(tmp_path, kv_layout):
  make_hf_model(str(tmp_path / "hf"))
  cfg, params = hf.load(str(tmp_path / "hf"))
  tokens, mask = batch()
  pixels = images_of_different_sizes()
  per_row = np.stack([pixels[:2], np.stack([pixels[2], np.zeros_like(pixels[2])])])
  G, C, P = 4, 6, tokens.shape[1]
  # Fewer slots than samples: a group's samples start over several rounds, from one prefill.
  eng = engine.Engine(cfg, sampling.SamplerConfig(max_new_tokens=C, temperature=1.0, eos_ids=(1,)), slots=3,
                      prompt_len=P, kv_layout=kv_layout, page_size=4)
  images = vision.image_features(cfg.vision, params["vision"], jnp.asarray(per_row))
  s, stats = eng.generate(params, tokens, mask, G, jax.random.key(2), images_QMD=images)
  assert stats["prefilled_prompts"] == 2 and stats["samples"] == 2 * G  # One prefill per group.
  feats = vision.image_features(cfg.vision, params["vision"], jnp.asarray(np.repeat(per_row, G, 0)))
  assert_recorded_log_probs_are_teacher_forced(cfg, params, tokens, mask, feats, s)


@pytest.mark.parametrize("group_size,logits_chunk", [(0, 0), (3, 0), (3, 4)])
def test_the_update_scores_completions_with_the_prompts_images(tmp_path, group_size, logits_chunk):
  """Every pass that scores a token (π_old, current, reference: `objectives.completion_stats`) places the
  rows' image vectors: its log-probs equal a teacher-forced forward of prompt + images + completion, in
  the rows layout, the shared-prompt layout and with chunked logits, through length-bucketed micro-batches."""
  make_hf_model(str(tmp_path / "hf"))
  cfg, params = hf.load(str(tmp_path / "hf"))
  cfg = dataclasses.replace(cfg, logits_chunk=logits_chunk)
  tokens, mask = batch()
  pixels = images_of_different_sizes()
  per_row = np.stack([pixels[:2], np.stack([pixels[2], np.zeros_like(pixels[2])])])
  images = vision.image_features(cfg.vision, params["vision"], jnp.asarray(per_row))
  assert_every_pass_scores_as_teacher_forced(cfg, params, tokens, mask, images, group_size)


def teacher_log_probs(cfg, params, tokens_QP, mask_QP, images_BMD, tokens_BC, mask_BC) -> np.ndarray:
  """[B, C] log-probs of a teacher-forced forward of each prompt (repeated for its B/Q rows) + images + completion."""
  G, P = len(tokens_BC) // len(tokens_QP), tokens_QP.shape[1]
  rows = np.concatenate([np.repeat(tokens_QP, G, 0), np.asarray(tokens_BC)], 1).astype(np.int32)
  rows_mask = np.concatenate([np.repeat(mask_QP, G, 0), np.asarray(mask_BC)], 1)
  logits = model.logits(cfg, params, jnp.asarray(rows), jnp.asarray(rows_mask), images_BMD=jnp.asarray(images_BMD))
  logp = np.asarray(jax.nn.log_softmax(logits[:, P - 1:-1], -1))
  return np.take_along_axis(logp, rows[:, P:, None], -1)[..., 0]


def assert_recorded_log_probs_are_teacher_forced(cfg, params, tokens_QP, mask_QP, images_BMD, samples):
  """The sampler's recorded log-probs equal `teacher_log_probs` to 1e-5 on every sampled token."""
  teacher = teacher_log_probs(cfg, params, tokens_QP, mask_QP, images_BMD, samples.tokens_BC, samples.mask_BC)
  m = np.asarray(samples.mask_BC)
  np.testing.assert_allclose(np.where(m, samples.logp_BC, 0), np.where(m, teacher, 0), atol=1e-5)


def assert_every_pass_scores_as_teacher_forced(cfg, params, tokens, mask, images_QMD, group_size, G=3, C=7):
  """G sampled completions of each prompt, scored by `objectives.completion_stats` (in `group_size`'s layout)
  over length-bucketed micro-batches: each log-prob equals `teacher_log_probs` to 1e-5."""
  P = tokens.shape[1]
  s = sampling.generate(cfg, sampling.SamplerConfig(max_new_tokens=C, temperature=1.0, eos_ids=(1, 2, 3)), params,
                        tokens, mask, jax.random.key(3), num_samples=G, images_QMD=images_QMD)
  rows = np.concatenate([np.repeat(tokens, G, 0), np.asarray(s.tokens_BC)], 1).astype(np.int32)
  rows_mask = np.concatenate([np.repeat(mask, G, 0), np.asarray(s.mask_BC)], 1)
  images_BMD = np.repeat(np.asarray(images_QMD), G, 0)
  B, zeros = len(rows), np.zeros((len(rows), C), np.float32)
  rl = RLBatch(tokens_BT=rows, mask_BT=rows_mask, loss_mask_BC=np.asarray(s.mask_BC), old_logp_BC=zeros,
               adv_B=np.zeros(B, np.float32), ref_logp_BC=zeros, images_BMD=images_BMD)
  teacher = teacher_log_probs(cfg, params, tokens, mask, images_BMD, s.tokens_BC, s.mask_BC)
  for mb in train_step.bucketed_microbatches(rl, 2, G, (4,)):
    ours, _, _ = objectives.completion_stats(cfg, group_size, params, mb, 1.0)
    Cb = mb.loss_mask_BC.shape[1]
    idx = [int(np.flatnonzero((rows[:, :P + Cb] == r).all(1) & (rows_mask[:, :P + Cb] == m).all(1))[0])
           for r, m in zip(np.asarray(mb.tokens_BT), np.asarray(mb.mask_BT))]
    real = np.asarray(mb.loss_mask_BC)
    np.testing.assert_allclose(np.where(real, ours, 0), np.where(real, teacher[idx, :Cb], 0), atol=1e-5)


def _rows_with_images(G: int, seed: int = 0, C: int = 6):
  """Eight rows (`_vlm`'s placeholders), G per prompt: groups 0 and 1 have the same text and different
  images, group 3 two images; every prompt begins with the same text and an image; left padding."""
  rng = np.random.default_rng(seed)
  img = [61] + [63] * 4 + [62]
  texts = [[3, 4] + img + [9, 7, 8], [3, 4] + img + [9, 7, 8], [3, 4] + img + [10], [3, 4] + img + [11, 12] + img + [5]]
  P, B, I, D = max(map(len, texts)), 8, 8, 32
  prompts = [texts[b // G % 4] if G > 1 else texts[b % 4] for b in range(B)]
  group_images = rng.normal(size=(B, I, D)).astype(np.float32)
  images = np.stack([group_images[b // G] for b in range(B)])
  lengths = [3, 6, 1, 5, 6, 2, 4, 6]
  cmask = np.arange(C)[None] < np.array(lengths)[:, None]
  tokens = np.array([[0] * (P - len(p)) + p for p in prompts])
  pmask = np.array([[0] * (P - len(p)) + [1] * len(p) for p in prompts], bool)
  tokens = np.concatenate([tokens, np.where(cmask, rng.integers(1, 60, (B, C)), 0)], 1).astype(np.int32)
  zeros = np.zeros((B, C), np.float32)
  return RLBatch(tokens_BT=tokens, mask_BT=np.concatenate([pmask, cmask], 1), loss_mask_BC=cmask,
                 old_logp_BC=rng.normal(-4, 0.3, (B, C)).astype(np.float32),
                 adv_B=rng.normal(size=B).astype(np.float32), ref_logp_BC=zeros, images_BMD=images)


def test_packed_rows_with_images_by_hand():
  """Rows share a prompt only with rows of the same images, a beginning only up to the first image;
  each placeholder is numbered by its image and takes its row slot's vectors in order."""
  batch = _rows_with_images(G=2)
  with pytest.raises(ValueError, match="image_token"):
    packing.packed_rows(batch, max_tokens=512)
  (part, slots), = packing.packed_rows(batch, max_tokens=128, block=8, image_token=63)  # One sequence.
  pk = part.packed
  assert (pk.segments_MT.max(), pk.prompts_MT.max(), pk.branches_MT.max()) == (1, 4, 2)  # Four prompts of two rows.
  beginning = pk.tokens_MT[0][(pk.prompts_MT[0] == 0) & (pk.segments_MT[0] > 0)]
  np.testing.assert_array_equal(beginning, [3, 4, 61])  # Not the placeholders: the images differ.
  is_image = pk.tokens_MT[0] == 63
  assert ((pk.image_MT[0] > 0) == is_image).all()
  ids = pk.image_MT[0][is_image]
  assert len(set(ids.tolist())) == 5 and (np.bincount(ids)[ids] == 4).all()  # Five images of four tokens.
  slot = {int(b): r for r, b in enumerate(slots)}
  # The n-th placeholder's vector: its group's first row's, in the prompt's order.
  expect, order = [], [int(b) for b in slots if b >= 0]
  for g in range(4):
    first = order[2 * g]
    n = int((batch.tokens_BT[first] == 63).sum())
    expect += [slot[first] * 8 + j for j in range(n)]
  np.testing.assert_array_equal(pk.image_source_MN[0, :len(expect)], expect)
  np.testing.assert_array_equal(part.images_BMD[[slot[b] for b in order]], batch.images_BMD[order])


@pytest.mark.parametrize("G,block", [(1, 0), (2, 0), (2, 4)])
def test_packed_rows_with_images_give_the_padded_loss_metrics_and_gradients(G, block):
  """A vision-language model (a sliding-window layer, images seen both ways) on rows with images:
  the objective summed over packed micro-batches (dense, or over block pairs) is the padded batch's."""
  cfg = _vlm()
  params = model.init_params(cfg, jax.random.key(3))
  batch = _rows_with_images(G)
  obj = objectives.policy_gradient(cfg, objectives.PGConfig(kl_coef=0.1))
  parts = packing.packed_microbatches(batch, max_tokens=64, block=block, image_token=63)
  assert len(parts) > 1
  step = jax.jit(jax.value_and_grad(obj.loss, has_aux=True))
  (loss, metrics), grads = step(params, batch, obj.counts(batch))
  counts = jax.tree.map(lambda *c: sum(c), *[obj.counts(p) for p in parts])
  (loss_p, metrics_p), grads_p = jax.tree.map(lambda *x: sum(x), *[step(params, p, counts) for p in parts])
  np.testing.assert_allclose(loss_p, loss, rtol=1e-5, atol=1e-6)
  for k in metrics:
    np.testing.assert_allclose(metrics_p[k], metrics[k], rtol=1e-5, atol=1e-6, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6), grads, grads_p)
  # The images matter: packed with them dropped, the loss is another.
  blind = [p.replace(packed=p.packed.replace(image_source_MN=None, image_MT=None)) for p in parts]
  loss_b = sum(float(step(params, p, counts)[0][0]) for p in blind)
  assert abs(loss_b - float(loss)) > 1e-4


def _vlm(vocab=64):
  return ModelConfig(vocab_size=vocab, embed_dim=32, mlp_dim=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     arch="gemma3", qk_norm=True, local_layers=(0,), sliding_window=6, query_scale=8.0,
                     vision=VisionConfig(image_size=8, patch_size=2, embed_dim=16, mlp_dim=24, num_layers=1,
                                         num_heads=2, tokens_per_image=4, image_token_id=63, boi_token_id=61,
                                         eoi_token_id=62))


@pytest.mark.parametrize("lora", [None, "int8"])
def test_two_updates_with_images_on_the_mesh_equal_one_device_and_leave_the_tower(lora):
  """Policy-gradient updates of a vision-language model on the (data, fsdp, tensor) = (2, 2, 2) mesh equal
  one device's, with the tower's weights sharded there; the tower and projector never change, and the
  optimizer holds no state for them."""
  from dapo_jax import optim, sharding
  from dapo_jax.model import lora as lora_lib
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices")
  cfg = _vlm()
  params = jax.device_get(model.init_params(cfg, jax.random.key(0)))  # Host arrays: a step donates its state.
  rng = np.random.default_rng(0)
  B, C = 8, 5
  prompt = np.array([3, 61, 63, 63, 63, 63, 62, 7], np.int32)
  tokens = np.concatenate([np.tile(prompt, (B, 1)), rng.integers(1, 60, (B, C))], 1).astype(np.int32)
  mask = np.ones(tokens.shape, bool)
  images = np.asarray(vision.image_features(cfg.vision, params["vision"],
                                            jnp.asarray(rng.normal(size=(B, 1, 3, 8, 8)), jnp.float32)))
  zeros = np.zeros((B, C), np.float32)
  batch = RLBatch(tokens_BT=tokens, mask_BT=mask, loss_mask_BC=np.ones((B, C), bool), old_logp_BC=zeros,
                  adv_B=rng.normal(size=B).astype(np.float32), ref_logp_BC=zeros, images_BMD=images)
  lcfg = None if lora is None else lora_lib.LoraConfig(rank=4, base_quant=lora)
  out = []
  for shape in ({"data": 1, "fsdp": 1, "tensor": 1}, {"data": 2, "fsdp": 2, "tensor": 2}):
    mesh = sharding.make_mesh(shape, jax.devices()[:int(np.prod(list(shape.values())))])
    trainer = train_step.Trainer(cfg, optim.OptimConfig(lr=1e-2, warmup_steps=0), mesh,
                                 objectives.policy_gradient(cfg, objectives.PGConfig()), lora=lcfg)
    state = trainer.init(jax.random.key(1), params=jax.tree.map(np.copy, params))
    for step in range(2):
      state, metrics = trainer.step(state.replace(rollout_step=step), trainer.put_batch(batch))
    # The tower's weights shard as the text model's: its width over fsdp, its MLP over tensor.
    fc1 = vision.tower_params(state.params)["layers"]["fc1_DF"]
    assert fc1.addressable_shards[0].data.size == fc1.size // (shape["fsdp"] * shape["tensor"])
    out.append((jax.device_get(state.params), float(metrics["pg_loss"])))
  (one, loss_one), (mesh8, loss_mesh) = out
  assert loss_one == pytest.approx(loss_mesh, abs=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), one, mesh8)
  tower = one["base"]["vision"] if lora else one["vision"]
  jax.tree.map(np.testing.assert_array_equal, tower, params["vision"])
  trained = one["lora"] if lora else one["layers"]
  assert any(np.abs(a - b).max() > 0 for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(
      jax.device_get(lora_lib.adapt(cfg, lcfg, params, jax.random.key(1))["lora"]) if lora else params["layers"])))


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (2, 2, 2)])
def test_two_packed_updates_with_images_equal_two_padded_updates(mesh_shape):
  """Through the Trainer, on one device and the (data, fsdp, tensor) = (2, 2, 2) mesh: two updates on rows
  with images packed over block pairs (micro-batches accumulated) give the padded update's metrics and params."""
  from dapo_jax import optim, sharding
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices")
  cfg = _vlm()
  params = jax.device_get(model.init_params(cfg, jax.random.key(0)))
  batch = _rows_with_images(G=2)
  out = []
  for shape, packed in (((1, 1, 1), False), (mesh_shape, True)):
    mesh = sharding.make_mesh(dict(zip(("data", "fsdp", "tensor"), shape)), jax.devices()[:int(np.prod(shape))])
    trainer = train_step.Trainer(cfg, optim.OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=1.0), mesh,
                                 objectives.policy_gradient(cfg, objectives.PGConfig()), num_microbatches=1)
    parts = (packing.packed_microbatches(batch, max_tokens=64, shards=sharding.batch_shards(mesh.shape), block=4,
                                         image_token=63) if packed else [batch])
    state = trainer.init(params=jax.tree.map(np.copy, params))
    metrics = []
    for _ in range(2):
      placed = [trainer.put_batch(p) for p in parts]
      state, m = trainer.accumulate_step(state, placed) if len(placed) > 1 else trainer.step(state, placed[0])
      metrics.append(jax.device_get(m))
    out.append((metrics, jax.device_get(state.params), len(parts)))
  (m_pad, p_pad, _), (m_pk, p_pk, n_parts) = out
  assert n_parts > 1 or mesh_shape != (1, 1, 1)
  for a, b in zip(m_pad, m_pk):
    for k in a:
      np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=k)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(y, x, atol=1e-6), p_pad, p_pk)


@pytest.mark.parametrize("group_size", [0, 3])
def test_the_critic_values_completions_with_the_prompts_images(tmp_path, group_size):
  """PPO's value model (the policy's trunk with a scalar head) reads the rows' image vectors: its values
  equal a scalar-head forward of prompt + images + completion, in both layouts, and differ without them."""
  from dapo_jax.datatypes import ValueBatch
  from dapo_jax.pipelines import rm
  make_hf_model(str(tmp_path / "hf"))
  cfg, params = hf.load(str(tmp_path / "hf"))
  critic = rm.from_lm(jax.device_get(params))
  critic["score_D"] = np.random.default_rng(5).normal(size=critic["score_D"].shape).astype(np.float32)  # not 0
  tokens, mask = batch()
  pixels = images_of_different_sizes()
  per_row = np.stack([pixels[:2], np.stack([pixels[2], np.zeros_like(pixels[2])])])
  images = np.asarray(vision.image_features(cfg.vision, params["vision"], jnp.asarray(per_row)))
  G, C, P = 3, 5, tokens.shape[1]
  rng = np.random.default_rng(4)
  completions = rng.integers(1, 200, size=(2 * G, C)).astype(np.int32)
  rows = np.concatenate([np.repeat(tokens, G, 0), completions], 1)
  rows_mask = np.concatenate([np.repeat(mask, G, 0), np.ones((2 * G, C), bool)], 1)
  zeros = np.zeros((2 * G, C), np.float32)
  vb = ValueBatch(tokens_BT=rows, mask_BT=rows_mask, loss_mask_BC=np.ones((2 * G, C), bool), old_values_BC=zeros,
                  returns_BC=zeros, images_BMD=np.repeat(images, G, 0))
  ours = np.asarray(rlhf_objectives.completion_values(cfg, group_size)(critic, vb))
  want = np.asarray(model.forward(cfg, critic, jnp.asarray(rows), model.positions(jnp.asarray(rows_mask)),
                                  model.attention_mask(cfg, jnp.asarray(rows), jnp.asarray(rows_mask)), head="scalar",
                                  images_BMD=jnp.asarray(np.repeat(images, G, 0))))[:, P - 1:-1]
  np.testing.assert_allclose(ours, want, atol=1e-5)
  blind = np.asarray(rlhf_objectives.completion_values(cfg, group_size)(critic, vb.replace(images_BMD=None)))
  assert np.abs(blind - ours).max() > 1e-3
