"""Qwen3-MoE: the router and the dropless expert dispatch against loops and the `transformers` torch
reference (fp32), HF import and export, cached decode, the load-balancing loss, and the train step
on an expert-parallel mesh against one device."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dapo_jax import loss, objectives, sharding, train_step
from dapo_jax.hf import convert as hf
from dapo_jax.model import layers
from dapo_jax.model import transformer as model
from dapo_jax.rollout import sampling
from tests.families_test import (
  assert_close_on_real,
  assert_decode_and_shared_prompt_match_forward,
  left_padded_batch,
  torch_logits,
)
from tests.train_step_test import LINEAR_OPT, make_batch, one_device_mesh

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 97
CASES = {  # name: Qwen3MoeConfig fields over a 3-layer, 4-expert, top-2 model.
    "all_experts_norm_topk_untied": dict(norm_topk_prob=True, tie_word_embeddings=False),
    "dense_first_layer_raw_topk": dict(mlp_only_layers=[0], norm_topk_prob=False, tie_word_embeddings=False),
    "sparse_step2_norm_topk_tied_top3": dict(decoder_sparse_step=2, norm_topk_prob=True, tie_word_embeddings=True,
                                             num_experts_per_tok=3),
}
TINY = model.ModelConfig(
    vocab_size=V, embed_dim=32, mlp_dim=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, arch="qwen3_moe",
    qk_norm=True, num_experts=4, experts_per_token=2, expert_mlp_dim=16, norm_topk_prob=True)


def make_hf_moe(path, fields, seed=0):
  torch.manual_seed(seed)
  cfg = transformers.Qwen3MoeConfig(**{
      **dict(vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
             rms_norm_eps=1e-6, max_position_embeddings=128, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 5000.0}),
      **fields})
  cfg._attn_implementation = "eager"
  m = transformers.Qwen3MoeForCausalLM(cfg)
  with torch.no_grad():  # Random norms; a router and experts large enough that routing decides the output.
    for name, p in m.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif "mlp.gate.weight" in name or "experts" in name:
        p.copy_(0.3 * torch.randn_like(p))
  m = m.float().eval()
  m.save_pretrained(path)
  return m


@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_matches_transformers(tmp_path, case):
  m = make_hf_moe(str(tmp_path / "hf"), CASES[case])
  cfg, params = hf.load(str(tmp_path / "hf"))
  fields = CASES[case]
  assert (cfg.num_experts, cfg.experts_per_token, cfg.norm_topk_prob) == (
      4, fields.get("num_experts_per_tok", 2), fields["norm_topk_prob"])
  assert cfg.dense_layers == {"all_experts_norm_topk_untied": (), "dense_first_layer_raw_topk": (0,),
                              "sparse_step2_norm_topk_tied_top3": (0, 2)}[case]
  tokens, mask = left_padded_batch()
  ref = torch_logits(m, tokens, mask)
  ours = np.asarray(model.logits(cfg, params, jnp.asarray(tokens), jnp.asarray(mask)))
  assert_close_on_real(ours, ref, mask)
  # The experts matter: with expert 0 silenced, the logits move by far more than the tolerance.
  cut = jax.tree.map(np.array, params)
  for run in cut:
    if run.startswith("layers") and "w_down_EFD" in cut[run]:
      cut[run]["w_down_EFD"][:, 0] = 0
  moved = np.asarray(model.logits(cfg, cut, jnp.asarray(tokens), jnp.asarray(mask)))
  assert np.abs(moved - ours)[mask.astype(bool)].max() > 1e-2

  # Our export: the same model re-imported; transformers loads it (per-expert tensor names) and agrees.
  hf.save(str(tmp_path / "out"), cfg, params)
  cfg2, params2 = hf.load(str(tmp_path / "out"))
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, params2, params)
  names = set(hf.read_safetensors(str(tmp_path / "out" / "model.safetensors")))
  assert {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.3.down_proj.weight"} <= names
  m2 = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32,
                                                         attn_implementation="eager").eval()
  assert type(m2).__name__ == "Qwen3MoeForCausalLM"
  assert_close_on_real(torch_logits(m2, tokens, mask), ref, mask)

  assert_decode_and_shared_prompt_match_forward(cfg, params, tokens, mask, ours)


def test_transformers_fused_expert_tensors_load_too(tmp_path):
  """A checkpoint with transformers 5's in-memory layout (experts.gate_up_proj [E, 2F, D],
  experts.down_proj [E, D, F]) reads as the per-expert one does."""
  m = make_hf_moe(str(tmp_path / "hf"), CASES["dense_first_layer_raw_topk"])
  cfg, params = hf.load(str(tmp_path / "hf"))
  fused = {k: v.detach().numpy() for k, v in m.state_dict().items()}
  assert "model.layers.1.mlp.experts.gate_up_proj" in fused
  hf.write_safetensors(str(tmp_path / "hf" / "model.safetensors"), fused)
  _, params2 = hf.load(str(tmp_path / "hf"))
  jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_dispatch_equals_a_loop_over_tokens():
  """`expert_mlp` against sum_j gate_j * SwiGLU_{e_j}(x) token by token; ids of another shard's
  experts (>= E) contribute nothing; gradients reach every expert that got a token."""
  rng = np.random.default_rng(0)
  X, D, F, E, k = 7, 6, 5, 4, 3
  x = rng.standard_normal((X, D)).astype(np.float32)
  w = {n: rng.standard_normal(s).astype(np.float32) for n, s in
       (("w_gate_EDF", (E, D, F)), ("w_up_EDF", (E, D, F)), ("w_down_EFD", (E, F, D)))}
  expert = np.stack([rng.permutation(E + 2)[:k] for _ in range(X)])  # Some ids are E and E + 1: foreign.
  gate = rng.random((X, k)).astype(np.float32)
  silu = lambda z: z / (1 + np.exp(-z))
  want = np.zeros((X, D))
  for t in range(X):
    for j in range(k):
      e = expert[t, j]
      if e < E:
        want[t] += gate[t, j] * ((silu(x[t] @ w["w_gate_EDF"][e]) * (x[t] @ w["w_up_EDF"][e])) @ w["w_down_EFD"][e])
  got = layers.expert_mlp(TINY, jax.tree.map(jnp.asarray, w), jnp.asarray(x), jnp.asarray(expert), jnp.asarray(gate))
  np.testing.assert_allclose(got, want, atol=1e-5)
  # In blocks of 3 tokens (the last one padded), as `experts` runs it with expert_chunk=3.
  chunked = layers.experts(dataclasses.replace(TINY, expert_chunk=3), jax.tree.map(jnp.asarray, w), jnp.asarray(x),
                           jnp.asarray(expert), jnp.asarray(gate))
  np.testing.assert_allclose(chunked, want, atol=1e-5)
  grads = jax.grad(lambda w: jnp.sum(layers.expert_mlp(TINY, w, jnp.asarray(x), jnp.asarray(expert),
                                                       jnp.asarray(gate)) ** 2))(jax.tree.map(jnp.asarray, w))
  used = set(expert[expert < E].tolist())
  for e in range(E):
    assert (np.abs(grads["w_down_EFD"][e]).max() > 0) == (e in used), e


def test_router_aux_loss_matches_transformers(tmp_path):
  m = make_hf_moe(str(tmp_path / "hf"), CASES["dense_first_layer_raw_topk"])
  cfg, params = hf.load(str(tmp_path / "hf"))
  tokens, mask = left_padded_batch()
  _, routing = model.logits(cfg, params, jnp.asarray(tokens), jnp.asarray(mask), with_router=True)
  aux, metrics = loss.router_aux_loss(routing)
  pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
  with torch.no_grad():
    out = m(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos),
            output_router_logits=True)
  np.testing.assert_allclose(float(aux), float(out.aux_loss), rtol=1e-5)
  # Loads: every layer's assignments of real tokens; k per token, E * share of the layer's.
  assert routing["counts_LE"].shape == (2, 4) and np.all(np.asarray(routing["tokens_L"]) == mask.sum())
  np.testing.assert_allclose(routing["counts_LE"].sum(-1), 2 * mask.sum())
  load = 4 * routing["counts_LE"] / routing["counts_LE"].sum(-1, keepdims=True)
  assert metrics["router/load_max"] == pytest.approx(float(load.max()))
  assert metrics["router/load_min"] == pytest.approx(float(load.min()))


def test_shared_prompt_routing_counts_each_rows_prompt():
  """The shared-prompt forward passes each prompt once for its G rows; its routing statistics (so the
  load-balancing loss) still equal the rows forward's, which sees every row's prompt."""
  params = model.init_params(TINY, jax.random.key(5))
  rng = np.random.default_rng(2)
  Q, G, P, C = 2, 3, 5, 4
  prompt = rng.integers(3, V, (Q, P)).astype(np.int32)
  pmask = np.ones_like(prompt, bool)
  pmask[1, :2] = False
  comp = rng.integers(3, V, (Q * G, C)).astype(np.int32)
  cmask = np.ones_like(comp, bool)
  cmask[4, 2:] = False
  rows = np.concatenate([np.repeat(prompt, G, 0), comp], 1)
  rows_mask = np.concatenate([np.repeat(pmask, G, 0), cmask], 1)
  _, want = model.logits(TINY, params, jnp.asarray(rows), jnp.asarray(rows_mask), with_router=True)
  _, got = model.completion_logits(TINY, params, jnp.asarray(prompt), jnp.asarray(pmask), jnp.asarray(comp),
                                   jnp.asarray(cmask), with_router=True)
  np.testing.assert_array_equal(got["tokens_L"], rows_mask.sum())
  np.testing.assert_array_equal(got["counts_LE"], want["counts_LE"])
  np.testing.assert_allclose(got["probs_LE"], want["probs_LE"], rtol=1e-5)
  np.testing.assert_allclose(loss.router_aux_loss(got)[0], loss.router_aux_loss(want)[0], rtol=1e-5)


def test_sampler_greedy_and_logp_equal_the_forward():
  params = model.init_params(TINY, jax.random.key(3))
  rng = np.random.default_rng(0)
  prompt = rng.integers(3, V, (3, 6)).astype(np.int32)
  pmask = np.ones_like(prompt, bool)
  pmask[1, :2] = pmask[2, :5] = False
  out = sampling.generate(TINY, sampling.SamplerConfig(max_new_tokens=6, temperature=0.0), params, prompt, pmask,
                          jax.random.key(0))
  comp = np.asarray(out.tokens_BC)
  full = np.concatenate([prompt, comp], 1)
  logits = np.asarray(model.logits(TINY, params, jnp.asarray(full), jnp.asarray(np.concatenate(
      [pmask, np.ones_like(comp, bool)], 1))))
  np.testing.assert_array_equal(np.argmax(logits[:, 5:-1], -1), comp)
  np.testing.assert_allclose(out.logp_BC, loss.token_logprobs(jnp.asarray(logits[:, 5:-1]), jnp.asarray(comp)),
                             atol=1e-5)


def test_expert_parallel_step_matches_one_device():
  """The policy-gradient step with the load-balancing loss on (data=2, expert=2, tensor=2), its
  dispatch in blocks of 4 tokens, equals one device's in one block (loss, metrics, updated params);
  the loss holds the weighted load-balancing loss; experts shard over the expert axis and get
  gradients."""
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  cfg = dataclasses.replace(TINY, vocab_size=64, router_aux_coef=0.01)
  batch = make_batch(B=8)

  def run(mesh, cfg):
    trainer = train_step.Trainer(cfg, LINEAR_OPT, mesh, objectives.policy_gradient(cfg, objectives.PGConfig()),
                                 num_microbatches=2)
    state = trainer.init(jax.random.key(0))
    state = state.replace(rollout_step=jax.device_put(jnp.int32(1), trainer.state_sharding.rollout_step))
    init = jax.device_get(state.params)
    state, metrics = trainer.step(state, trainer.put_batch(batch))
    return trainer, init, jax.device_get(state.params), jax.device_get(metrics)

  trainer, init, p8, m8 = run(sharding.make_mesh({"data": 2, "expert": 2, "tensor": 2}),
                              dataclasses.replace(cfg, expert_chunk=4))
  _, _, p1, m1 = run(one_device_mesh(), cfg)
  assert m8.keys() == m1.keys() and {"router/aux_loss", "router/load_max", "router/load_min"} <= m8.keys()
  for key in m8:
    np.testing.assert_allclose(m8[key], m1[key], rtol=1e-5, atol=1e-6, err_msg=key)
  # The loss is the policy loss plus router_aux_coef x the load-balancing loss (about k=2 when balanced).
  assert m1["router/aux_loss"] > 1.5
  np.testing.assert_allclose(m1["loss"] - m1["pg_loss"], 0.01 * m1["router/aux_loss"], rtol=1e-4)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), p8, p1)
  moved = np.abs(p8["layers"]["w_down_EFD"] - init["layers"]["w_down_EFD"]).max(axis=(0, 2, 3))
  assert np.all(np.isfinite(p8["layers"]["w_down_EFD"])) and np.all(moved > 1e-5), moved
  assert np.abs(p8["layers"]["router_DE"] - init["layers"]["router_DE"]).max() > 1e-5
  specs = jax.tree.map(lambda s: s.spec, trainer.state_sharding.params)
  assert specs["layers"]["w_gate_EDF"] == P(None, "expert", "fsdp", "tensor")
  assert specs["layers"]["w_down_EFD"] == P(None, "expert", "tensor", "fsdp")
  assert specs["layers"]["router_DE"] == P(None, "fsdp", "expert")


def test_bad_moe_configs_fail_naming_the_field(tmp_path):
  make_hf_moe(str(tmp_path / "hf"), CASES["dense_first_layer_raw_topk"])
  path = tmp_path / "hf" / "config.json"
  good = json.load(open(path))
  for change, pattern in [
      (dict(num_experts_per_tok=5), r"field 'num_experts_per_tok'=5; expected an integer in 1\.\.num_experts=4"),
      (dict(shared_expert_intermediate_size=64), r"field 'shared_expert_intermediate_size'=64: shared experts"),
      (dict(mlp_only_layers=[7]), r"field 'mlp_only_layers'=\[7\]; expected layer indices in 0\.\.2"),
      (dict(decoder_sparse_step=0), r"field 'decoder_sparse_step'=0"),
      (dict(hidden_act="gelu"), r"field 'hidden_act'='gelu'")]:
    json.dump(dict(good, **change), open(path, "w"))
    with pytest.raises(hf.CheckpointError, match=r"config\.json: " + pattern):
      hf.load(str(tmp_path / "hf"))
  with pytest.raises(ValueError, match=r"model\.num_experts=4 is not divisible by mesh size 3"):
    sharding.check_divisible(dataclasses.replace(TINY, num_experts=4),
                             sharding.make_mesh({"data": 1, "expert": 3}, jax.devices()[:3]))
  with pytest.raises(ValueError, match=r"model\.num_experts=0 with model\.arch='qwen3_moe'"):
    dataclasses.replace(TINY, num_experts=0)
  with pytest.raises(ValueError, match=r"model\.experts_per_token=5 must be in 1\.\.num_experts=4"):
    dataclasses.replace(TINY, experts_per_token=5)


def test_runs_and_parameter_counts():
  # Qwen3-30B-A3B: 30.5B parameters, 3.3B active per token (its model card).
  big = model.ModelConfig.qwen3_30b_a3b()
  assert abs(big.num_params / 1e9 - 30.53) < 0.01 and abs(big.num_active_params / 1e9 - 3.35) < 0.01
  assert big.layer_runs == ((0, 48, True),)
  mixed = dataclasses.replace(TINY, num_layers=5, dense_layers=(0, 3))
  assert mixed.layer_runs == ((0, 1, False), (1, 3, True), (3, 4, False), (4, 5, True))
  params = jax.eval_shape(lambda: model.init_params(mixed, jax.random.key(0)))
  assert sorted(params) == ["embed_VD", "final_norm", "layers", "layers_1", "layers_2", "layers_3"]
  assert params["layers_1"]["w_up_EDF"].shape == (2, 4, 32, 16) and "w_up_DF" in params["layers_2"]
  assert sum(x.size for x in jax.tree.leaves(params)) == mixed.num_params


def test_sampler_on_the_expert_parallel_mesh_matches_one_device():
  """Greedy decode with the experts split over (expert=2) and their F over (tensor=2), trained and
  sampling placements, equals one device's."""
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  from dapo_jax import optim
  from dapo_jax.rollout import rollout
  cfg = dataclasses.replace(TINY, vocab_size=96)
  params = model.init_params(cfg, jax.random.key(3))
  rng = np.random.default_rng(0)
  prompt = rng.integers(3, 96, (8, 5)).astype(np.int32)
  mask = np.ones_like(prompt, bool)
  mask[3, :2] = False
  sc = sampling.SamplerConfig(max_new_tokens=5, temperature=0.0)
  one = jax.device_get(sampling.generate(cfg, sc, params, prompt, mask, jax.random.key(0)))
  mesh = sharding.make_mesh({"data": 2, "expert": 2, "tensor": 2})
  trainer = train_step.Trainer(cfg, optim.OptimConfig(), mesh, objectives.language_model(cfg))
  sampler_sharding = rollout.Rollout(None, cfg, mesh, rollout.RolloutConfig(max_prompt_len=5), sc).params_sharding
  rows = sharding.put((prompt, mask), trainer.batch_sharding)
  for shardings in (trainer.params_sharding, sampler_sharding):
    with jax.set_mesh(mesh):
      out = sampling.generate(cfg, sc, sharding.put(params, shardings), *rows, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(out.tokens_BC), one.tokens_BC)
    np.testing.assert_allclose(np.asarray(out.logp_BC), one.logp_BC, atol=1e-5)
  assert sampler_sharding["layers"]["w_up_EDF"].spec == P(None, "expert", None, "tensor")
