"""`rollout.shared_prefix`: prompts that begin alike (few-shot examples, a system prompt) prefill
their common start once. Against the whole-row forward and the static sampler, which never share."""
import dataclasses

import jax
import numpy as np
import pytest

from dapo_jax import objectives, testing
from dapo_jax.datatypes import RLBatch
from dapo_jax.model import lora
from dapo_jax.model import transformer as model
from dapo_jax.rollout import engine, sampling
from dapo_jax.rollout import slots as slots_lib

CFG = testing.tiny_model_config(vocab_size=64)
PARAMS = testing.sharp_params(CFG, seed=2)


def prefixed_prompts(Q=5, N=21, P=30, seed=0):
  """Q left-padded prompts of P tokens whose first N real tokens are the same, suffixes of 1-9 tokens."""
  rng = np.random.default_rng(seed)
  prefix = rng.integers(4, 64, size=N)
  tokens, mask = np.zeros((Q, P), np.int32), np.zeros((Q, P), bool)
  for q, n in enumerate(rng.integers(1, P - N + 1, size=Q)):
    real = np.concatenate([prefix, rng.integers(4, 64, size=n)])
    tokens[q, P - len(real):], mask[q, P - len(real):] = real, True
  return tokens, mask


FAMILIES = {"qwen2": CFG, "llama_qknorm": dataclasses.replace(CFG, qkv_bias=False, qk_norm=True),
            "qwen3_moe": dataclasses.replace(CFG, qkv_bias=False, qk_norm=True, arch="qwen3_moe", num_experts=4,
                                             experts_per_token=2, expert_mlp_dim=16, norm_topk_prob=True)}


@pytest.mark.parametrize("family", [*FAMILIES, "lora_int8"])
def test_prefill_after_a_prefix_equals_the_whole_rows(family):
  """Logits and every real position's keys and values equal `forward` on the left-padded whole rows
  (dense, mixture-of-experts, and LoRA adapters on an int8 base)."""
  cfg = FAMILIES.get(family, CFG)
  params = model.init_params(cfg, jax.random.key(1))
  if family == "lora_int8":
    params = lora.adapt(cfg, lora.LoraConfig(rank=4, base_quant="int8"), params, jax.random.key(2))
    keys = iter(jax.random.split(jax.random.key(3), 64))  # Adapters that change the outputs (B = 0 at init).
    params["lora"] = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(keys), x.shape), params["lora"])
  tokens, mask = prefixed_prompts()
  Q, P, N = *tokens.shape, 16
  logits_Q1V, (k_whole, v_whole) = model.forward(cfg, params, tokens, model.positions(mask), model.causal_mask(mask),
                                                 logits_from=P - 1, emit_kv=True)
  T = P - N  # The suffixes, left-padded to T.
  suffix_QT, suffix_mask_QT = tokens[:, N:].copy(), mask[:, N:].copy()
  for q in range(Q):
    real = tokens[q][mask[q]][N:]
    suffix_QT[q], suffix_mask_QT[q] = 0, False
    suffix_QT[q, T - len(real):], suffix_mask_QT[q, T - len(real):] = real, True
  prefix_1N = tokens[:1][:, P - mask[0].sum():][:, :N]
  logits_QV, (k_pre, v_pre), (k_suf, v_suf) = model.prefill_after_prefix(cfg, params, prefix_1N, suffix_QT,
                                                                         suffix_mask_QT)
  np.testing.assert_allclose(logits_QV, logits_Q1V[:, -1], atol=1e-5, rtol=1e-5)
  for q in range(Q):  # Real positions: [prefix | suffix] against the whole row's last mask.sum() positions.
    n = mask[q].sum() - N
    for whole, pre, suf in ((k_whole, k_pre, k_suf), (v_whole, v_pre, v_suf)):
      shared = np.concatenate([pre[:, 0], suf[:, q, :, T - n:]], axis=2)
      np.testing.assert_allclose(shared, whole[:, q, :, P - N - n:], atol=1e-5, rtol=1e-5)


def _generate(shared_prefix, sc, G=3, slots=8, prompt_len=30):
  """With `prompt_len` > 30 the unshared prefill runs at that width, the shared one at 16 + 16."""
  tokens, mask = prefixed_prompts()
  eng = engine.Engine(CFG, sc, slots=slots, prompt_len=prompt_len, shared_prefix=shared_prefix)
  return eng.generate(PARAMS, tokens, mask, G, jax.random.key(5))[0]


