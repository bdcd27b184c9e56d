"""Weight-only int8: quantization and the dequantizing matmul against float64 references."""
import jax
import jax.numpy as jnp
import numpy as np

from dapo_jax import testing
from dapo_jax.model import layers, lora, memory, quant
from dapo_jax.model import transformer as model

CFG = testing.tiny_model_config(vocab_size=64)


def reference_quantize(w64, num_in):
  """Per-output-channel symmetric int8 of [L, in.., out..] in float64."""
  axes = tuple(range(1, 1 + num_in))
  amax = np.abs(w64).max(axis=axes, keepdims=True)
  scale = np.where(amax > 0, amax / 127.0, 1.0)
  return np.clip(np.round(w64 / scale), -127, 127), scale


def test_quantize_matches_a_float64_reference():
  rng = np.random.default_rng(0)
  w = rng.normal(size=(2, 4, 3, 5)).astype(np.float32)   # [L, N, H, D]: wo_NHD, two input axes
  w[1, :, :, 2] = 0.0                                      # an all-zero output channel
  q = quant.quantize(jnp.asarray(w), num_in=2)
  q64, scale64 = reference_quantize(w.astype(np.float64), 2)
  assert q["int8"].dtype == jnp.int8 and q["scale"].shape == (2, 5)
  np.testing.assert_array_equal(np.asarray(q["int8"]), q64)
  np.testing.assert_allclose(np.asarray(q["scale"]), scale64[:, 0, 0], rtol=1e-7)
  # Round-to-nearest: the error is at most half a step of each channel.
  err = np.abs(np.asarray(quant.dequantize(q, 2)) - w)
  assert (err <= 0.5 * scale64 + 1e-7).all()


def test_int8_matmul_matches_a_float64_reference():
  rng = np.random.default_rng(1)
  w = rng.normal(size=(1, 32, 4, 8)).astype(np.float32)   # wq_DNH stacked over one layer
  x = rng.normal(size=(5, 32)).astype(np.float32)
  q = quant.quantize(jnp.asarray(w), num_in=1)
  p = {"wq_DNH": jax.tree.map(lambda a: a[0], q)}
  got = np.asarray(layers.dense("XD,DNH->XNH", jnp.asarray(x), p, "wq_DNH", CFG))
  q64, scale64 = reference_quantize(w.astype(np.float64), 1)
  want = np.einsum("XD,DNH->XNH", x.astype(np.float64), (q64 * scale64)[0])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_int8_base_model_error_is_small():
  params = model.init_params(CFG, jax.random.key(0))
  p = lora.adapt(CFG, lora.LoraConfig(rank=2, base_quant="int8"), params, jax.random.key(1))
  assert all(p["base"]["layers"][n]["int8"].dtype == jnp.int8 for n in quant.MATRICES)
  tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, 64)
  mask = jnp.ones((2, 12), bool)
  lp = jax.nn.log_softmax(model.logits(CFG, params, tokens, mask), -1)
  lq = jax.nn.log_softmax(model.logits(CFG, p, tokens, mask), -1)
  assert 0 < float(jnp.abs(lp - lq).max()) < 1e-2
  # Layer matrices at one byte per weight (plus fp32 scales); the embedding stays fp32.
  assert quant.nbytes(p["base"]) < 0.5 * quant.nbytes(params)


def test_memory_plan_with_lora_by_hand():
  mc = testing.tiny_model_config(vocab_size=128)
  mesh = {"data": 1, "fsdp": 2, "tensor": 2}
  kw = dict(rows_per_update=8, num_microbatches=2, prompt_len=6, completion_len=10, gen_rows=16)
  full = memory.plan(mc, mesh, **kw)
  lcfg = lora.LoraConfig(rank=4, targets=("q_proj", "down_proj"), base_quant="int8")
  p = memory.plan(mc, mesh, lora=lcfg, **kw)
  D, F, N, K, H, L = 32, 64, 4, 2, 8, 2
  adapters = L * ((D * 4 + 4 * N * H) + (F * 4 + 4 * D))          # q: [D, r] + [r, N, H]; down: [F, r] + [r, D]
  assert lora.param_count(mc, lcfg) == adapters
  matrices = L * (D * H * (2 * N + 2 * K) + 3 * D * F)
  scales = L * (H * (N + 2 * K) + 2 * D + 2 * F)
  base = matrices + 4 * scales + 4 * (mc.num_params - matrices)
  assert p.params == base / 4 + adapters * 4 / 4
  assert p.optimizer == 2 * adapters * 4 / 4 and p.gradients == adapters * 4 / 4
  assert p.decode_weights == matrices * 1 / 2  # int8, fused per call; adapters unmerged
  assert memory.plan(mc, mesh, lora=lora.LoraConfig(rank=4), **kw).decode_weights == matrices * 4 / 2  # merged float
  assert p.activations_dots == full.activations_dots and p.kv_cache == full.kv_cache
  assert "LoRA adapters" in memory.report(p) and "LoRA" not in memory.report(full)
