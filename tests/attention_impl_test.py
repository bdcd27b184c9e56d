"""`model.attention_impl`: the `jax.nn.dot_product_attention` core ("xla") against our einsum core,
on the attention alone and through whole models (logits and parameter gradients), for the features
our families use: grouped-query heads, left padding, sliding windows, a query scale, and soft-capping
(which stays on einsum: that API cannot express it)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax import testing
from dapo_jax.model import decode, kv_cache, layers
from dapo_jax.model import transformer as model
from dapo_jax.rollout import sampling


def _qkv(B=2, K=2, R=3, T=6, S=6, H=8, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, K, R, T, H)).astype(np.float32)
  k, v = (rng.standard_normal((B, K, S, H)).astype(np.float32) for _ in range(2))
  return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


def _causal_padded_mask(B, T, pad_B):
  """[B, T, T]: causal over each row's real tokens (row b left-padded by pad_B[b]); padded queries
  see nothing, so their softmax is uniform in both cores."""
  real_BT = np.arange(T)[None, :] >= np.asarray(pad_B)[:, None]
  return jnp.asarray(np.tril(np.ones((T, T), bool))[None] & real_BT[:, None, :] & real_BT[:, :, None])


@pytest.mark.parametrize("window,scale", [(None, None), (3, 5.0 ** -0.5)])
def test_core_matches_einsum_values_and_gradients(window, scale):
  q, k, v = _qkv()
  mask = _causal_padded_mask(2, 6, [0, 2])
  if window:
    mask = layers.windowed(mask, window)
  w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape).astype(np.float32))

  def loss(impl, q, k, v):
    return jnp.sum(w * layers.attention(q, k, v, mask, scale=scale, impl=impl))
  for impl in ("einsum", "xla"):
    out = layers.attention(q, k, v, mask, scale=scale, impl=impl)
    grads = jax.grad(loss, argnums=(1, 2, 3))(impl, q, k, v)
    if impl == "einsum":
      ref_out, ref_grads = out, grads
  np.testing.assert_allclose(out, ref_out, atol=1e-5)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, atol=1e-5)


def test_core_reads_the_decode_cache_layout():
  """One decoded query per row against a [B, K, H, S] key cache, as `decode_step` calls it."""
  q, k, v = _qkv(T=1, S=7)
  mask_B1S = jnp.asarray(np.array([[True] * 7, [False] * 3 + [True] * 4]))[:, None, :]
  k_BKHS = k.transpose(0, 1, 3, 2)
  ref = layers.attention(q, k_BKHS, v, mask_B1S, k_layout="BKHS")
  out = layers.attention(q, k_BKHS, v, mask_B1S, k_layout="BKHS", impl="xla")
  np.testing.assert_allclose(out, ref, atol=1e-5)
  # A bf16 cache under fp32 queries is widened for the API (einsum promotes it the same way).
  ref16 = layers.attention(q, k_BKHS.astype(jnp.bfloat16), v.astype(jnp.bfloat16), mask_B1S, k_layout="BKHS")
  out16 = layers.attention(q, k_BKHS.astype(jnp.bfloat16), v.astype(jnp.bfloat16), mask_B1S, k_layout="BKHS",
                           impl="xla")
  np.testing.assert_allclose(out16, ref16, atol=1e-5)


def test_softcap_falls_back_to_einsum():
  q, k, v = _qkv()
  mask = _causal_padded_mask(2, 6, [0, 1])
  ref = layers.attention(q, k, v, mask, softcap=0.7)
  np.testing.assert_array_equal(layers.attention(q, k, v, mask, softcap=0.7, impl="xla"), ref)


# The families' attention features on tiny models: GQA with biases (Qwen2), MQA (K=1), Gemma 3
# (sliding-window local layers, q/k norms, query scale), a soft-capped Gemma 2-style model, and
# query blocks (attn_chunk).
FAMILIES = {
    "qwen2_gqa": dict(),
    "mqa": dict(num_kv_heads=1, qkv_bias=False, tie_embeddings=False),
    "gemma3_window": dict(arch="gemma3", qk_norm=True, qkv_bias=False, local_layers=(0,), sliding_window=3,
                          query_scale=16.0, rope_local_theta=10_000.0),
    "softcap": dict(arch="gemma3", qkv_bias=False, attn_softcap=5.0, final_softcap=30.0),
    "chunked": dict(attn_chunk=4),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_model_logits_and_gradients_match_einsum(family):
  cfg = testing.tiny_model_config(vocab_size=40, **FAMILIES[family])
  xla = dataclasses.replace(cfg, attention_impl="xla")
  params = model.init_params(cfg, jax.random.key(3))
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, 40, size=(2, 8)))
  mask = jnp.ones((2, 8), bool).at[1, :3].set(False)  # Row 1 is left-padded by three.
  real = np.asarray(mask)

  def loss(c, p):  # Real positions only: a padded query's output is never read.
    return jnp.sum(jnp.where(mask[..., None], model.logits(c, p, tokens, mask), 0.0) ** 2) / 100
  ref_val, ref_grad = jax.value_and_grad(lambda p: loss(cfg, p))(params)
  val, grad = jax.jit(jax.value_and_grad(lambda p: loss(xla, p)))(params)
  np.testing.assert_allclose(model.logits(xla, params, tokens, mask)[real],
                             model.logits(cfg, params, tokens, mask)[real], atol=1e-5)
  np.testing.assert_allclose(val, ref_val, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), grad, ref_grad)


@pytest.mark.parametrize("family", ["qwen2_gqa", "gemma3_window"])
def test_cached_decode_with_xla_core_matches_einsum_forward(family):
  """Prefill 3 tokens, then decode one at a time (past the window of the local layer) through the
  cache with the "xla" core: every step's logits equal the einsum model's full forward."""
  cfg = testing.tiny_model_config(vocab_size=40, **FAMILIES[family])
  xla = dataclasses.replace(cfg, attention_impl="xla")
  params = model.init_params(cfg, jax.random.key(5))
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 40, size=(2, 8)))
  mask = jnp.ones((2, 8), bool).at[1, :2].set(False)
  full = model.logits(cfg, params, tokens, mask)
  logits, cache = sampling.prefill(xla, params, tokens[:, :3], mask[:, :3], cache_size=8)
  np.testing.assert_allclose(logits, full[:, 2], atol=1e-5)
  dparams = decode.decode_params(xla, params)
  for t in range(3, 8):
    cache = kv_cache.write_mask(cache, mask[:, t:t + 1], t)
    logits, cache = decode.decode_step(xla, dparams, tokens[:, t], model.positions(mask)[:, t], cache, t)
    np.testing.assert_allclose(logits, full[:, t], atol=1e-5)


def test_shared_prompt_layout_matches_einsum():
  """The train step's layout: prompts through the selected core, completions (two key blocks, one
  softmax) on einsum; the completion logits match the einsum model's."""
  cfg = testing.tiny_model_config(vocab_size=40, **FAMILIES["gemma3_window"])
  xla = dataclasses.replace(cfg, attention_impl="xla")
  params = model.init_params(cfg, jax.random.key(6))
  rng = np.random.default_rng(7)
  prompt_QP = jnp.asarray(rng.integers(0, 40, size=(2, 5)))
  prompt_mask_QP = jnp.ones((2, 5), bool).at[1, :2].set(False)
  completion_BC = jnp.asarray(rng.integers(0, 40, size=(4, 4)))
  completion_mask_BC = jnp.ones((4, 4), bool).at[3, 2:].set(False)
  args = (params, prompt_QP, prompt_mask_QP, completion_BC, completion_mask_BC)
  np.testing.assert_allclose(model.completion_logits(xla, *args), model.completion_logits(cfg, *args), atol=1e-5)