def test_samples_with_a_shared_prefix_are_the_unshared_engines_and_the_static_samplers(monkeypatch):
  """Greedy: the static sampler's tokens; temperature 1: the unshared engine's samples, with log-probs
  the training forward's. The shared path runs (a 16-token prefix; the 21 shared tokens round down)."""
  shared = []  # (prefix, suffix width) of each shared prefill
  prefill_shared = slots_lib.prefill_shared
  monkeypatch.setattr(slots_lib, "prefill_shared", lambda cfg, p, pre, suf, m: shared.append(
      (pre.shape[1], suf.shape[1])) or prefill_shared(cfg, p, pre, suf, m))
  tokens, mask = prefixed_prompts()
  G, C = 3, 10
  greedy = sampling.SamplerConfig(max_new_tokens=C, temperature=0.0, eos_ids=(1,))
  ref = jax.device_get(sampling.generate(CFG, greedy, PARAMS, tokens, mask, jax.random.key(0), num_samples=G))
  out = _generate(16, greedy, G)
  np.testing.assert_array_equal(out.tokens_BC, ref.tokens_BC)
  np.testing.assert_allclose(out.logp_BC, ref.logp_BC, atol=1e-5)
  assert shared and set(shared) == {(16, 14)}  # The prompts' 30 columns: 16 shared and 14.

  sc = sampling.SamplerConfig(max_new_tokens=C, temperature=1.0, eos_ids=(5, 9), pad_id=0)
  plain, out = _generate(0, sc, G), _generate(16, sc, G)
  np.testing.assert_array_equal(out.tokens_BC, plain.tokens_BC)
  np.testing.assert_allclose(out.logp_BC, plain.logp_BC, atol=1e-5)
  wide = _generate(16, sc, G, prompt_len=64)  # The suffixes' width follows them, not the prompt bucket.
  np.testing.assert_array_equal(wide.tokens_BC, plain.tokens_BC)
  np.testing.assert_allclose(wide.logp_BC, plain.logp_BC, atol=1e-5)
  assert shared[-1] == (16, 16)
  batch = RLBatch(tokens_BT=np.concatenate([np.repeat(tokens, G, 0), out.tokens_BC], 1),
                  mask_BT=np.concatenate([np.repeat(mask, G, 0), out.mask_BC], 1), loss_mask_BC=out.mask_BC,
                  old_logp_BC=out.logp_BC, adv_B=np.zeros(len(out.length_B), np.float32), ref_logp_BC=out.logp_BC)
  logp = objectives.completion_logprobs(CFG, 1.0)(PARAMS, batch)
  np.testing.assert_allclose(np.where(out.mask_BC, logp, 0), np.where(out.mask_BC, out.logp_BC, 0), atol=2e-5)


def _work(real):
  return np.asarray(real, np.int32)  # A prompt's real tokens.


def test_the_shared_length_is_the_common_start_rounded_down_and_leaves_each_prompt_a_token():
  session = engine.Engine(CFG, sampling.SamplerConfig(max_new_tokens=4), slots=2, prompt_len=12,
                          shared_prefix=4).session(PARAMS, jax.random.key(0))
  common = list(range(10, 19))  # 9 tokens in common.
  assert session._shared_prefix([_work(common + [1]), _work(common + [2, 3])]) == 8
  assert session._shared_prefix([_work(common[:6] + [1]), _work(common)]) == 4  # 6 in common -> 4.
  assert session._shared_prefix([_work(common), _work(common)]) == 8  # Each keeps its last token.
  assert session._shared_prefix([_work(common[:3] + [1]), _work(common)]) == 0  # Fewer than 4.
  assert session._shared_prefix([_work(common)]) == 0  # One prompt: nothing to share.


def test_sliding_window_models_and_bad_values():
  windowed = dataclasses.replace(CFG, sliding_window=4, local_layers=(0,))
  sc = sampling.SamplerConfig(max_new_tokens=4)
  assert engine.Engine(windowed, sc, slots=2, prompt_len=12, shared_prefix=4).shared_prefix == 0
  with pytest.raises(ValueError, match="rollout.shared_prefix=-1"):
    engine.Engine(CFG, sc, slots=2, prompt_len=12, shared_prefix=-1)


# --- The update: `train.shared_prefix` -----------------------------------------------------------

