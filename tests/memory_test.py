"""The memory plan against hand-computed byte counts."""
from dapo_jax import memory, testing


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
