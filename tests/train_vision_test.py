"""`model.train_vision`: RL trains the vision tower. Every pass that scores a token runs its own tower on
the rows' pixels, so the policy loss's gradient reaches the tower's weights (checked against a loss
written here, row by row); the run keeps each group's pixels for the update, and the tower moves."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax import objectives
from dapo_jax.datatypes import Groups, RLBatch
from dapo_jax.hf import convert as hf
from dapo_jax.model import transformer as model
from dapo_jax.model import vision
from dapo_jax.model.config import ModelConfig, VisionConfig

B, G, C = 4, 2, 5
PROMPT = np.array([3, 61, 63, 63, 63, 63, 62, 7], np.int32)


def tiny(kind: str) -> ModelConfig:
  if kind == "siglip":
    return ModelConfig(vocab_size=64, embed_dim=32, mlp_dim=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       arch="gemma3", qk_norm=True, query_scale=8.0,
                       vision=VisionConfig(image_size=8, patch_size=2, embed_dim=16, mlp_dim=24, num_layers=1,
                                           num_heads=2, tokens_per_image=4, image_token_id=63, boi_token_id=61,
                                           eoi_token_id=62))
  return ModelConfig(vocab_size=64, embed_dim=32, mlp_dim=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     qkv_bias=True, arch="qwen2", mrope_section=(2, 1, 1),
                     vision=VisionConfig(kind="qwen2_5_vl", image_size=8, patch_size=2, embed_dim=16, mlp_dim=24,
                                         num_layers=2, num_heads=2, tokens_per_image=4, window_size=4,
                                         full_attention_layers=(1,), image_token_id=63, boi_token_id=61,
                                         eoi_token_id=62, native_resolution=kind.endswith("native")))


def rows(cfg, params, seed=0):
  """B rows (B/G groups, a group's rows sharing its prompt's picture) with pixels and the rollout's vectors."""
  rng = np.random.default_rng(seed)
  tokens = np.concatenate([np.tile(PROMPT, (B, 1)), rng.integers(1, 60, (B, C))], 1).astype(np.int32)
  pixels = np.repeat(rng.normal(size=(B // G, 1, 3, 8, 8)).astype(np.float32), G, axis=0)
  mask = np.ones(tokens.shape, bool)
  loss_mask = np.ones((B, C), bool)
  loss_mask[1, 3:] = False
  zeros = np.zeros((B, C), np.float32)
  grids = None
  if cfg.vision.native_resolution:  # A wide picture and a tall one, 4 tokens each (1 x 4 and 4 x 1).
    grids = np.repeat(np.array([[[2, 8]], [[8, 2]]], np.int32), G, axis=0)
  images = np.asarray(vision.image_features(cfg.vision, params["vision"], jnp.asarray(pixels), grids))
  return RLBatch(tokens_BT=tokens, mask_BT=mask, loss_mask_BC=loss_mask, old_logp_BC=zeros,
                 adv_B=rng.normal(size=B).astype(np.float32), ref_logp_BC=zeros, images_BMD=images,
                 pixels_BICSS=pixels, grids_BI2=grids)


def naive_loss(cfg, params, batch):
  """The policy gradient at ratio 1, row by row: -sum(adv * log p(token) over loss tokens) / their count, each
  row's log-probs from a forward whose image vectors its own pixels give through `params`' tower."""
  total = 0.0
  P = batch.tokens_BT.shape[1] - C
  for b in range(B):
    grids = None if batch.grids_BI2 is None else batch.grids_BI2[b:b + 1]
    feats = vision.image_features(cfg.vision, params["vision"], jnp.asarray(batch.pixels_BICSS[b:b + 1]), grids)
    logits = model.logits(cfg, params, jnp.asarray(batch.tokens_BT[b:b + 1]), jnp.asarray(batch.mask_BT[b:b + 1]),
                          images_BMD=feats)[0, P - 1:-1]
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), jnp.asarray(batch.tokens_BT[b, P:, None]), -1)[:, 0]
    total = total - batch.adv_B[b] * jnp.sum(jnp.where(batch.loss_mask_BC[b], logp, 0.0))
  return total / batch.loss_mask_BC.sum()


@pytest.mark.parametrize("kind", ["siglip", "qwen2_5_vl", "qwen2_5_vl_native"])
@pytest.mark.parametrize("group_size", [0, G])
def test_the_policy_gradient_reaches_the_tower_through_the_pixels(kind, group_size):
  cfg = tiny(kind)
  params = model.init_params(cfg, jax.random.key(0))
  params = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.key(1), a.shape, a.dtype), params)
  batch = rows(cfg, params)
  objective = objectives.policy_gradient(cfg, objectives.PGConfig(old_is_current=True, group_size=group_size))
  grad = jax.jit(jax.grad(lambda p, b: objective.loss(p, b, objective.counts(b))[0]))
  ours, reference = grad(params, batch), jax.jit(jax.grad(lambda p: naive_loss(cfg, p, batch)))(params)
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(reference["vision"]))
  assert scale > 0
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5 * scale), ours["vision"], reference["vision"])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5 * max(1.0, float(jnp.abs(b).max()))),
               ours["layers"], reference["layers"])
  # Without pixels the loss reads the rollout's vectors: the tower gets no gradient.
  frozen = grad(params, batch.replace(pixels_BICSS=None))
  assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(frozen["vision"]))
  if batch.grids_BI2 is not None:  # The grids matter: read as S x S images, the gradient is another.
    square = grad(params, batch.replace(grids_BI2=None))
    assert max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(square), jax.tree.leaves(ours))) > 1e-4


