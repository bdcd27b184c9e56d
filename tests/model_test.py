"""Model properties that need no reference implementation: causality, remat, padding, cache."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax import testing
from dapo_jax.model import decode, kv_cache, layers
from dapo_jax.model import transformer as model
from dapo_jax.rollout import sampling

CFG = testing.tiny_model_config(vocab_size=40)
PARAMS = model.init_params(CFG, jax.random.key(0))


def test_causal_by_gradient():
  cfg = testing.tiny_model_config(vocab_size=40, tie_embeddings=False)  # Untied: embed_VD is input only.
  params = model.init_params(cfg, jax.random.key(1))
  tokens = jnp.arange(1, 9)[None] % cfg.vocab_size
  mask = jnp.ones((1, 8), bool)

  def out_at(x_emb, t):
    # Gradient of the logits at position t w.r.t. the input embedding of every position.
    p = dict(params, embed_VD=x_emb)
    return model.logits(cfg, p, tokens, mask)[0, t].sum()
  g = jax.grad(out_at)(params["embed_VD"], 3)
  touched = np.abs(np.asarray(g)).sum(-1) > 0
  assert touched[np.asarray(tokens[0, :4])].all()
  assert not touched[np.asarray(tokens[0, 4:])].any()


def test_appending_tokens_keeps_prefix_logits():
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, size=(2, 10)))
  mask = jnp.ones((2, 10), bool)
  full = model.logits(CFG, PARAMS, tokens, mask)
  prefix = model.logits(CFG, PARAMS, tokens[:, :6], mask[:, :6])
  np.testing.assert_allclose(full[:, :6], prefix, atol=1e-5)


def test_remat_and_jit_do_not_change_outputs_or_grads():
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, size=(2, 7)))
  mask = jnp.ones((2, 7), bool)
  loss = lambda cfg, p: model.logits(cfg, p, tokens, mask).sum()
  base_val, base_grad = jax.value_and_grad(lambda p: loss(CFG, p))(PARAMS)
  for remat in ("full", "dots"):
    cfg = testing.tiny_model_config(vocab_size=40, remat=remat)
    val, grad = jax.jit(jax.value_and_grad(lambda p: loss(cfg, p)))(PARAMS)
    np.testing.assert_allclose(val, base_val, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), grad, base_grad)


@pytest.mark.parametrize("overrides", [{}, dict(num_kv_heads=1, qkv_bias=False, tie_embeddings=False),
                                       dict(matmul_dtype="bfloat16")])
def test_cached_decode_matches_full_forward(overrides):
  cfg = testing.tiny_model_config(vocab_size=40, **overrides)
  params = model.init_params(cfg, jax.random.key(5))
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, size=(2, 7)))
  mask = jnp.ones((2, 7), bool).at[1, :2].set(False)  # Row 1 is left-padded by two.
  full = model.logits(cfg, params, tokens, mask)
  # Prefill three tokens, then one token at a time through the cache.
  # bf16 operands: a last-bit difference in an activation moves its rounding by one bf16 step.
  atol = 2e-2 if cfg.matmul_dtype else 1e-5
  logits, cache = sampling.prefill(cfg, params, tokens[:, :3], mask[:, :3], cache_size=7)
  np.testing.assert_allclose(logits, full[:, 2], atol=atol)
  dparams = decode.decode_params(cfg, params)
  for t in range(3, 7):
    cache = kv_cache.write_mask(cache, mask[:, t:t + 1], t)
    logits, cache = decode.decode_step(cfg, dparams, tokens[:, t], model.positions(mask)[:, t], cache, t)
    np.testing.assert_allclose(logits, full[:, t], atol=atol)


def test_bf16_compute_close_to_fp32():
  """bf16 activations change the logits by about bf16's unit roundoff (2^-8), no more, no less."""
  cfg = testing.tiny_model_config(vocab_size=40, dtype="bfloat16")
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, 40, size=(2, 5)))
  mask = jnp.ones((2, 5), bool)
  out = model.logits(cfg, PARAMS, tokens, mask)
  assert out.dtype == jnp.float32  # Logits stay fp32 whatever the compute dtype.
  ref = np.asarray(model.logits(CFG, PARAMS, tokens, mask), np.float64)
  rel = np.abs(np.asarray(out, np.float64) - ref).mean() / np.abs(ref).mean()
  u = 2.0 ** -8
  # Measured: 4.0e-3. Below u/10 bf16 was not applied (fp32 noise is ~1e-7); above 4u it loses accuracy.
  assert u / 10 < rel < 4 * u, rel
  np.testing.assert_allclose(out, ref, atol=0.05)


def _bf16(a):
  return np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("operand", ["float32", "bfloat16"])
