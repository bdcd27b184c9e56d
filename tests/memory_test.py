"""The memory plan against hand-computed byte counts and the compiled train step's memory_analysis()."""
import jax
import pytest

from dapo_jax import testing
from dapo_jax.model import memory


def test_plan_by_hand():
  mc = testing.tiny_model_config(vocab_size=128)   # fp32 params and compute
  mesh = {"data": 1, "fsdp": 2, "tensor": 2}
  p = memory.plan(mc, mesh, rows_per_update=8, num_microbatches=2, prompt_len=6, completion_len=10, gen_rows=16)
  n = mc.num_params
  assert p.params == n * 4 / 4 and p.optimizer == 2 * n * 4 / 4 and p.gradients == n * 4 / 4
  # 8 rows / 2 micro-batches / 2 batch shards = 2 rows of 16 tokens per device.
  D, F, N, K, H, L, V, T = 32, 64, 4, 2, 8, 2, 128, 16
  per_token_layer = 4 * (4 * D + (2 * N * H + 2 * K * H + 3 * F) / 2)
  scores = 2 * 4 * 2 * (N / 2) * T * T
  logits = 2 * 4 * 2 * 10 * V / 2
  assert p.activations_no_remat == L * (2 * T * per_token_layer + scores) + logits
  assert p.activations_remat == L * 2 * T * D * 4 + 2 * T * per_token_layer + scores + logits
  dots_token_layer = 4 * (D + ((N + 2 * K) * H + 2 * F) / 2)   # input; q, k, v; gate, up
  assert p.activations_dots == L * 2 * T * dots_token_layer + 2 * T * per_token_layer + scores + logits
  assert p.remat == "none" and p.train_total == p.params + p.optimizer + p.gradients + p.activations_no_remat
  assert p.kv_cache == 2 * L * 8 * T * H * 4   # 16 rows / 2 shards; one KV head per tensor shard
  assert p.fits(16) and not p.fits(1e-6)
  assert "fits H100-80GB" in memory.report(p)
  # The sequence axis (2) halves a device's tokens, queries and logits; one layer's keys and values
  # (K/t = 1 head of H per row) are gathered whole.
  q = memory.plan(mc, dict(mesh, sequence=2), rows_per_update=8, num_microbatches=2, prompt_len=6,
                  completion_len=10, gen_rows=16)
  gathered = 2 * 2 * T * 1 * H * 4
  assert q.activations_remat == (L * 2 * T / 2 * D * 4 + 2 * T / 2 * per_token_layer + scores / 2 + logits / 2
                                 + gathered)
  assert q.devices == 2 * p.devices


# --- the plan against XLA's own accounting of the compiled train step ---------------------------
# memory_analysis() gives per-device bytes of the step's arguments (train state + batch) and of its
# temporaries (gradients, activations and scratch). Measured ratios compiled/plan (XLA:CPU, 4-layer
# D=64 model, 16 rows of 64 tokens; the test's 2-layer model passes the same bands): arguments
# 1.00; temporaries 1.59-1.70 (remat none), 1.15-1.32 (full), 0.98-1.07 (dots); 2.4-2.5 on a 2x2
# (fsdp x tensor) mesh, where XLA keeps gathered copies the plan does not count. The bands below
# hold those with margin; the scaling checks are tighter.

MEM_CFG = dict(vocab_size=256, embed_dim=64, mlp_dim=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
ROWS, PROMPT, COMPLETION = 16, 16, 48
TEMP_BANDS = {"none": (1.2, 2.2), "full": (0.9, 1.7), "dots": (0.8, 1.4)}


def compiled(mc, mesh_shape, rows, num_microbatches):
  """(argument bytes minus the batch, temporary bytes) per device of the compiled train step."""
  import math

  import jax.numpy as jnp

  from dapo_jax import objectives, optim, sharding, train_step
  from dapo_jax.datatypes import RLBatch
  mesh = sharding.make_mesh(mesh_shape, jax.devices()[:math.prod(mesh_shape.values())])
  trainer = train_step.Trainer(mc, optim.OptimConfig(lr=1e-3, warmup_steps=0), mesh,
                               objectives.policy_gradient(mc, objectives.PGConfig()), num_microbatches=num_microbatches)
  state = jax.eval_shape(lambda: trainer.init(jax.random.key(0)))
  T, S = PROMPT + COMPLETION, jax.ShapeDtypeStruct
  batch = RLBatch(tokens_BT=S((rows, T), jnp.int32), mask_BT=S((rows, T), jnp.bool_),
                  loss_mask_BC=S((rows, COMPLETION), jnp.bool_), old_logp_BC=S((rows, COMPLETION), jnp.float32),
                  adv_B=S((rows,), jnp.float32), ref_logp_BC=S((rows, COMPLETION), jnp.float32))
  shards = mesh_shape["data"] * mesh_shape["fsdp"]
  batch_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(batch)) / shards
  ma = trainer.lower_step(state, batch).compile().memory_analysis()
  return ma.argument_size_in_bytes - batch_bytes, ma.temp_size_in_bytes


