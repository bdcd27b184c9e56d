"""Model properties that need no reference implementation: causality, remat, padding, cache."""
import jax
import jax.numpy as jnp
import numpy as np

from dapo_jax import kv_cache, model, testing

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


def test_cached_decode_matches_full_forward():
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, CFG.vocab_size, size=(2, 6)))
  mask = jnp.ones((2, 6), bool)
  full = model.logits(CFG, PARAMS, tokens, mask)
  cache = kv_cache.init(CFG.num_layers, 2, 6, CFG.num_kv_heads, CFG.head_dim)
  for t in range(6):  # One token at a time through the cache.
    cache = kv_cache.write_mask(cache, mask[:, t:t + 1], t)
    out, cache = model.forward(CFG, PARAMS, tokens[:, t:t + 1], jnp.full((2, 1), t),
                               kv_cache.attention_mask(cache.mask_BS, t, 1), cache, t)
    np.testing.assert_allclose(out[:, 0], full[:, t], atol=1e-5)


def test_bf16_compute_close_to_fp32():
  cfg = testing.tiny_model_config(vocab_size=40, dtype="bfloat16")
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, 40, size=(2, 5)))
  mask = jnp.ones((2, 5), bool)
  out = model.logits(cfg, PARAMS, tokens, mask)
  assert out.dtype == jnp.float32  # Logits stay fp32 whatever the compute dtype.
  np.testing.assert_allclose(out, model.logits(CFG, PARAMS, tokens, mask), atol=0.05)


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