def test_matmul_and_its_gradients_against_float64(operand):
  """`layers.matmul` multiplies operands rounded to `matmul_dtype` with fp32 accumulation, forward
  and backward: input gradient from the rounded cotangent and weight, weight gradient in fp32."""
  cfg = testing.tiny_model_config(vocab_size=40, matmul_dtype=operand)
  rng = np.random.default_rng(7)
  x, w, g = (rng.standard_normal(s).astype(np.float32) for s in [(6, 3, 4), (3, 4, 5), (6, 5)])
  y, vjp = jax.vjp(lambda x, w: layers.matmul("XNH,NHD->XD", x, w, cfg), jnp.asarray(x), jnp.asarray(w))
  dx, dw = vjp(jnp.asarray(g))
  r = _bf16 if operand == "bfloat16" else (lambda a: np.asarray(a, np.float64))
  np.testing.assert_allclose(y, np.einsum("xnh,nhd->xd", r(x), r(w)), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx, np.einsum("xd,nhd->xnh", r(g), r(w)), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, np.einsum("xnh,xd->nhd", r(x), np.float64(g)), rtol=1e-5, atol=1e-5)
  assert y.dtype == dx.dtype == dw.dtype == jnp.float32


def test_bf16_matmuls_close_to_fp32_outputs_and_grads():
  cfg = testing.tiny_model_config(vocab_size=40, matmul_dtype="bfloat16", remat="dots")
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, 40, size=(2, 6)))
  mask = jnp.ones((2, 6), bool)
  loss = lambda cfg, p: jax.nn.log_softmax(model.logits(cfg, p, tokens, mask)).mean()
  val, grad = jax.jit(jax.value_and_grad(lambda p: loss(cfg, p)))(PARAMS)
  ref_val, ref_grad = jax.value_and_grad(lambda p: loss(CFG, p))(PARAMS)
  np.testing.assert_allclose(val, ref_val, rtol=1e-2)
  for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad)):
    assert a.dtype == jnp.float32
    np.testing.assert_allclose(a, b, atol=2e-2 * np.abs(b).max() + 1e-6)


def test_bad_dtype_name_names_the_field():
  with pytest.raises(ValueError, match="matmul_dtype='bf'"):
    testing.tiny_model_config(vocab_size=40, matmul_dtype="bf")


def test_param_count():
  n = sum(x.size for x in jax.tree.leaves(PARAMS))
  assert n == CFG.num_params


def test_chunked_attention_matches_whole_rows():
  cfg = testing.tiny_model_config(vocab_size=40, attn_chunk=4)
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, 40, size=(2, 12)))
  mask = jnp.asarray(np.arange(12)[None] >= np.array([[0], [5]]))  # one left-padded row
  loss = lambda c, p: (model.logits(c, p, tokens, mask) * mask[..., None]).sum()
  v1, g1 = jax.value_and_grad(lambda p: loss(CFG, p))(PARAMS)
  v2, g2 = jax.value_and_grad(lambda p: loss(cfg, p))(PARAMS)
  np.testing.assert_allclose(v1, v2, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), g1, g2)


@pytest.mark.parametrize("layout", ["rows", "shared_prompt"])
def test_chunked_attention_of_any_length_and_layout_matches_whole_rows(layout):
  """attn_chunk = 4 on rows of 11 tokens (not a multiple of 4: the last block padded), and on the
  shared-prompt layout an RL update reads (2 prompts of 6 positions, 2 completions each of 7 tokens
  in blocks of 4), with a sliding-window layer: the logits and gradients of whole rows."""
  kw = dict(arch="gemma3", qk_norm=True, qkv_bias=False, local_layers=(0,), sliding_window=3, query_scale=16.0,
            rope_local_theta=10_000.0)
  whole = testing.tiny_model_config(vocab_size=40, **kw)
  chunked = dataclasses.replace(whole, attn_chunk=4)
  params = model.init_params(whole, jax.random.key(1))
  rng = np.random.default_rng(5)
  if layout == "rows":
    tokens = jnp.asarray(rng.integers(0, 40, size=(2, 11)))
    mask = jnp.asarray(np.arange(11)[None] >= np.array([[0], [4]]))
    out = lambda c, p: model.logits(c, p, tokens, mask) * mask[..., None]
  else:
    prompt, pmask = jnp.asarray(rng.integers(0, 40, size=(2, 6))), jnp.asarray(np.arange(6)[None] >= np.array([[0], [2]]))
    comp = jnp.asarray(rng.integers(0, 40, size=(4, 7)))
    cmask = jnp.asarray(np.arange(7)[None] < np.array([[7], [3], [5], [7]]))
    out = lambda c, p: model.completion_logits(c, p, prompt, pmask, comp, cmask) * cmask[..., None]
  np.testing.assert_allclose(out(chunked, params), out(whole, params), atol=1e-5)
  loss = lambda c: jax.value_and_grad(lambda p: jnp.sum(out(c, p) ** 2) / 100)(params)
  (v1, g1), (v2, g2) = loss(whole), loss(chunked)
  np.testing.assert_allclose(v2, v1, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), g2, g1)
