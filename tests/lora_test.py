"""LoRA adapters on a frozen (optionally int8) base: exactness at step 0, adapter-only training, the
reference with adapters off, merged export, PEFT round trips checked with `peft` on transformers,
the sampler, and the (2,2,2) mesh."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax import objectives, optim, rlhf_objectives, sharding, testing, train_step
from dapo_jax.datatypes import LMBatch, PreferenceBatch, RLBatch
from dapo_jax.hf import convert as hf
from dapo_jax.hf import peft as peft_format
from dapo_jax.model import decode, layers, lora, quant
from dapo_jax.model import transformer as model
from dapo_jax.rollout import sampling

CFG = testing.tiny_model_config(vocab_size=64)
LCFG = lora.LoraConfig(rank=4, alpha=8.0)
OPT = optim.OptimConfig(lr=1e-2, warmup_steps=0, weight_decay=0.0, grad_clip=1.0)


def base_params(cfg=CFG, seed=0):
  return jax.device_get(_init(cfg, jax.random.key(seed)))


_init = jax.jit(model.init_params, static_argnums=0)  # Jitted: an eager flax init takes seconds.


def adapted(cfg=CFG, lcfg=LCFG, seed=0, b_scale=0.3):
  """An adapted tree whose b are nonzero (as after training)."""
  p = lora.adapt(cfg, lcfg, base_params(cfg, seed), jax.random.key(1))
  bs = jax.random.split(jax.random.key(2), len(p["lora"]["layers"]))
  p["lora"]["layers"] = {n: dict(ab, b=b_scale * jax.random.normal(k, ab["b"].shape))
                         for (n, ab), k in zip(p["lora"]["layers"].items(), bs)}
  return p


def rows(B=3, T=9, seed=0, vocab=64):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, size=(B, T)).astype(np.int32)
  mask = np.ones((B, T), bool)
  mask[1, :3] = False  # Left padding.
  return jnp.asarray(tokens), jnp.asarray(mask)


def make_batch(B=8, Pl=6, C=10, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(4, CFG.vocab_size, size=(B, Pl + C)).astype(np.int32)
  lengths = rng.integers(1, C + 1, size=B)
  cmask = np.arange(C)[None] < lengths[:, None]
  return RLBatch(tokens_BT=tokens, mask_BT=np.concatenate([np.ones((B, Pl), bool), cmask], 1),
                 loss_mask_BC=cmask, old_logp_BC=rng.normal(-4.2, 0.3, size=(B, C)).astype(np.float32),
                 adv_B=rng.normal(size=B).astype(np.float32), ref_logp_BC=np.zeros((B, C), np.float32))


def one_device_mesh():
  return sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])


def make_trainer(mesh=None, lcfg=LCFG, **kw):
  return train_step.Trainer(CFG, OPT, mesh or one_device_mesh(), objectives.policy_gradient(CFG, objectives.PGConfig()),
                            lora=lcfg, **kw)


# --- the forward ------------------------------------------------------------------------------

@pytest.mark.parametrize("quant", ["", "int8"])
def test_step0_logits_equal_the_base_exactly(quant):
  params = base_params()
  tokens, mask = rows()
  p = lora.adapt(CFG, lora.LoraConfig(rank=4, base_quant=quant), params, jax.random.key(1))
  base = params if not quant else lora.merge(lora.adapters_off(p))  # the int8 base, dequantized
  got, want = model.logits(CFG, p, tokens, mask), model.logits(CFG, base, tokens, mask)
  if quant:  # Dequantizing before or after the matmul rounds differently in fp32.
    np.testing.assert_allclose(got, want, atol=1e-5)
  else:
    np.testing.assert_array_equal(got, want)
  # Shared-prompt completions (the train step's layout) too.
  prompt, pmask = tokens[:, :5], mask[:, :5]
  comp, cmask = tokens[:, 5:], mask[:, 5:]
  if not quant:
    np.testing.assert_array_equal(model.completion_logits(CFG, p, prompt, pmask, comp, cmask),
                                  model.completion_logits(CFG, params, prompt, pmask, comp, cmask))


def test_adapters_off_is_the_base_and_adapters_change_the_model():
  p = adapted()
  tokens, mask = rows()
  base = model.logits(CFG, p["base"], tokens, mask)
  np.testing.assert_array_equal(model.logits(CFG, lora.adapters_off(p), tokens, mask), base)
  assert np.abs(model.logits(CFG, p, tokens, mask) - base).max() > 1e-2


def test_adapter_matches_a_float64_reference():
  # y = x W + (alpha / r) x a b, per layer, from the merged weights in float64.
  p = adapted()
  merged64 = jax.tree.map(lambda x: np.asarray(x, np.float64), lora.merge(p))
  w = np.asarray(p["base"]["layers"]["wq_DNH"][0], np.float64)
  a = np.asarray(p["lora"]["layers"]["wq_DNH"]["a"][0], np.float64)
  b = np.asarray(p["lora"]["layers"]["wq_DNH"]["b"][0], np.float64)
  want = w + (LCFG.alpha / LCFG.rank) * np.einsum("Dr,rNH->DNH", a, b)
  np.testing.assert_allclose(merged64["layers"]["wq_DNH"][0], want, atol=1e-6)


@pytest.mark.parametrize("quant", ["", "int8"])
def test_merged_export_equals_unmerged_forward(tmp_path, quant):
  p = adapted(lcfg=lora.LoraConfig(rank=4, alpha=8.0, base_quant=quant))
  tokens, mask = rows()
  hf.save(str(tmp_path / "merged"), CFG, jax.device_get(p))
  cfg2, merged = hf.load(str(tmp_path / "merged"))
  np.testing.assert_allclose(model.logits(cfg2, merged, tokens, mask), model.logits(CFG, p, tokens, mask),
                             atol=1e-5)


def test_unknown_target_fails_naming_it():
  with pytest.raises(lora.LoraError, match="qkv_proj"):
    lora.LoraConfig(targets=("q_proj", "qkv_proj"))
  with pytest.raises(lora.LoraError, match="base_quant"):
    lora.LoraConfig(base_quant="int4")


# --- training ---------------------------------------------------------------------------------

def test_gradients_and_optimizer_state_exist_for_adapters_only():
  trainer = make_trainer(lcfg=lora.LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj")))
  params = base_params()
  state = trainer.init(params=params)
  base_before = jax.device_get(state.params["base"])
  adapters = state.params["lora"]
  # AdamW moments mirror the adapter tree (3 targets x (a, b)), nothing of the base.
  mu = state.opt_state.inner_state[1][0].mu
  assert jax.tree.structure(mu) == jax.tree.structure(adapters)
  assert set(adapters["layers"]) == {"wq_DNH", "wv_DKH", "w_down_FD"}
  opt_floats = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)
  assert opt_floats == 2 * lora.param_count(CFG, trainer.lora)
  batch = trainer.put_batch(make_batch())
  state = state.replace(rollout_step=1)  # Past the warm-up (rollout step 0 trains at lr 0).
  state, m = trainer.step(state, batch)
  state, m = trainer.step(state, batch)
  assert float(m["grad_norm"]) > 0 and int(state.step) == 2
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params["base"]), base_before)
  for n, ab in jax.device_get(state.params["lora"])["layers"].items():
    assert np.abs(ab["b"]).max() > 0, n  # b left zero: the update reached the adapters.
  # The gradient the step uses is the full model's gradient restricted to the adapters.
  obj = objectives.policy_gradient(CFG, objectives.PGConfig())
  p0 = lora.adapt(CFG, trainer.lora, params, jax.random.key(0))
  mb = make_batch()
  counts = obj.counts(mb)
  g_full = jax.grad(lambda p: obj.loss(p, mb, counts)[0])(p0)
  assert np.abs(g_full["lora"]["layers"]["wq_DNH"]["b"]).max() > 0
  np.testing.assert_array_equal(g_full["lora"]["layers"]["wq_DNH"]["a"], 0)  # b = 0 at the start


def test_reference_is_the_base_with_adapters_off_and_survives_the_steps():
  trainer = make_trainer()
  state = trainer.init(params=base_params())
  ref = trainer.reference_params(state.params)
  batch = trainer.put_batch(make_batch())
  state = state.replace(rollout_step=1)
  for _ in range(2):
    state, _ = trainer.step(state, batch)  # Donates the adapters, never the base.
  fn = trainer.forward(objectives.completion_logprobs(CFG, 1.0))
  ref_logp = np.asarray(fn(ref, batch))
  base_logp = np.asarray(objectives.completion_logprobs(CFG, 1.0)(base_params(), make_batch()))
  np.testing.assert_allclose(ref_logp, base_logp, atol=1e-6)
  assert np.abs(np.asarray(fn(state.params, batch)) - ref_logp).max() > 1e-4
  assert ref["base"]["embed_VD"] is state.params["base"]["embed_VD"]  # One base, no copy.


def test_sharded_lora_step_matches_one_device():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  # With dropout: the masks depend on the token's place in the batch, not on the device holding it.
  lcfg = lora.LoraConfig(rank=4, alpha=8.0, base_quant="int8", dropout=0.2)
  batch = make_batch()
  out = []
  for mesh in (sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}), one_device_mesh()):
    trainer = make_trainer(mesh, lcfg, num_microbatches=2)
    state = trainer.init(params=base_params()).replace(rollout_step=1)
    metrics = []
    for _ in range(2):
      state, m = trainer.step(state, trainer.put_batch(batch))
      metrics.append(jax.device_get(m))
    out.append((trainer, jax.device_get(state), metrics))
  (t8, s8, m8), (_, s1, m1) = out
  for a, b in zip(m8, m1):
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5, atol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), s8.params, s1.params)
  specs = jax.tree.map(lambda s: s.spec, t8.state_sharding.params)
  P = jax.sharding.PartitionSpec
  assert specs["lora"]["layers"]["wq_DNH"]["a"] == P(None, "fsdp", None)
  assert specs["lora"]["layers"]["wq_DNH"]["b"] == P(None, None, "tensor", None)
  assert specs["base"]["layers"]["wq_DNH"]["int8"] == P(None, "fsdp", "tensor", None)
  assert specs["base"]["layers"]["wq_DNH"]["scale"] == P(None, "tensor", None)


# --- dropout ----------------------------------------------------------------------------------

def _dense_case(seed=0, X=6, D=8, N=2, H=4, r=3):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  p = {"wq_DNH": f(D, N, H), "wk_DKH": f(D, N, H), "lora_scale": jnp.asarray(0.7, jnp.float32),
       "lora": {"wq_DNH": {"a": f(D, r), "b": f(r, N, H)}, "wk_DKH": {"a": f(D, r), "b": f(r, N, H)}}}
  return p, f(X, D)


def test_adapter_dropout_matches_a_numpy_reference_with_the_same_mask():
  # PEFT: y = x W + scale * B(A(dropout(x))), dropout(x) = x * mask / (1 - p) in training.
  p, x = _dense_case()
  rate, key = 0.25, jax.random.key(5)
  got = layers.dense("XD,DNH->XNH", x, dict(p, lora_dropout=(jnp.float32(rate), key)), "wq_DNH", CFG)
  mask = np.asarray(jax.random.bernoulli(jax.random.fold_in(key, 0), 1 - rate, x.shape))  # wq: target 0
  f64 = lambda a: np.asarray(a, np.float64)
  ad = p["lora"]["wq_DNH"]
  want = (np.einsum("XD,DNH->XNH", f64(x), f64(p["wq_DNH"]))
          + 0.7 * np.einsum("Xr,rNH->XNH", (f64(x) * mask / (1 - rate)) @ f64(ad["a"]), f64(ad["b"])))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert 0 < mask.mean() < 1
  # Without the entry (every forward but the train step's), nothing is dropped.
  merged = f64(p["wq_DNH"]) + 0.7 * np.einsum("Dr,rNH->DNH", f64(ad["a"]), f64(ad["b"]))
  plain = np.einsum("XD,DNH->XNH", f64(x), merged)
  np.testing.assert_allclose(layers.dense("XD,DNH->XNH", x, p, "wq_DNH", CFG), plain, rtol=1e-5, atol=1e-5)
  # Each target draws its own mask from the layer's key (PEFT has one dropout module per projection).
  same = lambda name: layers.adapter_dropout(x, jnp.float32(rate), key, name)
  assert (np.asarray(same("wq_DNH")) != np.asarray(same("wk_DKH"))).any()


def test_adapter_dropout_is_unbiased():
  # E[x * mask / (1 - p)] = x: the mean of the adapter output over many masks is the undropped one.
  p, x = _dense_case(X=2)
  rate = 0.5
  delta = lambda q: layers.dense("XD,DNH->XNH", x, q, "wq_DNH", CFG) - layers.dense(
      "XD,DNH->XNH", x, dict(q, lora_scale=jnp.float32(0)), "wq_DNH", CFG)
  keys = jax.random.split(jax.random.key(0), 4000)
  samples = np.asarray(jax.vmap(lambda k: delta(dict(p, lora_dropout=(jnp.float32(rate), k))))(keys), np.float64)
  mean, se = samples.mean(0), samples.std(0) / np.sqrt(len(keys))
  assert (np.abs(mean - np.asarray(delta(p))) < 5 * se + 1e-6).all()
  assert samples.std(0).min() > 0  # The masks vary.


def test_lora_dropout_is_only_0_to_1():
  assert lora.LoraConfig(dropout=0.1).dropout == 0.1
  for bad in (1.0, -0.1, "0.1"):
    with pytest.raises(lora.LoraError, match="model.lora.dropout"):
      lora.LoraConfig(dropout=bad)


@pytest.mark.slow  # Three updates and two lowerings of the LoRA step (~30 s on 2 cores).
def test_dropout_step_uses_the_seeded_masks_and_resumes_exactly():
  trainer = make_trainer(lcfg=lora.LoraConfig(rank=4, alpha=8.0, dropout=0.5), seed=3)
  p = jax.device_get(adapted())  # b != 0: dropout changes the loss from the first update on.
  # Every state placed the same way, as a restored checkpoint is: one compiled update serves them all.
  place = lambda s: sharding.put(s, trainer.state_sharding)
  state = jax.device_get(trainer.init(params=p)).replace(rollout_step=np.int32(1))  # past the warm-up
  batch = trainer.put_batch(make_batch())
  s1, m1 = trainer.step(place(state), batch)
  s1 = jax.device_get(s1)
  # Update 0's loss is the objective on the adapted tree with the masks of (seed 3, update 0, micro-batch 0).
  obj = objectives.policy_gradient(CFG, objectives.PGConfig())
  mb = make_batch()
  at = jax.jit(lambda q: obj.loss(q, mb, obj.counts(mb))[0])
  dropped = float(at(lora.with_dropout(p, 0.5, lora.dropout_key(3, 0, 0))))
  np.testing.assert_allclose(float(m1["loss"]), dropped, rtol=1e-5)
  assert abs(dropped - float(at(p))) > 1e-4
  s2, m2 = trainer.step(place(s1), batch)
  s2, m2 = jax.device_get((s2, m2))
  # Resume: the state after update 1 (as a checkpoint restores it) redoes update 2 exactly; the
  # masks come from the state's update count, not from how many updates this process ran.
  again, m_again = jax.device_get(trainer.step(place(s1), batch))
  jax.tree.map(np.testing.assert_array_equal, again.params, s2.params)
  assert m_again["loss"] == m2["loss"]
  # Dropout 0 draws nothing: the compiled update has no random-number op at all.
  placed = place(s1)
  assert "threefry" in trainer.lower_step(placed, batch).as_text()
  assert "threefry" not in make_trainer(seed=3).lower_step(placed, batch).as_text()


def test_forward_passes_never_drop():
  # π_old / reference log-probs (Trainer.forward) of a trainer with dropout: the undropped model.
  trainer = make_trainer(lcfg=lora.LoraConfig(rank=4, alpha=8.0, dropout=0.5))
  p = jax.device_get(adapted())
  state = trainer.init(params=p)
  fn = objectives.completion_logprobs(CFG, 1.0)
  got = np.asarray(trainer.forward(fn)(state.params, trainer.put_batch(make_batch())))
  np.testing.assert_allclose(got, np.asarray(fn(lora.merge(p), make_batch())), atol=1e-5)


# --- the SFT, RM and DPO trainers -------------------------------------------------------------

def preference_pairs(n=4, P=6, C=5, seed=0):
  """n interleaved pairs (rows 2i chosen, 2i+1 rejected): left-padded prompts, right-padded responses."""
  rng = np.random.default_rng(seed)
  tokens, mask = np.zeros((2 * n, P + C), np.int32), np.zeros((2 * n, P + C), bool)
  for i in range(n):
    p = int(rng.integers(2, P + 1))
    prompt = rng.integers(1, CFG.vocab_size, size=p)
    for j in range(2):
      c = int(rng.integers(1, C + 1))
      tokens[2 * i + j, P - p:P], mask[2 * i + j, P - p:P] = prompt, True
      tokens[2 * i + j, P:P + c], mask[2 * i + j, P:P + c] = rng.integers(1, CFG.vocab_size, size=c), True
  return PreferenceBatch(tokens, mask, mask[:, P:].copy(), rng.normal(-8, 1, size=2 * n).astype(np.float32))


def sft_batch(B=4, T=12, seed=0):
  tokens, mask = rows(B=B, T=T, seed=seed)
  return LMBatch(tokens_BT=np.asarray(tokens), mask_BT=np.asarray(mask), loss_mask_BT=np.asarray(mask))


TRAINERS = {  # objective, head, batch: as sft.run / sft_chat.train, rm.train and dpo.train build them.
    "sft": (lambda: objectives.language_model(CFG), "lm", sft_batch),
    "rm": (lambda: rlhf_objectives.reward_model(CFG), "scalar", preference_pairs),
    "dpo": (lambda: rlhf_objectives.dpo(CFG, rlhf_objectives.DPOConfig(beta=0.1)), "lm", preference_pairs)}


@pytest.mark.parametrize("kind", sorted(TRAINERS))
def test_sft_rm_dpo_train_adapters_only_from_the_base(kind):
  make_obj, head, make = TRAINERS[kind]
  obj = make_obj()
  base = jax.device_get(jax.jit(model.init_params, static_argnums=(0, 2))(CFG, jax.random.key(0), head))
  if head == "scalar":
    base["score_D"] = np.asarray(jax.random.normal(jax.random.key(5), base["score_D"].shape))
  trainer = train_step.Trainer(CFG, OPT, one_device_mesh(), obj, lora=LCFG, head=head)
  state = trainer.init(params=base)
  batch = make()
  counts = obj.counts(batch)
  # Step 0: the adapted model's loss is the base's, exactly.
  np.testing.assert_array_equal(obj.loss(state.params, batch, counts)[0], obj.loss(base, batch, counts)[0])
  trained = jax.device_get(state.params["lora"])
  mu = state.opt_state.inner_state[1][0].mu
  assert jax.tree.structure(mu) == jax.tree.structure(trained)  # AdamW state: adapters (and RM head) only.
  base_before = jax.device_get(state.params["base"])
  state = state.replace(rollout_step=1)  # Past the warm-up.
  for _ in range(2):
    state, m = trainer.step(state, trainer.put_batch(batch))
  assert float(m["grad_norm"]) > 0 and int(state.step) == 2
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params["base"]), base_before)
  after = jax.device_get(state.params["lora"])
  assert all(np.abs(ab["b"]).max() > 0 for ab in after["layers"].values())
  if head == "scalar":  # The new score head trains in full (PEFT's modules_to_save) and is not in the base.
    assert "score_D" not in base_before and np.abs(after["score_D"] - base["score_D"]).max() > 0
    np.testing.assert_allclose(lora.merge(state.params)["score_D"], after["score_D"])


def test_dpo_reference_is_the_base_with_adapters_off():
  obj = rlhf_objectives.dpo(CFG, rlhf_objectives.DPOConfig(beta=0.1))
  trainer = train_step.Trainer(CFG, OPT, one_device_mesh(), obj, lora=LCFG)
  base = base_params()
  adapted_params = trainer.place(adapted())  # Adapters that change the model, as a PEFT import would.
  ref = trainer.reference_params(adapted_params)
  fn = trainer.forward(rlhf_objectives.response_logprobs(CFG))
  batch = preference_pairs()
  np.testing.assert_allclose(np.asarray(fn(ref, trainer.put_batch(batch))),
                             np.asarray(rlhf_objectives.response_logprobs(CFG)(base, batch)), atol=1e-5)


# --- the sampler ------------------------------------------------------------------------------

@pytest.mark.parametrize("quant", ["", "int8"])
def test_sampler_with_adapters_equals_the_full_forward(quant):
  p = adapted(lcfg=lora.LoraConfig(rank=4, alpha=8.0, base_quant=quant), b_scale=1.0)
  prompt, pmask = rows(B=3, T=6, seed=1)
  out = sampling.generate(CFG, sampling.SamplerConfig(max_new_tokens=8, temperature=0.0), p, prompt, pmask,
                          jax.random.key(0))
  comp = np.asarray(out.tokens_BC)
  tokens = jnp.concatenate([prompt, comp], 1)
  mask = jnp.concatenate([pmask, jnp.ones_like(comp, bool)], 1)
  logits = np.asarray(model.logits(CFG, p, tokens, mask))[:, prompt.shape[1] - 1:-1]
  np.testing.assert_array_equal(np.argmax(logits, -1), comp)
  logp = np.take_along_axis(jax.nn.log_softmax(logits, -1), comp[..., None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(out.logp_BC), logp, atol=1e-4)
  # The adapters matter: the base alone decodes something else.
  base_out = sampling.generate(CFG, sampling.SamplerConfig(max_new_tokens=8, temperature=0.0),
                               lora.adapters_off(p), prompt, pmask, jax.random.key(0))
  assert (np.asarray(base_out.tokens_BC) != comp).any()


def test_int8_base_decodes_from_int8_weights_with_unmerged_adapters():
  p = adapted(lcfg=lora.LoraConfig(rank=4, alpha=8.0, base_quant="int8"))
  float_sizes = []
  for layer, l in zip(decode.decode_params(CFG, p)["layers"], range(CFG.num_layers)):
    for name in ("wqkv_DKJH", "wo_NHD", "w_gate_up_D2F", "w_down_FD"):
      assert layer[name]["int8"].dtype == jnp.int8, name
    np.testing.assert_array_equal(layer["lora"]["wq_DNH"]["a"], p["lora"]["layers"]["wq_DNH"]["a"][l])
    float_sizes += [x.size for x in jax.tree.leaves(layer) if x.dtype != jnp.int8]
  # What stays float per layer (norms, biases, scales, adapters) is far below its matrices.
  D, F = CFG.embed_dim, CFG.mlp_dim
  assert sum(float_sizes) < CFG.num_layers * 3 * D * F / 2


def test_int8_decode_loop_never_holds_a_float_copy_of_the_base():
  """XLA hoists a loop-invariant cast out of a while loop: without `quant.cast_after` the engine's
  decode round held every layer's float matrices for its whole duration (its temp memory was the
  float base); with it, one layer's matrix at a time."""
  from dapo_jax.rollout import engine, slots
  cfg = testing.tiny_model_config(vocab_size=64, embed_dim=128, mlp_dim=512, num_layers=4, head_dim=32)
  p = lora.adapt(cfg, lora.LoraConfig(rank=4, base_quant="int8"), base_params(cfg), jax.random.key(1))
  sc = sampling.SamplerConfig(max_new_tokens=8)
  e = engine.Engine(cfg, sc, slots=4, prompt_len=6)
  dparams = slots.decode_params(cfg, p)
  matrices = [w for layer in dparams["layers"] for w in layer.values() if quant.is_quantized(w)]
  float_bytes = sum(w["int8"].size * 4 for w in matrices)
  largest = max(w["int8"].size * 4 for w in matrices)
  args = (cfg, sc, dparams, e.empty_state(), jnp.asarray(4, jnp.int32), jnp.asarray(8, jnp.int32))
  temp = slots.decode_round.lower(*args).compile().memory_analysis().temp_size_in_bytes
  assert temp < largest + float_bytes / 4, (temp, float_bytes)
  # The control: a bare cast is hoisted and the loop holds the float base.
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(quant, "cast_after", lambda w, x, dtype: w.astype(dtype))
    def decode_round(*a):  # A new function: jit's trace cache would return the first trace.
      return slots.decode_round.__wrapped__(*a)
    hoisted = jax.jit(decode_round, static_argnums=(0, 1), donate_argnums=(3,))
    assert hoisted.lower(*args).compile().memory_analysis().temp_size_in_bytes >= float_bytes