def prefixed_batch(Q=5, G=3, C=7, seed=1) -> RLBatch:
  """Q groups of G rows [left-padded prompt (21 shared tokens) | right-padded completion]."""
  tokens, mask = prefixed_prompts(Q=Q, N=21, P=30)
  rng = np.random.default_rng(seed)
  completion_BC = rng.integers(4, 64, size=(Q * G, C)).astype(np.int32)
  completion_mask_BC = np.arange(C)[None] < rng.integers(1, C + 1, size=(Q * G, 1))
  zeros_BC = np.zeros((Q * G, C), np.float32)
  return RLBatch(tokens_BT=np.concatenate([np.repeat(tokens, G, 0), completion_BC], 1),
                 mask_BT=np.concatenate([np.repeat(mask, G, 0), completion_mask_BC], 1),
                 loss_mask_BC=completion_mask_BC, old_logp_BC=zeros_BC, adv_B=rng.normal(size=Q * G).astype(np.float32),
                 ref_logp_BC=zeros_BC)


def test_the_update_layout_is_the_common_start_in_multiples_and_the_rest_rounded_up():
  from dapo_jax import train_step
  batch = prefixed_batch()
  real_lengths = batch.mask_BT[::3, :30].sum(1)  # 21 shared + 1-9 own tokens each
  laid = train_step.shared_prefix_layout(batch, group_size=3, multiple=8)
  rest = real_lengths.max() - 16
  assert (laid.prefix_len, laid.suffix_len) == (16, min(-(-rest // 8) * 8, 30 - 16))  # 30 prompt columns
  assert train_step.shared_prefix_layout(batch, group_size=3, multiple=32).prefix_len == 0  # 21 < 32
  assert train_step.shared_prefix_layout(batch, group_size=3, multiple=0) is batch
  one = jax.tree.map(lambda x: x[:3], batch)  # One prompt: already run once.
  assert train_step.shared_prefix_layout(one, group_size=3, multiple=8).prefix_len == 0


@pytest.mark.parametrize("family", [*FAMILIES, "lora_int8"])
def test_the_update_with_a_shared_prefix_equals_each_groups_whole_prompt(family):
  """Log-probs, their gradients and (MoE) the routing statistics of the prefix layout equal the
  layout that runs each group's prompt whole, which tests elsewhere hold to the whole rows."""
  from dapo_jax import train_step
  cfg = FAMILIES.get(family, CFG)
  params = model.init_params(cfg, jax.random.key(1))
  if family == "lora_int8":
    params = lora.adapt(cfg, lora.LoraConfig(rank=4, base_quant="int8"), params, jax.random.key(2))
    keys = iter(jax.random.split(jax.random.key(3), 64))
    params["lora"] = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(keys), x.shape), params["lora"])
  G = 3
  batch = prefixed_batch(G=G)
  laid = train_step.shared_prefix_layout(batch, G, 8)
  assert laid.prefix_len == 16
  moe = bool(cfg.num_experts)

  def loss(p, mb):
    out = objectives.completion_logits(cfg, G, p, mb, with_router=moe)
    z_BCV, routing = out if moe else (out, None)
    logp_BC = jax.numpy.take_along_axis(jax.nn.log_softmax(z_BCV), mb.tokens_BT[:, -z_BCV.shape[1]:, None], -1)[..., 0]
    return (logp_BC * mb.loss_mask_BC * mb.adv_B[:, None]).sum(), (logp_BC, routing)

  trainable = params["lora"] if family == "lora_int8" else params
  grad = lambda mb: jax.grad(lambda t: loss({**params, "lora": t} if family == "lora_int8" else t, mb),
                             has_aux=True)(trainable)
  (want_grads, (want_logp, want_routing)), (got_grads, (got_logp, got_routing)) = grad(batch), grad(laid)
  np.testing.assert_allclose(np.where(batch.loss_mask_BC, got_logp, 0), np.where(batch.loss_mask_BC, want_logp, 0),
                             atol=1e-5)
  for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(got, want, atol=1e-5 * max(1.0, float(np.abs(want).max())), rtol=1e-4)
  if moe:
    for k in ("counts_LE", "tokens_L"):
      np.testing.assert_array_equal(got_routing[k], want_routing[k])
    np.testing.assert_allclose(got_routing["probs_LE"], want_routing["probs_LE"], rtol=1e-5)