def planned(mc, mesh_shape, rows, num_microbatches):
  p = memory.plan(mc, mesh_shape, rows_per_update=rows, num_microbatches=num_microbatches, prompt_len=PROMPT,
                  completion_len=COMPLETION, gen_rows=rows)
  return p.params + p.optimizer, p.gradients + {"none": p.activations_no_remat, "full": p.activations_remat,
                                                 "dots": p.activations_dots}[mc.remat]


@pytest.mark.slow  # Four compilations: 15-60 s on 2 shared cores.
def test_plan_against_compiled_memory_analysis():
  one = {"data": 1, "fsdp": 1, "tensor": 1}
  temp = {}
  for remat in ("none", "full", "dots"):
    mc = testing.tiny_model_config(**MEM_CFG, remat=remat)
    (state_c, temp_c), (state_p, temp_p) = compiled(mc, one, ROWS, 1), planned(mc, one, ROWS, 1)
    # Parameters + AdamW moments: within 1% (the optimizer's step count and hyper-parameters are extra).
    assert abs(state_c / state_p - 1) < 0.01, (remat, state_c, state_p)
    lo, hi = TEMP_BANDS[remat]
    assert lo < temp_c / temp_p < hi, (remat, temp_c, temp_p, temp_c / temp_p)
    temp[remat] = temp_c, temp_p
  # Both orders the three choices the same way: no remat > dots > full.
  assert temp["none"][0] > temp["dots"][0] > temp["full"][0]
  assert temp["none"][1] > temp["dots"][1] > temp["full"][1]
  # Two micro-batches roughly halve the temporaries, in both accountings (measured 0.53 and 0.52).
  mc = testing.tiny_model_config(**MEM_CFG)
  half_c, half_p = compiled(mc, one, ROWS, 2)[1] / temp["none"][0], planned(mc, one, ROWS, 2)[1] / temp["none"][1]
  assert 0.4 < half_c < 0.65 and abs(half_c / half_p - 1) < 0.15, (half_c, half_p)


@pytest.mark.slow
def test_sharded_plan_against_compiled_memory_analysis():
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 host devices (XLA_FLAGS=--xla_force_host_platform_device_count=4 or more)")
  mc = testing.tiny_model_config(**MEM_CFG)
  mesh = {"data": 1, "fsdp": 2, "tensor": 2}
  (state_c, temp_c), (state_p, temp_p) = compiled(mc, mesh, ROWS, 1), planned(mc, mesh, ROWS, 1)
  assert abs(state_c / state_p - 1) < 0.015, (state_c, state_p)   # 1/4 of the state per device
  assert 1.0 < temp_c / temp_p < 3.5, (temp_c, temp_p)            # measured 2.53


def test_moe_plan_by_hand():
  """Experts split over the expert axis; router probabilities kept; one block's dispatch buffers."""
  import dataclasses
  mc = dataclasses.replace(testing.tiny_model_config(vocab_size=128), arch="qwen3_moe", qk_norm=True, qkv_bias=False,
                           num_experts=8, experts_per_token=2, expert_mlp_dim=16, dense_layers=(0,), expert_chunk=4)
  mesh = {"data": 1, "fsdp": 1, "expert": 2, "tensor": 2}
  p = memory.plan(mc, mesh, rows_per_update=8, num_microbatches=2, prompt_len=6, completion_len=10, gen_rows=16)
  D, F, N, K, H, L, V, T, E, k, Fe = 32, 64, 4, 2, 8, 2, 128, 16, 8, 2, 16
  experts = E * D * (1 + 3 * Fe)  # Layer 1's router and experts.
  assert mc.num_expert_params == experts
  n = (mc.num_params - experts) / 2 + experts / 4   # tensor 2; experts also over expert 2
  assert p.params == n * 4 and p.optimizer == 2 * n * 4 and p.experts_per_device == 4
  # 8 rows / 2 micro-batches / 2 batch shards (expert is one) = 2 rows of 16 tokens per device.
  dense = 4 * (4 * D + (2 * N * H + 2 * K * H + 3 * F) / 2)
  moe = 4 * (4 * D + (2 * N * H + 2 * K * H) / 2) + 4 * E
  dispatch = 2 * 2 * 4 * k * 4 * (2 * D + 3 * Fe / 2)  # Both passes; 2 devices x a 4-token block x k rows.
  assert p.dispatch == dispatch
  scores, logits = 2 * 4 * 2 * (N / 2) * T * T, 2 * 4 * 2 * 10 * V / 2
  assert p.activations_no_remat == 2 * T * (dense + moe) + L * scores + logits + dispatch
  assert p.activations_remat == L * 2 * T * D * 4 + 2 * T * max(dense, moe) + scores + logits + dispatch
  report = memory.report(p)
  assert "experts per device" in report and "of which expert dispatch" in report
