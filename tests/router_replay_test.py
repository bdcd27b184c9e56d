"""Routing replay (R3 / R2) in the model: tokens routed to recorded experts, gated by the router's own
probabilities of them; per-token experts emitted; the agreement statistics by hand."""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from dapo_jax import builders, metrics, objectives, packing
from dapo_jax.datatypes import RLBatch
from dapo_jax.model import layers
from dapo_jax.model import transformer as model
from tests.packing_test import MOE, _assert_parts_make_the_batch, long_tail_batch

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
  leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
  router = [v for path, v in leaves if "router_DE" in jax.tree_util.keystr(path)]
  assert router and all(float(jnp.abs(g).max()) > 0 for g in router)


def moe_run_cfg(replay: str, kv_dtype: str = "bfloat16", dtype: str = "bfloat16"):
  cfg = default.get_config("runlocal")
  cfg.model.update(init="random", arch="qwen3_moe", qk_norm=True, num_experts=8, experts_per_token=2,
                   expert_mlp_dim=32, norm_topk_prob=True, router_replay=replay, dtype=dtype)
  cfg.reward.update(fn="dapo_jax.testing:length_reward", workers=1)
  cfg.rollout.kv_cache_dtype = kv_dtype  # a bfloat16 cache: the sampler's routing drifts from the update's
  cfg.train.update(num_steps=2, eval_every=0, log_samples_every=0, minibatches=1)
  cfg.data.num_eval = 0
  return cfg


@pytest.mark.parametrize("sampler", ["same", "perturbed"])
def test_the_engine_records_the_experts_and_a_replaying_forward_routes_every_token_to_them(tmp_path, sampler):
  """The sampler's own params: its records are the experts a teacher-forced forward over prompt +
  completion chooses. A sampler that computes differently (here: its routers' weights perturbed by 5%,
  as another engine's kernels would move them): some choices differ, and the replaying forward sends
  every recorded token to the sampler's experts (counted: 100%)."""
  cfg = moe_run_cfg("R3", kv_dtype="", dtype="float32")
  with builders.dapo(cfg, str(tmp_path / "run")) as run:
    params = run.state.params
    sampling = params
    if sampler == "perturbed":
      noise = lambda path, x: x * (1 + 0.05 * jax.random.normal(jax.random.key(1), x.shape)) if "router_DE" in (
          jax.tree_util.keystr(path)) else x
      sampling = jax.tree_util.tree_map_with_path(noise, params)
    groups, _ = run.rollout.groups(sampling, run.data_iter.take(4), cfg.rollout.group_size, jax.random.key(0))
    model_cfg = run.rollout.model_cfg
  Q, G, C = groups.tokens_QGC.shape
  L, k = groups.experts_QGCLk.shape[-2:]
  assert (L, k) == (model_cfg.num_moe_layers, 2)
  P = groups.prompt_QP.shape[1]
  tokens = jnp.asarray(np.concatenate([np.repeat(groups.prompt_QP, G, 0), groups.tokens_QGC.reshape(-1, C)], 1))
  mask = jnp.asarray(np.concatenate([np.repeat(groups.prompt_mask_QP, G, 0), groups.mask_QGC.reshape(-1, C)], 1))
  recorded = groups.experts_QGCLk.reshape(-1, C, L, k)
  real = groups.mask_QGC.reshape(-1, C)
  assert (recorded[~real] == -1).all() and (recorded[real] >= 0).all()  # every fed token, nothing past the end
  routes = jnp.asarray(np.concatenate([np.full((Q * G, P, L, k), -1), recorded], 1))
  agree, gap = {}, {}
  for replay in (False, True):
    logits, stats = model.logits(model_cfg, params, tokens, mask, with_router=True, emit_experts=True,
                                 routes_BTLk=routes, replay=replay)
    used = np.sort(np.asarray(stats["experts"])[:, P:], -1)
    agree[replay] = (used == np.sort(recorded, -1)).all(-1)[real].mean()
    z = np.asarray(logits, np.float64)[:, P - 1:-1] / cfg.rollout.temperature
    logp = np.take_along_axis(z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
                              - z.max(-1, keepdims=True), np.asarray(tokens)[:, P:, None], -1)[..., 0]
    gap[replay] = np.abs(logp - groups.logp_QGC.reshape(-1, C))[real].mean()  # the sampler-vs-trainer gap
  assert agree[True] == 1.0
  if sampler == "same":
    assert agree[False] > 0.99 and gap[False] < 1e-4 and gap[True] < 1e-4, (agree, gap)
  else:  # Replay leaves the gates' share of the gap: the mismatch falls, not to 0.
    assert 0.5 < agree[False] < 0.99 and gap[True] < 0.8 * gap[False], (agree, gap)