def test_cast_after_keeps_every_value():
  w = jnp.asarray([[-127, 0], [5, 127]], jnp.int8)
  for x0 in (0.0, -3.5, jnp.inf, -jnp.inf, jnp.nan):
    x = jnp.full((2, 2), x0, jnp.float32)
    np.testing.assert_array_equal(jax.jit(quant.cast_after, static_argnums=2)(w, x, jnp.float32),
                                  np.asarray(w, np.float32))


# --- PEFT -------------------------------------------------------------------------------------

def test_peft_export_loads_in_peft_and_gives_our_logits(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  cfg = testing.tiny_model_config(vocab_size=64, qkv_bias=True)
  p = adapted(cfg)
  hf.save(str(tmp_path / "base"), cfg, jax.device_get(p["base"]))
  peft_format.save_peft(str(tmp_path / "adapter"), cfg, jax.device_get(p), base_model=str(tmp_path / "base"))
  names = json.load(open(tmp_path / "adapter" / "adapter_config.json"))
  assert names["r"] == 4 and names["lora_alpha"] == 8
  tensors = hf.read_safetensors(str(tmp_path / "adapter" / "adapter_model.safetensors"))
  assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
  m = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
  m = peft.PeftModel.from_pretrained(m, str(tmp_path / "adapter")).eval()
  tokens, mask = rows()
  with torch.no_grad():
    # transformers takes left-padded rows with explicit position ids.
    want = m(input_ids=torch.tensor(np.asarray(tokens), dtype=torch.long),
             attention_mask=torch.tensor(np.asarray(mask), dtype=torch.long),
             position_ids=torch.tensor(np.asarray(model.positions(mask)), dtype=torch.long)).logits.numpy()
  got = np.asarray(model.logits(cfg, p, tokens, mask))
  np.testing.assert_allclose(got[np.asarray(mask)], want[np.asarray(mask)], atol=1e-4)


def test_peft_adapter_imports_as_the_starting_point(tmp_path):
  p = adapted()
  peft_format.save_peft(str(tmp_path / "adapter"), CFG, jax.device_get(p), dropout=0.05)
  lcfg, adapters = peft_format.load_peft(str(tmp_path / "adapter"), CFG, base_quant="int8")
  assert (lcfg.rank, lcfg.alpha, lcfg.dropout, lcfg.base_quant) == (4, 8.0, 0.05, "int8")
  assert lcfg.targets == lora.ALL_TARGETS
  jax.tree.map(np.testing.assert_array_equal, adapters, jax.device_get(p["lora"]))
  # A LoRA trainer starts from it: same adapters, int8 base.
  trainer = make_trainer(lcfg=lcfg)
  state = trainer.init(params=lora.adapt(CFG, lcfg, base_params(), jax.random.key(0), adapters))
  assert state.params["base"]["layers"]["w_up_DF"]["int8"].dtype == jnp.int8
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params["lora"]), adapters)


