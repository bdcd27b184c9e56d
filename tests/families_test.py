"""Qwen3, Llama 3.x rope scaling and Gemma 3 against the `transformers` torch reference (fp32):
HF import, logits on left-padded rows, export that transformers re-loads, cached decode."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax.hf import convert as hf
from dapo_jax.model import decode, kv_cache, layers
from dapo_jax.model import transformer as model
from dapo_jax.rollout import sampling

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 97
_ROPE = {"rope_type": "default", "rope_theta": 5000.0}
CASES = {
    # name: (HF config class, model class, config fields)
    "qwen3_gqa2_tied_head16": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        rope_parameters=_ROPE)),
    "qwen3_mqa_untied": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=8, tie_word_embeddings=False,
        rope_parameters=_ROPE)),
    "llama3_scaling_factor8": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "llama_linear_factor2": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0})),
    "llama_yarn_factor4": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16})),
    # Window 4 < the 11-token rows; a local and a global layer; final soft-capping that bites.
    # (transformers 5's Gemma3Attention does not pass attn_logit_softcapping on: tested below.)
    "gemma3_window4_softcap": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
        final_logit_softcapping=3.0,
        rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 300.0}})),
    "gemma3_mqa_untied_3layers": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=8, tie_word_embeddings=False,
        sliding_window=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=8)),
}


def make_hf_model(path, case, seed=0):
  cls_cfg, cls_model, fields = CASES[case]
  torch.manual_seed(seed)
  kw = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, rms_norm_eps=1e-6,
            max_position_embeddings=128)
  cfg = getattr(transformers, cls_cfg)(**{**kw, **fields})
  cfg._attn_implementation = "eager"
  m = getattr(transformers, cls_model)(cfg)
  with torch.no_grad():  # Random norms so that no parameter is a no-op (Gemma's are offsets from 1).
    for name, p in m.named_parameters():
      if "norm" in name:
        p.copy_((0.0 if "Gemma" in cls_model else 1.0) + 0.2 * torch.randn_like(p))
  m = m.float().eval()
  m.save_pretrained(path)
  return m


def left_padded_batch(seed=1, T=11):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, V, size=(3, T))
  mask = np.ones_like(tokens)
  mask[1, :4] = 0
  mask[2, :7] = 0
  return np.where(mask == 1, tokens, 0), mask


def torch_logits(m, tokens, mask):
  pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
  with torch.no_grad():
    out = m(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos))
  return out.logits.numpy()


def assert_close_on_real(a, b, mask, tol=1e-4):
  m = mask.astype(bool)
  np.testing.assert_allclose(a[m], b[m], atol=tol, rtol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_family_matches_transformers(tmp_path, case):
  m = make_hf_model(str(tmp_path / "hf"), case)
  cfg, params = hf.load(str(tmp_path / "hf"))
  fields = CASES[case][2]
  assert cfg.num_kv_heads == fields["num_key_value_heads"] and cfg.tie_embeddings == fields["tie_word_embeddings"]
  tokens, mask = left_padded_batch()
  ref = torch_logits(m, tokens, mask)
  ours = np.asarray(model.logits(cfg, params, jnp.asarray(tokens), jnp.asarray(mask)))
  assert_close_on_real(ours, ref, mask)

  # Our export: re-imported it is the same model; transformers loads it and agrees.
  hf.save(str(tmp_path / "out"), cfg, params)
  cfg2, params2 = hf.load(str(tmp_path / "out"))
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, params2, params)
  m2 = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32,
                                                         attn_implementation="eager").eval()
  assert type(m2).__name__ == CASES[case][1]
  assert_close_on_real(torch_logits(m2, tokens, mask), ref, mask)

  assert_decode_and_shared_prompt_match_forward(cfg, params, tokens, mask, ours)


def test_unknown_rope_type_and_architecture_fail_naming_the_field(tmp_path):
  make_hf_model(str(tmp_path / "hf"), "llama3_scaling_factor8")
  path = tmp_path / "hf" / "config.json"
  good = json.load(open(path))
  bad = dict(good, rope_parameters=dict(good["rope_parameters"], rope_type="dynamic"))
  json.dump(bad, open(path, "w"))
  with pytest.raises(hf.CheckpointError, match=r"config\.json: field 'rope_scaling' type 'dynamic' is not supported"):
    hf.load(str(tmp_path / "hf"))
  json.dump(dict(good, architectures=["Qwen2MoeForCausalLM"]), open(path, "w"))
  with pytest.raises(hf.CheckpointError, match=r"'architectures' is \['Qwen2MoeForCausalLM'\]; supported"):
    hf.load(str(tmp_path / "hf"))
  with pytest.raises(ValueError, match=r"model\.rope_type='ntk'"):
    dataclasses.replace(model.ModelConfig.llama3_1_8b(), rope_type="ntk")
  with pytest.raises(ValueError, match=r"model\.arch='gpt2'"):
    dataclasses.replace(model.ModelConfig.qwen3_8b(), arch="gpt2")


def test_presets_count_their_parameters():
  # Published sizes: Qwen3-8B 8.19B, Llama-3.1-8B 8.03B, Gemma-3-4B's text model 3.88B.
  for preset, billions in [(model.ModelConfig.qwen3_8b, 8.19), (model.ModelConfig.llama3_1_8b, 8.03),
                           (model.ModelConfig.gemma3_4b, 3.88)]:
    assert abs(preset().num_params / 1e9 - billions) < 0.01, preset
  cfg = model.ModelConfig.gemma3_4b()
  assert [l for l in range(34) if l not in cfg.local_layers] == [5, 11, 17, 23, 29]
  # The tiny models count what they hold.
  for c in (model.ModelConfig(vocab_size=40, embed_dim=32, mlp_dim=48, num_layers=2, num_heads=4, num_kv_heads=2,
                              head_dim=16, arch=a, qk_norm=a != "llama", qkv_bias=False,
                              local_layers=(0,) if a == "gemma3" else (), sliding_window=4)
            for a in ("llama", "qwen3", "gemma3")):
    assert sum(x.size for x in jax.tree.leaves(model.init_params(c, jax.random.key(0)))) == c.num_params


def test_attention_softcap_and_window_against_a_loop():
  """Scores scaled by query_scale**-0.5, capped c*tanh(s/c), keys within the window (Gemma)."""
  rng = np.random.default_rng(0)
  T, H, W, c, scale = 6, 4, 3, 0.7, 5.0 ** -0.5
  q, k, v = (rng.standard_normal((1, 1, 1, T, H)).astype(np.float32) for _ in range(3))
  mask = layers.windowed(jnp.tril(jnp.ones((T, T), bool))[None], W)
  out = layers.attention(jnp.asarray(q), jnp.asarray(k[:, 0]), jnp.asarray(v[:, 0]), mask, scale=scale, softcap=c)
  for t in range(T):
    keys = [s for s in range(T) if t - W < s <= t]
    z = np.array([c * np.tanh(q[0, 0, 0, t] @ k[0, 0, 0, s] * scale / c) for s in keys])
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    np.testing.assert_allclose(out[0, 0, 0, t], p @ v[0, 0, 0, keys], atol=1e-6)


def assert_decode_and_shared_prompt_match_forward(cfg, params, tokens, mask, ours):
  """Cached decode (prefill 3, then one token at a time: past the window of local layers) equals the
  full forward `ours` [B, T, V]; the shared-prompt layout of the train step too (prompt of 8)."""
  T = tokens.shape[1]
  tokens, mask = jnp.asarray(tokens), jnp.asarray(mask, bool)
  logits, cache = sampling.prefill(cfg, params, tokens[:, :3], mask[:, :3], cache_size=T)
  dparams = decode.decode_params(cfg, params)
  pos = model.positions(mask)
  for t in range(3, T):
    cache = kv_cache.write_mask(cache, mask[:, t:t + 1], t)
    logits, cache = decode.decode_step(cfg, dparams, tokens[:, t], pos[:, t], cache, t)
    rows = np.asarray(mask[:, t])
    np.testing.assert_allclose(np.asarray(logits)[rows], ours[:, t][rows], atol=1e-4)
  P = 8  # Every row's prompt holds a real token.
  shared = model.completion_logits(cfg, params, tokens[:, :P], mask[:, :P], tokens[:, P:],
                                   jnp.ones_like(mask[:, P:]))
  np.testing.assert_allclose(shared[:, 1:], ours[:, P:-1], atol=1e-4)