def test_r3_replays_every_recorded_token_and_the_mismatch_falls(tmp_path):
  """Same first rollout (the sampler does not read the mode); with R3 the π_old pass routes the
  completion tokens as the sampler did, so its log-probs come closer to the sampler's."""
  logged = {}
  for mode in ("disabled", "R3"):
    workdir = str(tmp_path / mode)
    builders.run(moe_run_cfg(mode), workdir)
    logged[mode] = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  off, r3 = logged["disabled"][1], logged["R3"][1]
  assert off["critic/score/mean"] == r3["critic/score/mean"]  # the same samples
  assert r3["router/replayed_tokens"] == 1.0 and "router/replayed_tokens" not in off
  assert 0.5 < r3["actor/router/replay_agreement"] <= 1.0, r3["actor/router/replay_agreement"]
  assert r3["actor/mismatch/k3"] <= off["actor/mismatch/k3"], (r3["actor/mismatch/k3"], off["actor/mismatch/k3"])
  assert all(np.isfinite(logged["R3"][s]["actor/pg_loss"]) for s in (1, 2))


@pytest.mark.parametrize("group_size", [0, 2])
def test_the_r2_pass_gives_the_log_probs_and_the_experts_of_the_forward(group_size):
  """π_old's pass under R2: its log-probs are the plain pass's, and each completion token's experts
  those a forward over prompt + completion chooses (the last column, never fed: -1); rows or shared prompts."""
  cfg = dataclasses.replace(CFG, router_replay="R2")
  params, _, _ = setup(cfg)
  rng = np.random.default_rng(5)
  B, P, C = 4, 5, 6
  tokens = jnp.asarray(rng.integers(1, CFG.vocab_size, size=(B, P + C)), jnp.int32)
  if group_size:  # rows of a group share their prompt
    tokens = tokens.at[1].set(tokens[1].at[:P].set(tokens[0, :P])).at[3].set(tokens[3].at[:P].set(tokens[2, :P]))
  mask = jnp.asarray(np.arange(P + C)[None] >= np.array([[0], [0], [2], [2]]))
  batch = RLBatch(tokens_BT=tokens, mask_BT=mask, loss_mask_BC=mask[:, P:], old_logp_BC=jnp.zeros((B, C)),
                  adv_B=jnp.zeros(B), ref_logp_BC=jnp.zeros((B, C)))
  logp, experts = objectives.completion_logprobs_and_experts(cfg, 1.0, group_size)(params, batch)
  np.testing.assert_allclose(logp, objectives.completion_logprobs(cfg, 1.0, group_size)(params, batch), atol=1e-5)
  _, stats = model.logits(cfg, params, tokens, mask, with_router=True, emit_experts=True)
  want = np.asarray(stats["experts"])[:, P:]
  np.testing.assert_array_equal(np.sort(experts[:, :-1], -1), np.sort(want[:, :-1], -1))
  assert (np.asarray(experts[:, -1]) == -1).all()


def test_r2_replays_pi_olds_routing_in_the_updates(tmp_path):
  """Two updates per step: the first sees π_old's own params (its top-k holds every record), the
  second moved params (the update's router and π_old's records may part)."""
  cfg = moe_run_cfg("R2", kv_dtype="", dtype="float32")
  cfg.train.minibatches = 2
  workdir = str(tmp_path / "r2")
  builders.run(cfg, workdir)
  logged = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  for s in (1, 2):
    assert 0.5 < logged[s]["actor/router/replay_agreement"] <= 1.0
    assert np.isfinite(logged[s]["actor/pg_loss"]) and "router/replayed_tokens" not in logged[s]


@pytest.mark.parametrize("block", [0, 8])
def test_r3_over_packed_rows_is_the_padded_update(block):
  """Packed rows carry each completion token's record to its packed position: loss, metrics (the
  replay agreement included) and gradients equal the padded rows'; and replaying moved them."""
  cfg = dataclasses.replace(MOE, router_replay="R3")
  batch = long_tail_batch()
  B, C = batch.loss_mask_BC.shape
  rng = np.random.default_rng(7)
  routes = np.stack([rng.permutation(cfg.num_experts)[:2] for _ in range(B * C * cfg.num_moe_layers)])
  routes = routes.reshape(B, C, cfg.num_moe_layers, 2).astype(np.int32)
  batch = batch.replace(routes_BCLk=np.where(np.asarray(batch.mask_BT)[:, -C:, None, None], routes, -1))
  obj = objectives.policy_gradient(cfg, objectives.PGConfig())
  parts = packing.packed_microbatches(batch, max_tokens=256, block=block)
  assert len(parts) == 1 and parts[0].packed.routes_MTLk is not None
  _assert_parts_make_the_batch(obj, batch, parts, cfg)
  plain = objectives.policy_gradient(dataclasses.replace(MOE, router_replay="disabled"), objectives.PGConfig())
  params = model.init_params(cfg, jax.random.key(3))
  replayed = obj.loss(params, parts[0], obj.counts(parts[0]))[0]
  assert abs(float(plain.loss(params, parts[0], plain.counts(parts[0]))[0]) - float(replayed)) > 1e-6


