"""GGUF import of the `qwen3`, `qwen3moe` and `gemma3` architectures: a GGUF written here from a tiny
transformers model the way llama.cpp's converter lays it out, converted by `gguf.to_hf_dir` (what
`launch.prepare gguf` runs), gives back the source tensors, and transformers loads the result to the
source model's logits."""
import json
import os

import numpy as np
import pytest

from dapo_jax.hf import convert as hf
from dapo_jax.hf import gguf
from tests.launch_test import _byte_to_unicode

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gg = pytest.importorskip("gguf")

TOKENS = [_byte_to_unicode()[b] for b in range(256)] + ["ab", "Ġ2", "<|endoftext|>"]
V, D, F, N, K, H, L = len(TOKENS), 32, 48, 4, 2, 16, 3
COMMON = dict(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L, num_attention_heads=N,
              num_key_value_heads=K, head_dim=H, rms_norm_eps=1e-6, max_position_embeddings=128)
MODELS = {  # llama.cpp architecture: (HF config class, model class, fields as llama.cpp runs the model)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False,
                                                      rope_parameters={"rope_type": "default", "rope_theta": 5000.0})),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})),
    # Layers 0 and 1 local (window 4), 2 global; query_pre_attn_scalar = head_dim, local RoPE base 10,000.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        tie_word_embeddings=True, sliding_window=4, query_pre_attn_scalar=H,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
}
# HF name inside model.layers.{i} -> llama.cpp's.
_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}
_GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def make_source(arch, path):
  cls_cfg, cls_model, fields = MODELS[arch]
  torch.manual_seed(0)
  cfg = getattr(transformers, cls_cfg)(**COMMON, **fields)
  cfg._attn_implementation = "eager"
  m = getattr(transformers, cls_model)(cfg)
  with torch.no_grad():
    for name, p in m.named_parameters():
      if "norm" in name:
        p.copy_((0.0 if arch == "gemma3" else 1.0) + 0.2 * torch.randn_like(p))
      elif "mlp.gate.weight" in name or "experts" in name:
        p.copy_(0.3 * torch.randn_like(p))
  m = m.float().eval()
  m.save_pretrained(path)
  return m


def write_gguf(arch, path, source_dir):
  """The GGUF llama.cpp's convert_hf_to_gguf would write for this model (F32 tensors)."""
  sd = hf.read_dir_tensors(source_dir)[0]
  sd = {k: np.asarray(v, np.float32) for k, v in sd.items()}
  w = gg.GGUFWriter(path, arch)
  w.add_block_count(L), w.add_context_length(128), w.add_embedding_length(D), w.add_feed_forward_length(F)
  w.add_head_count(N), w.add_head_count_kv(K), w.add_key_length(H), w.add_value_length(H)
  w.add_layer_norm_rms_eps(1e-6), w.add_rope_freq_base(5000.0), w.add_vocab_size(V)
  if arch == "qwen3moe":
    w.add_expert_count(4), w.add_expert_used_count(2), w.add_expert_feed_forward_length(24)
    w.add_expert_weights_norm(True)
  if arch == "gemma3":
    w.add_sliding_window(4), w.add_sliding_window_pattern([True, True, False])
    w.add_rope_scaling_type(gg.RopeScalingType.LINEAR), w.add_rope_scaling_factor(2.0)
  w.add_tokenizer_model("gpt2"), w.add_token_list(TOKENS), w.add_token_types([1] * (V - 1) + [3])
  w.add_token_merges(["a b", "Ġ 2"]), w.add_eos_token_id(V - 1)
  shift = 1.0 if arch == "gemma3" else 0.0  # llama.cpp stores Gemma's norms as 1 + w.
  w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
  w.add_tensor("output_norm.weight", sd["model.norm.weight"] + shift)
  if "lm_head.weight" in sd:
    w.add_tensor("output.weight", sd["lm_head.weight"])
  names = dict(_NAMES, **(_GEMMA_NAMES if arch == "gemma3" else {"post_attention_layernorm": "ffn_norm"}))
  for i in range(L):
    for hf_name, gg_name in names.items():
      key = f"model.layers.{i}.{hf_name}.weight"
      if key in sd:
        w.add_tensor(f"blk.{i}.{gg_name}.weight", sd[key] + (shift if "norm" in hf_name else 0.0))
    if f"model.layers.{i}.mlp.experts.0.up_proj.weight" in sd:
      for proj, gg_name in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
        stacked = np.stack([sd[f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"] for e in range(4)])
        w.add_tensor(f"blk.{i}.{gg_name}.weight", stacked)
  w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_gguf_architecture_converts_to_the_source_model(tmp_path, arch):
  ref = make_source(arch, str(tmp_path / "src"))
  path = str(tmp_path / f"{arch}.gguf")
  write_gguf(arch, path, str(tmp_path / "src"))
  out = gguf.to_hf_dir(path, str(tmp_path / "out"))

  src_cfg, src = hf.load(str(tmp_path / "src"))
  cfg, params = hf.load(out)
  assert cfg == src_cfg
  assert json.load(open(f"{out}/config.json"))["architectures"] == [MODELS[arch][1]]
  flat = lambda t, p="": {k2: v2 for k, v in t.items() for k2, v2 in (flat(v, f"{p}{k}/").items() if isinstance(v, dict)
                                                                      else [(p + k, v)])}
  want, got = flat(src), flat(params)
  assert got.keys() == want.keys()
  for k in want:  # F32 tensors: exact, norms up to the +1 / -1 round trip.
    np.testing.assert_allclose(got[k], want[k], atol=1e-6, rtol=0, err_msg=k)
  m = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
  ids = torch.as_tensor(np.random.default_rng(0).integers(0, V, size=(2, 9)))
  with torch.no_grad():
    np.testing.assert_allclose(m(ids).logits.numpy(), ref(ids).logits.numpy(), atol=1e-4)
  tok = transformers.AutoTokenizer.from_pretrained(out)
  assert tok.eos_token == "<|endoftext|>"


def test_sentencepiece_vocabulary_is_left_out_with_a_warning(tmp_path, caplog):
  """Gemma's GGUF files carry a SentencePiece vocabulary (`llama`), which is not rebuilt: the model
  is converted and the directory has no tokenizer."""
  make_source("qwen3", str(tmp_path / "src"))
  path = str(tmp_path / "spm.gguf")
  write_gguf("qwen3", path, str(tmp_path / "src"))
  reader = gg.GGUFReader(path, "r+")  # The tokenizer model renamed in place, same length: "gpt2" -> "llam".
  field = reader.fields["tokenizer.ggml.model"]
  field.parts[field.data[0]][:] = np.frombuffer(b"llam", np.uint8)
  out = gguf.to_hf_dir(path, str(tmp_path / "out"))
  assert "tokenizer.ggml.model is 'llam', not byte-level BPE" in caplog.text
  assert hf.load(out)[0] == hf.load(str(tmp_path / "src"))[0]
  assert not any(name.startswith("tokenizer") for name in os.listdir(out))


def test_unknown_gguf_architecture_names_the_field(tmp_path):
  path = str(tmp_path / "x.gguf")
  w = gg.GGUFWriter(path, "mamba")
  w.add_block_count(1), w.add_token_list(TOKENS)
  w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
  with pytest.raises(gguf.GGUFError, match=r"general\.architecture is 'mamba'; supported: \['gemma3', 'llama', "
                                           r"'qwen3', 'qwen3moe'\]"):
    gguf.load(path)
