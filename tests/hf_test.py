"""HF checkpoint import/export against the `transformers` torch reference (fp32)."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax.hf import convert as hf
from dapo_jax.model import transformer as model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CASES = {
    # name: (architecture, heads, kv heads, tied, qkv bias)
    "qwen2_gqa2_tied": ("qwen2", 4, 2, True, True),
    "qwen2_mqa_untied": ("qwen2", 4, 1, False, True),
    "llama_mha_untied": ("llama", 4, 4, False, False),
    "llama_gqa4_tied": ("llama", 8, 2, True, False),
}


def make_hf_model(path, arch, heads, kv_heads, tied, bias, seed=0):
  torch.manual_seed(seed)
  common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=1e-6,
                tie_word_embeddings=tied, max_position_embeddings=128,
                rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
  if arch == "qwen2":
    cfg = transformers.Qwen2Config(**common)
    m = transformers.Qwen2ForCausalLM(cfg)
  else:
    cfg = transformers.LlamaConfig(attention_bias=bias, **common)
    m = transformers.LlamaForCausalLM(cfg)
  with torch.no_grad():  # Random norms and biases so that no parameter is a no-op.
    for name, p in m.named_parameters():
      if "norm" in name or name.endswith("bias"):
        p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
  m = m.float().eval()
  m.save_pretrained(path)
  return m


def left_padded_batch(vocab=97, seed=1):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, size=(3, 11))
  mask = np.ones_like(tokens)
  mask[1, :4] = 0   # Left padding of different amounts.
  mask[2, :9] = 0
  tokens = np.where(mask == 1, tokens, 0)
  return tokens, mask


def torch_logits(m, tokens, mask):
  pos = np.maximum(np.cumsum(mask, -1) - 1, 0)  # What generate() passes for left-padded rows.
  with torch.no_grad():
    out = m(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(pos))
  return out.logits.numpy()


def assert_close_on_real(a, b, mask, tol=1e-4):
  m = mask.astype(bool)
  np.testing.assert_allclose(a[m], b[m], atol=tol, rtol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
  arch, heads, kv, tied, bias = CASES[case]
  m = make_hf_model(str(tmp_path / "hf"), arch, heads, kv, tied, bias)
  cfg, params = hf.load(str(tmp_path / "hf"))
  assert (cfg.arch, cfg.num_heads, cfg.num_kv_heads, cfg.tie_embeddings, cfg.qkv_bias) == (
      arch, heads, kv, tied, bias)
  tokens, mask = left_padded_batch()
  ours = np.asarray(model.logits(cfg, params, jnp.asarray(tokens), jnp.asarray(mask)))
  ref = torch_logits(m, tokens, mask)
  assert_close_on_real(ours, ref, mask)

  # Export, then re-import and load in transformers: same logits again.
  hf.save(str(tmp_path / "out"), cfg, params)
  cfg2, params2 = hf.load(str(tmp_path / "out"))
  assert cfg2 == cfg
  again = np.asarray(model.logits(cfg2, params2, jnp.asarray(tokens), jnp.asarray(mask)))
  np.testing.assert_array_equal(again, ours)
  m2 = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
  assert_close_on_real(torch_logits(m2, tokens, mask), ref, mask)


def test_sharded_checkpoint_loads(tmp_path):
  m = make_hf_model(str(tmp_path / "hf"), "qwen2", 4, 2, False, True)
  m.save_pretrained(str(tmp_path / "sharded"), max_shard_size="100KB")
  assert os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
  _, p1 = hf.load(str(tmp_path / "hf"))
  _, p2 = hf.load(str(tmp_path / "sharded"))
  jax.tree.map(np.testing.assert_array_equal, p1, p2)


def test_bf16_checkpoint_reads(tmp_path):
  m = make_hf_model(str(tmp_path / "hf"), "llama", 4, 2, True, False)
  m.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
  _, params = hf.load(str(tmp_path / "bf16"))
  ref = m.model.embed_tokens.weight.float().detach().numpy()
  np.testing.assert_array_equal(np.asarray(params["embed_VD"]), ref)


def test_clear_errors(tmp_path):
  make_hf_model(str(tmp_path / "hf"), "qwen2", 4, 2, True, True)
  cfg_path = tmp_path / "hf" / "config.json"
  cfg = json.load(open(cfg_path))

  bad = dict(cfg, architectures=["GPT2LMHeadModel"])
  os.makedirs(tmp_path / "arch", exist_ok=True)
  json.dump(bad, open(tmp_path / "arch" / "config.json", "w"))
  with pytest.raises(hf.CheckpointError, match=r"architectures.*GPT2LMHeadModel"):
    hf.load(str(tmp_path / "arch"))

  # A mis-shaped tensor: config says a wider MLP than the weights have.
  json.dump(dict(cfg, intermediate_size=128), open(cfg_path, "w"))
  with pytest.raises(hf.CheckpointError, match=r"model\.safetensors.*mlp\.gate_proj\.weight.*shape"):
    hf.load(str(tmp_path / "hf"))

  # A missing tensor.
  json.dump(dict(cfg, num_hidden_layers=3), open(cfg_path, "w"))
  with pytest.raises(hf.CheckpointError, match=r"missing tensor 'model\.layers\.2\."):
    hf.load(str(tmp_path / "hf"))


def test_unreadable_dtype(tmp_path):
  path = str(tmp_path / "x.safetensors")
  header = json.dumps({"w": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}).encode()
  with open(path, "wb") as f:
    f.write(len(header).to_bytes(8, "little") + header + b"\0\0")
  with pytest.raises(hf.CheckpointError, match=r"x\.safetensors.*'w'.*F8_E4M3"):
    hf.read_safetensors(path)
