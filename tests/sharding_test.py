"""Mesh construction, the divisibility check, and the sampler sharded over 8 host devices."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dapo_jax import objectives, optim, sharding, testing, train_step
from dapo_jax.rollout import rollout, sampling


def test_make_mesh_sizes_and_errors():
  n = len(jax.devices())
  mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
  assert dict(mesh.shape) == {"data": 1, "fsdp": n, "expert": 1, "sequence": 1, "tensor": 1}
  with pytest.raises(ValueError, match=r"data\*fsdp\*expert\*sequence\*tensor = 3, but there are"):
    sharding.make_mesh({"data": 3, "fsdp": 1, "tensor": 1})
  with pytest.raises(ValueError, match="at most one axis may be -1"):
    sharding.make_mesh({"data": -1, "fsdp": -1, "tensor": 1})
  if n % 3:
    with pytest.raises(ValueError, match=f"the fixed axes multiply to 3, which does not divide the {n} devices"):
      sharding.make_mesh({"data": 3, "fsdp": -1, "tensor": 1})


def test_model_must_divide_the_tensor_axis():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices")
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 8})
  cfg = testing.tiny_model_config(num_heads=4, num_kv_heads=2)
  with pytest.raises(ValueError, match=r"num_heads=4 is not divisible by mesh size 8"):
    train_step.Trainer(cfg, optim.OptimConfig(), mesh, objectives.language_model(cfg))


def test_logical_rules():
  assert sharding.spec("BTD") == P(("data", "fsdp", "expert"), "sequence", None)
  assert sharding.spec("DF", sharding.PARAM_RULES) == P("fsdp", "tensor")
  assert sharding.spec("EDF", sharding.PARAM_RULES) == P("expert", "fsdp", "tensor")
  assert sharding.spec("EDF", sharding.SAMPLING_PARAM_RULES) == P("expert", None, "tensor")
  assert sharding.spec("DF", sharding.SAMPLING_PARAM_RULES) == P(None, "tensor")


def test_sharded_sampler_matches_one_device():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices")
  cfg = testing.tiny_model_config(vocab_size=64)
  params = testing.sharp_params(cfg, seed=2)
  rng = np.random.default_rng(0)
  prompt = rng.integers(4, 64, size=(8, 6)).astype(np.int32)
  mask = np.ones((8, 6), bool)
  mask[3, :2] = False
  sc = sampling.SamplerConfig(max_new_tokens=8, temperature=0.0, eos_ids=(1,))
  one = jax.device_get(sampling.generate(cfg, sc, params, prompt, mask, jax.random.key(0)))
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  trainer = train_step.Trainer(cfg, optim.OptimConfig(), mesh, objectives.language_model(cfg))
  sampler_sharding = rollout.Rollout(None, cfg, mesh, rollout.RolloutConfig(max_prompt_len=6), sc).params_sharding
  rows = sharding.put((prompt, mask), trainer.batch_sharding)
  for shardings in (trainer.params_sharding, sampler_sharding):  # FSDP'd, and gathered
    out = sampling.generate(cfg, sc, sharding.put(params, shardings), *rows, jax.random.key(0))
    assert len(out.tokens_BC.sharding.device_set) == 8
    np.testing.assert_array_equal(np.asarray(out.tokens_BC), one.tokens_BC)
    np.testing.assert_array_equal(np.asarray(out.length_B), one.length_B)
  assert sampler_sharding["layers"]["w_up_DF"].spec == P(None, None, "tensor")


def test_train_step_applies_activation_constraints_on_the_mesh():
  """The model's `constrain(x, "BTD")` calls reach the compiled train step: it runs under the mesh."""
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices")
  from dapo_jax.datatypes import RLBatch
  cfg = testing.tiny_model_config(vocab_size=64)
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  trainer = train_step.Trainer(cfg, optim.OptimConfig(), mesh, objectives.policy_gradient(cfg, objectives.PGConfig()))
  B, P_, C = 8, 4, 4
  zeros = np.zeros((B, C), np.float32)
  batch = trainer.put_batch(RLBatch(
      tokens_BT=np.ones((B, P_ + C), np.int32), mask_BT=np.ones((B, P_ + C), bool), loss_mask_BC=np.ones((B, C), bool),
      old_logp_BC=zeros, adv_B=np.ones((B,), np.float32), ref_logp_BC=zeros))
  state = trainer.init(jax.random.key(0))

  def constraints(text):
    return text.count("sharding_constraint") + text.count("@Sharding")
  hlo = trainer.lower_step(state, batch).as_text()
  # The embedding, every block output and the logits are constrained, batch over (data, fsdp).
  assert constraints(hlo) >= 3, hlo[:2000]
  # What makes them apply is the mesh context: outside one, `constrain` is a no-op.
  x = np.zeros((8, 4, 2), np.float32)
  assert constraints(jax.jit(lambda x: sharding.constrain(x, "BTD")).lower(x).as_text()) == 0
  with jax.set_mesh(mesh):
    assert constraints(jax.jit(lambda x: sharding.constrain(x, "BTD")).lower(x).as_text()) == 1
