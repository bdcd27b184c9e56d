"""`model.logits_chunk`: the RL objectives' log-probs, entropy, loss and gradients made a chunk of
completion positions at a time equal the whole-tensor path (chunks that do and do not divide the
completion), on one device and the (2,2,2) mesh, rows and shared prompts, tied and untied heads."""
import dataclasses

import jax
import numpy as np
import pytest

from dapo_jax import objectives, optim, sharding, testing, train_step
from dapo_jax.datatypes import RLBatch

CFG = testing.tiny_model_config(vocab_size=96, num_heads=4, num_kv_heads=2)
OPT = optim.OptimConfig(lr=1e-3, warmup_steps=0)


def batch(G=2, Q=4, P=6, C=10, seed=0):
  """Q prompts x G completions of unequal lengths, each prompt's rows sharing it."""
  rng = np.random.default_rng(seed)
  B = Q * G
  prompt = np.repeat(rng.integers(4, CFG.vocab_size, size=(Q, P)), G, 0)
  pmask = np.ones((B, P), bool)
  pmask[:G, :2] = False
  lengths = rng.integers(1, C + 1, size=B)
  cmask = np.arange(C)[None] < lengths[:, None]
  tokens = np.concatenate([prompt, rng.integers(4, CFG.vocab_size, size=(B, C))], 1).astype(np.int32)
  return RLBatch(tokens_BT=tokens, mask_BT=np.concatenate([pmask, cmask], 1), loss_mask_BC=cmask,
                 old_logp_BC=rng.normal(-4.5, 0.3, size=(B, C)).astype(np.float32),
                 adv_B=rng.normal(size=B).astype(np.float32), ref_logp_BC=np.zeros((B, C), np.float32))


def grads_and_stats(cfg, mesh, pg, b):
  trainer = train_step.Trainer(cfg, OPT, mesh, objectives.policy_gradient(cfg, pg))
  params = trainer.init(jax.random.key(0)).params
  placed = trainer.put_batch(b)
  obj = objectives.policy_gradient(cfg, pg)
  counts = obj.counts(placed)
  (loss, metrics), grads = jax.jit(jax.value_and_grad(lambda p: obj.loss(p, placed, counts), has_aux=True))(params)
  stats = jax.jit(lambda p: objectives.completion_stats(cfg, pg.group_size, p, placed, pg.temperature)[:2])(params)
  return jax.device_get((loss, metrics, grads, stats))


@pytest.mark.parametrize("group_size,tie,meshes", [(0, True, 1), (2, False, 2)])
def test_chunked_logits_equal_the_whole_tensor(group_size, tie, meshes):
  """Chunks of 3 of the 10 completion positions: the last one padded."""
  base = dataclasses.replace(CFG, tie_embeddings=tie)
  pg = objectives.PGConfig(group_size=group_size, temperature=0.7, kl_coef=0.01)
  b = batch()
  mesh_list = [sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])]
  if meshes == 2 and len(jax.devices()) >= 8:
    mesh_list.append(sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}))
  for mesh in mesh_list:
    want = grads_and_stats(base, mesh, pg, b)
    got = grads_and_stats(dataclasses.replace(base, logits_chunk=3), mesh, pg, b)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-7)
    for k in want[1]:
      np.testing.assert_allclose(got[1][k], want[1][k], rtol=1e-5, atol=1e-6, err_msg=k)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7), got[2], want[2])
    for x, y in zip(got[3], want[3]):  # log-probs and entropy per token
      np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)