def test_cudnn_needs_a_16_bit_dtype_and_unknown_impls_fail():
  with pytest.raises(ValueError, match=r"attention_impl='cudnn' runs in bfloat16 or float16 only"):
    testing.tiny_model_config(attention_impl="cudnn")
  with pytest.raises(ValueError, match=r"model\.attention_impl='flash'; expected one of"):
    testing.tiny_model_config(attention_impl="flash")
  testing.tiny_model_config(attention_impl="cudnn", dtype="bfloat16")  # Valid; runs on NVIDIA GPUs only.


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs an NVIDIA GPU")
@pytest.mark.parametrize("T", [128, 127])
def test_cudnn_core_close_to_einsum_in_bf16(T):
  """cuDNN flash attention (the mask as a bias) against the einsum core, both bf16, on a causal,
  left-padded, windowed mask (H=64), values and query gradients; T=127 is a training row of 128
  tokens, which cuDNN's masked kernels take only padded to an even length."""
  q, k, v = (a.astype(jnp.bfloat16) for a in _qkv(B=2, K=2, R=2, T=T, S=T, H=64))
  mask = layers.windowed(_causal_padded_mask(2, T, [0, 16]), 32)
  real = np.asarray(mask).any(-1)  # [B, T]: queries that see at least one key.
  ref = np.asarray(layers.attention(q, k, v, mask).astype(jnp.float32))
  out = np.asarray(layers.attention(q, k, v, mask, impl="cudnn").astype(jnp.float32))
  # Both round probabilities to bf16 before the value matmul; cuDNN's blockwise softmax rounds at
  # other points, so they agree to a few bf16 steps of the output (|o| <~ 3).
  np.testing.assert_allclose(out.transpose(0, 3, 1, 2, 4)[real], ref.transpose(0, 3, 1, 2, 4)[real], atol=3e-2)
  grad = lambda impl: np.asarray(jax.grad(lambda q: jnp.sum(layers.attention(q, k, v, mask, impl=impl).astype(
      jnp.float32) ** 2))(q).astype(jnp.float32)).transpose(0, 3, 1, 2, 4)[real]
  ref_grad = grad("einsum")
  np.testing.assert_allclose(grad("cudnn"), ref_grad, atol=3e-2 * np.abs(ref_grad).max())
