"""Routing replay (R3 / R2) in the model: tokens routed to recorded experts, gated by the router's own
probabilities of them; per-token experts emitted; the agreement statistics by hand."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax.model import layers
from dapo_jax.model import transformer as model

CFG = model.ModelConfig(
    vocab_size=61, embed_dim=32, mlp_dim=48, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, arch="qwen3_moe",
    qk_norm=True, num_experts=6, experts_per_token=2, expert_mlp_dim=16, norm_topk_prob=True, dense_layers=(1,))


def setup(cfg=CFG, B=3, T=7, seed=0):
  params = model.init_params(cfg, jax.random.key(seed))
  params = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 3 else x, params)  # Routing that decides the output.
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, size=(B, T)), jnp.int32)
  mask = jnp.asarray(np.arange(T)[None] >= np.array([[0], [2], [1]])[:B])  # left padding
  return params, tokens, mask


@pytest.mark.parametrize("norm_topk", [True, False])
def test_route_replays_recorded_experts_gated_by_its_own_probabilities(norm_topk):
  cfg = dataclasses.replace(CFG, norm_topk_prob=norm_topk)
  rng = np.random.default_rng(1)
  p = {"router_DE": jnp.asarray(rng.normal(size=(32, 6)), jnp.float32)}
  h = jnp.asarray(rng.normal(size=(5, 32)), jnp.float32)
  replay = jnp.asarray([[4, 1], [-1, -1], [0, 5], [2, 3], [-1, -1]], jnp.int32)
  probs, experts, gates = layers.route(cfg, p, h, replay)
  own_probs, own_experts, own_gates = layers.route(cfg, p, h)
  logits = np.asarray(h, np.float64) @ np.asarray(p["router_DE"], np.float64)
  want_probs = np.exp(logits - logits.max(-1, keepdims=True))
  want_probs /= want_probs.sum(-1, keepdims=True)
  np.testing.assert_allclose(probs, want_probs, rtol=1e-5)
  for x in range(5):
    if replay[x, 0] >= 0:
      want = want_probs[x, np.asarray(replay[x])]
      np.testing.assert_array_equal(experts[x], replay[x])
      np.testing.assert_allclose(gates[x], want / want.sum() if norm_topk else want, rtol=1e-5)
    else:  # No record: its own top-k.
      np.testing.assert_array_equal(experts[x], own_experts[x])
      np.testing.assert_allclose(gates[x], own_gates[x])


def test_replaying_a_forwards_own_experts_changes_nothing_and_other_experts_do():
  params, tokens, mask = setup()
  plain, stats = model.logits(CFG, params, tokens, mask, with_router=True, emit_experts=True)
  own = stats["experts"]
  assert own.shape == (3, 7, 2, 2) and own.dtype == jnp.int32
  replayed, rstats = model.logits(CFG, params, tokens, mask, with_router=True, routes_BTLk=own, replay=True)
  np.testing.assert_allclose(replayed, plain, rtol=1e-5, atol=1e-5)
  real = np.asarray(mask)
  np.testing.assert_allclose(rstats["agree_L"], [real.sum()] * 2)  # Its own top-k holds every record.
  np.testing.assert_allclose(rstats["recorded_L"], [real.sum()] * 2)
  # Other experts for the last token of each row, in the second expert layer only.
  other = np.asarray(own).copy()
  other[:, -1, 1] = (other[:, -1, 1] + 1) % CFG.num_experts
  moved = model.logits(CFG, params, tokens, mask, routes_BTLk=jnp.asarray(other), replay=True)
  diff = np.abs(np.asarray(moved) - np.asarray(plain)).max(-1)
  assert (diff[:, :-1] < 1e-5).all() and (diff[:, -1] > 1e-4).all()  # Causal: the last position alone moved.
  # Without `replay` the records are only compared: the output is the plain one.
  compared, cstats = model.logits(CFG, params, tokens, mask, with_router=True, routes_BTLk=jnp.asarray(other))
  np.testing.assert_allclose(compared, plain, rtol=1e-5, atol=1e-5)


def test_agreement_counts_the_recorded_experts_the_top_k_holds_by_hand():
  params, tokens, mask = setup()
  _, stats = model.logits(CFG, params, tokens, mask, with_router=True, emit_experts=True)
  own = np.asarray(stats["experts"])
  rng = np.random.default_rng(3)
  routes = rng.integers(0, CFG.num_experts, size=own.shape)
  routes[:, :2] = -1  # no record for the first two positions
  _, got = model.logits(CFG, params, tokens, mask, with_router=True, routes_BTLk=jnp.asarray(routes))
  real = np.asarray(mask).astype(bool)
  for l in range(2):
    hits = tokens_ = 0.0
    for b in range(3):
      for t in range(7):
        if real[b, t] and routes[b, t, l, 0] >= 0:
          hits += np.mean([e in own[b, t, l] for e in routes[b, t, l]])
          tokens_ += 1
    np.testing.assert_allclose(got["agree_L"][l], hits, rtol=1e-6)
    np.testing.assert_allclose(got["recorded_L"][l], tokens_)


def test_the_router_still_learns_under_replay():
  params, tokens, mask = setup()
  _, stats = model.logits(CFG, params, tokens, mask, with_router=True, emit_experts=True)
  routes = (stats["experts"] + 1) % CFG.num_experts

  def loss(p):
    return jnp.sum(model.logits(CFG, p, tokens, mask, routes_BTLk=routes, replay=True)[..., 0])

  grads = jax.grad(loss)(params)
  router = [v for path, v in jax.tree_util.tree_flatten_with_path(grads)[0] if "router_DE" in jax.tree_util.keystr(path)]
  assert router and all(float(jnp.abs(g).max()) > 0 for g in router)