def test_peft_adapter_for_another_base_fails_naming_the_tensor(tmp_path):
  p = adapted(testing.tiny_model_config(vocab_size=64, embed_dim=48))
  peft_format.save_peft(str(tmp_path / "adapter"), testing.tiny_model_config(vocab_size=64, embed_dim=48), jax.device_get(p))
  with pytest.raises(hf.CheckpointError, match=r"q_proj\.lora_A\.weight.*\(4, 48\), expected \(4, 32\)"):
    peft_format.load_peft(str(tmp_path / "adapter"), CFG)
  conf = json.load(open(tmp_path / "adapter" / "adapter_config.json"))
  conf["target_modules"] = ["q_proj", "c_attn"]
  json.dump(conf, open(tmp_path / "adapter" / "adapter_config.json", "w"))
  with pytest.raises(hf.CheckpointError, match="c_attn"):
    peft_format.load_peft(str(tmp_path / "adapter"), CFG)


def test_remat_dots_recomputes_an_adapters_up_projection_instead_of_keeping_it():
  """Remat "dots" keeps every unbatched weight matmul's output through the backward. An adapter's
  rank-r up-projection is as large as its projection's output, so it runs as a batch of one and is
  recomputed: the adapters' gradient keeps the [L, tokens, F] outputs of gate and up, as the full
  model's does, where the control (an unbatched up-projection) keeps the adapters' two more."""
  import contextlib
  import io

  import jax.ad_checkpoint
  cfg = testing.tiny_model_config(vocab_size=64, embed_dim=64, mlp_dim=512, num_layers=2, head_dim=16, remat="dots")
  lcfg = lora.LoraConfig(rank=4, alpha=8.0, targets=("gate_proj", "up_proj"))
  p = lora.adapt(cfg, lcfg, base_params(cfg), jax.random.key(1))
  tokens, mask = rows(B=4, T=256)
  per_layer_output = f"f32[{cfg.num_layers},{4 * 256},{cfg.mlp_dim}]"

  def kept(loss, arg):  # The backward's residuals of the [L, tokens, F] shape.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      jax.ad_checkpoint.print_saved_residuals(loss, arg)
    return out.getvalue().count(per_layer_output)

  full = kept(lambda params: model.logits(cfg, params, tokens, mask).sum(), p["base"])
  adapters = lambda: kept(lambda a: model.logits(cfg, dict(p, lora=a), tokens, mask).sum(), p["lora"])
  assert full == adapters() == 2

  def unbatched(spec, x, p_, name, cfg_):  # The control: the up-projection as a plain weight matmul.
    ad = (p_.get("lora") or {}).get(name)
    if ad is None:
      return None
    h = layers.matmul("XD,Dr->Xr", x, ad["a"], cfg_)
    return p_["lora_scale"] * layers.matmul("Xr,rF->XF", h, ad["b"], cfg_)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(layers, "adapter", unbatched)
    assert adapters() == 4