def test_groups_keep_their_pixels_through_json_and_into_the_batch():
  from dapo_jax import advantages
  from dapo_jax.rollout import sampling
  Q, P = 2, 4
  samples = sampling.Samples(tokens_BC=np.ones((Q * G, C), np.int32), mask_BC=np.ones((Q * G, C), bool),
                             logp_BC=np.zeros((Q * G, C), np.float32), length_B=np.full(Q * G, C),
                             truncated_B=np.zeros(Q * G, bool))
  pixels = np.random.default_rng(0).normal(size=(Q, 1, 3, 8, 8)).astype(np.float32)
  groups = Groups.from_samples(np.ones((Q, P), np.int32), np.ones((Q, P), bool), samples, np.eye(Q, G),
                               np.eye(Q, G), np.zeros((Q, G)), images_QMD=np.zeros((Q, 4, 32)), pixels_QICSS=pixels)
  back = Groups.from_json(json.loads(json.dumps(groups.to_json())))
  np.testing.assert_array_equal(back.pixels_QICSS, pixels)
  batch, _ = advantages.to_train_batch(back, Q, P, norm_adv_by_std=True, overlong_filter=False)
  np.testing.assert_array_equal(batch.pixels_BICSS, np.repeat(pixels, G, 0))
  assert batch.grids_BI2 is None and back.grids_QI2.shape == (Q, 0, 2)
  # At native resolution the grids come along.
  grids = np.array([[[2, 8]], [[4, 4]]], np.int32)
  native = Groups.from_json(json.loads(json.dumps(dataclasses.replace(groups, grids_QI2=grids).to_json())))
  batch, _ = advantages.to_train_batch(native, Q, P, norm_adv_by_std=True, overlong_filter=False)
  np.testing.assert_array_equal(batch.grids_BI2, np.repeat(grids, G, 0))
  # Groups without pixels (a frozen tower) make a batch without them, and read back so.
  frozen = Groups.from_json(json.loads(json.dumps(dataclasses.replace(groups, pixels_QICSS=None).to_json())))
  assert frozen.pixels_QICSS.shape == (Q, 0, 0, 0, 0)
  assert advantages.to_train_batch(frozen, Q, P, norm_adv_by_std=True, overlong_filter=False)[0].pixels_BICSS is None


@pytest.mark.slow
def test_a_run_trains_the_tower_only_when_asked(tmp_path):
  """The recipe shrunk, two rollout steps: with model.train_vision the tower's weights move and the update
  reads each group's pixels; without it they stay as the warm start left them."""
  import dapo_jax
  towers = {}
  for train_vision in (False, True):
    workdir = str(tmp_path / f"run_{train_vision}")
    overrides = {"train.num_steps": 2, "sft.steps": 10, "model.init": "sft",
                 "reward.fn": "dapo_jax.testing:length_reward", "reward.workers": 1,
                 "model.train_vision": train_vision, "train.eval_every": 0}
    with dapo_jax.Run("configs/vlm_count_shapes.py:runlocal", workdir=workdir, **overrides) as run:
      run.train()
      with open(os.path.join(workdir, "metrics.jsonl")) as f:
        updates = [r for r in map(json.loads, f) if "actor/pg_loss" in r]
      assert [r["step"] for r in updates] == [1, 2]
      start = hf.load(os.path.join(workdir, "sft_model"))[1]["vision"]
      towers[train_vision] = (start, jax.device_get(run._loop.state.params["vision"]))
  start, end = towers[False]
  jax.tree.map(np.testing.assert_array_equal, end, start)
  start, end = towers[True]
  assert max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(end), jax.tree.leaves(start))) > 0