@pytest.mark.parametrize("block", [0, 8])
def test_r2_over_packed_rows_is_the_padded_update(block):
  """R2 on packed rows: π_old's pass over each packed micro-batch gives the padded pass's log-probs and
  each fed completion token's experts (-1 where no forward feeds it), puts the same records at their
  packed positions, and the update replaying them equals the padded rows' (loss, metrics, gradients)."""
  from tests.packing_test import rows_of
  cfg = dataclasses.replace(MOE, router_replay="R2")
  batch = long_tail_batch()
  B, C = batch.loss_mask_BC.shape
  P = batch.tokens_BT.shape[1] - C
  params = model.init_params(cfg, jax.random.key(3))
  r2_pass = jax.jit(objectives.completion_logprobs_and_experts(cfg, 1.0))
  old, experts = (np.asarray(x) for x in r2_pass(params, batch))
  for budget, count in ((64, 2), (256, 1)):  # The load statistics are a micro-batch's: the update is compared whole.
    parts = []
    for part in packing.packed_microbatches(batch, max_tokens=budget, block=block):
      old_p, experts_p, routes_p = (np.asarray(x) for x in r2_pass(params, part))
      Cb = part.loss_mask_BC.shape[1]
      fed = 0
      for slot, b in enumerate(rows_of(batch, part)):
        if b < 0:
          continue
        fed_C = np.asarray(batch.mask_BT)[b, P:P + Cb] & (np.arange(Cb) < C - 1)
        np.testing.assert_allclose(old_p[slot][fed_C], old[b, :Cb][fed_C], atol=1e-5)
        np.testing.assert_array_equal(np.sort(experts_p[slot][fed_C], -1), np.sort(experts[b, :Cb][fed_C], -1))
        assert (experts_p[slot][~fed_C] == -1).all()
        fed += fed_C.sum()
      # At their packed positions: one record per fed completion token, none elsewhere.
      assert ((routes_p >= 0).all((-2, -1)) == (routes_p >= 0).any((-2, -1))).all()
      assert (routes_p >= 0).all((-2, -1)).sum() == fed
      assert (routes_p[np.asarray(part.packed.segments_MT) == 0] == -1).all()
      parts.append(part.replace(old_logp_BC=old_p, routes_BCLk=experts_p,
                                packed=part.packed.replace(routes_MTLk=routes_p)))
    assert len(parts) == count
  obj = objectives.policy_gradient(cfg, objectives.PGConfig())
  _assert_parts_make_the_batch(obj, batch.replace(old_logp_BC=old, routes_BCLk=experts), parts, cfg)
  # At moved params (a later update's), the records route the tokens, not the moved routers.
  moved = jax.tree_util.tree_map_with_path(lambda path, x: x + 0.5 * jax.random.normal(jax.random.key(1), x.shape)
                                           if "router" in jax.tree_util.keystr(path) else x, params)
  plain = objectives.policy_gradient(dataclasses.replace(MOE, router_replay="disabled"), objectives.PGConfig())
  assert abs(float(plain.loss(moved, parts[0], plain.counts(parts[0]))[0])
             - float(obj.loss(moved, parts[0], obj.counts(parts[0]))[0])) > 1e-6


def test_an_r2_run_with_packed_rows_is_the_padded_run(tmp_path):
  """Two rollout steps of two updates each, R2, packed and padded: every update's loss, replay agreement
  and gradient norm agree."""
  logged = {}
  for packed in (False, True):
    cfg = moe_run_cfg("R2", kv_dtype="", dtype="float32")
    cfg.train.update(minibatches=2, packing=packed, num_microbatches=0)
    workdir = str(tmp_path / str(packed))
    builders.run(cfg, workdir)
    logged[packed] = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  for s in (1, 2):
    for key in ("actor/pg_loss", "actor/router/replay_agreement", "actor/grad_norm"):
      np.testing.assert_allclose(logged[True][s][key], logged[False][s][key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert 0.5 < logged[True][s]["actor/router/replay_agreement"] <= 1.0


@pytest.mark.parametrize("packed", [False, True])
def test_r2_with_a_token_level_estimator_replays_the_advantage_passs_routing(tmp_path, packed):
  """REINFORCE++ takes π_old in its advantage pass: under R2 that pass records the experts, every update
  replays them (the agreement is logged), and the run's updates are those of the padded rows."""
  logged = {}
  for layout in sorted({False, packed}):
    cfg = moe_run_cfg("R2", kv_dtype="", dtype="float32")
    cfg.dapo.adv_estimator = "reinforce_pp"
    cfg.train.update(minibatches=2, packing=layout, num_microbatches=0)
    workdir = str(tmp_path / str(layout))
    builders.run(cfg, workdir)
    logged[layout] = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  for s in (1, 2):
    assert 0.5 < logged[packed][s]["actor/router/replay_agreement"] <= 1.0
    for key in ("actor/pg_loss", "actor/router/replay_agreement", "actor/grad_norm"):
      np.testing.assert_allclose(logged[packed][s][key], logged[False][s][key], rtol=1e-4, atol=1e-6, err_msg=key)
