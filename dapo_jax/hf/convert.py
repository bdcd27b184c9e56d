"""Hugging Face checkpoint directories <-> our params, without torch.

Reads config.json plus `model.safetensors` (or sharded `*.safetensors` with
`model.safetensors.index.json`) of `Qwen2ForCausalLM` / `LlamaForCausalLM` (Llama 3.x rope scaling
included) / `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` / `Gemma3ForCausalLM` (and, through `multimodal`,
`Gemma3ForConditionalGeneration`; through `qwen_vl`, `Qwen2_5_VLForConditionalGeneration`), and writes
the same layout back so that transformers' `from_pretrained` loads it. The mapping from HF tensor names
to our parameter names lives only in this file, `multimodal` and `qwen_vl` (the vision towers) and
`peft` (LoRA adapters in PEFT's format); `save` of an adapted tree writes the merged model.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Iterator

import numpy as np

from dapo_jax.hf import multimodal, qwen_vl
from dapo_jax.hf.safetensors import CheckpointError, read_dir_tensors, read_safetensors, write_safetensors  # noqa: F401 (public)
from dapo_jax.model import lora as lora_lib
from dapo_jax.model import transformer as model_lib
from dapo_jax.paths import outside

SUPPORTED = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3",
             "Qwen3MoeForCausalLM": "qwen3_moe", "Gemma3ForCausalLM": "gemma3"}
_CLASSES = {v: k for k, v in SUPPORTED.items()}
# Scalar-head models (reward / value models): the trunk and `score.weight` [num_labels=1, D].
SCALAR_CLASSES = {"Qwen2ForSequenceClassification": "qwen2", "LlamaForSequenceClassification": "llama",
                  "Qwen3ForSequenceClassification": "qwen3"}
_MODEL_TYPES = {"qwen2": "qwen2", "llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "gemma3": "gemma3_text"}
_QK_NORM = ("qwen3", "qwen3_moe", "gemma3")  # Families with per-head q/k RMSNorm.
_ACTIVATIONS = {"gemma3": ("hidden_activation", "gelu_pytorch_tanh")}  # Others: hidden_act = silu.
# --- config.json <-> ModelConfig ---------------------------------------------------------------

def config_from_hf(hf: dict, source: str = "config.json", **overrides) -> model_lib.ModelConfig:
  archs = hf.get("architectures") or []
  arch = next(((SUPPORTED | SCALAR_CLASSES)[a] for a in archs if a in SUPPORTED or a in SCALAR_CLASSES), None)
  if arch is None:
    raise CheckpointError(f"{source}: field 'architectures' is {archs}; supported: "
                          f"{sorted(SUPPORTED) + sorted(SCALAR_CLASSES)}")

  def need(key):
    if key not in hf:
      raise CheckpointError(f"{source}: missing field {key!r}")
    return hf[key]

  if arch != "qwen2" and hf.get("attention_bias"):
    raise CheckpointError(f"{source}: field 'attention_bias'=true ({arch} with q/k/v/o biases) is not supported")
  if hf.get("mlp_bias"):
    raise CheckpointError(f"{source}: field 'mlp_bias'=true is not supported")
  if hf.get("use_sliding_window"):
    raise CheckpointError(f"{source}: field 'use_sliding_window'=true is not supported")
  act_field, act = _ACTIVATIONS.get(arch, ("hidden_act", "silu"))
  if hf.get(act_field, act) != act:
    raise CheckpointError(f"{source}: field {act_field!r}={hf[act_field]!r}; only {act!r} is supported for {arch}")
  num_heads = need("num_attention_heads")
  rope, local_rope = _rope_fields(hf, source, arch)
  kw = dict(
      vocab_size=need("vocab_size"), embed_dim=need("hidden_size"), mlp_dim=need("intermediate_size"),
      num_layers=need("num_hidden_layers"), num_heads=num_heads,
      num_kv_heads=hf.get("num_key_value_heads") or num_heads,
      head_dim=hf.get("head_dim") or need("hidden_size") // num_heads,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      qkv_bias=arch == "qwen2",
      tie_embeddings=bool(hf.get("tie_word_embeddings", arch == "gemma3")),
      arch=arch, qk_norm=arch in _QK_NORM, **rope)
  if arch == "qwen3_moe":
    kw.update(_moe_fields(hf, source, kw["num_layers"]))
  if arch == "gemma3":
    L = kw["num_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % hf.get("sliding_window_pattern", 6) else "full_attention" for i in range(L)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if len(types) != L or unknown:
      raise CheckpointError(f"{source}: field 'layer_types' must list {L} of 'sliding_attention' / "
                            f"'full_attention', got {types}")
    if hf.get("use_bidirectional_attention"):
      raise CheckpointError(f"{source}: field 'use_bidirectional_attention'=true is not supported")
    kw.update(local_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
              sliding_window=int(hf.get("sliding_window") or 4096),
              query_scale=float(hf.get("query_pre_attn_scalar", 256)),
              attn_softcap=float(hf.get("attn_logit_softcapping") or 0.0),
              final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
              rope_local_theta=float(local_rope.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0))))
  kw.update(overrides)
  return model_lib.ModelConfig(**kw)


def _moe_fields(hf: dict, source: str, L: int) -> dict:
  """The ModelConfig fields of a Qwen3-MoE config.json, each HF field checked and named."""
  E = hf.get("num_experts", hf.get("num_local_experts"))
  if not isinstance(E, int) or E < 1:
    raise CheckpointError(f"{source}: field 'num_experts'={E!r}; expected a positive integer")
  checks = {"num_experts_per_tok": lambda v: isinstance(v, int) and 1 <= v <= E,
            "moe_intermediate_size": lambda v: isinstance(v, int) and v >= 1,
            "decoder_sparse_step": lambda v: isinstance(v, int) and v >= 1}
  wanted = {"num_experts_per_tok": f"an integer in 1..num_experts={E}",
            "moe_intermediate_size": "a positive integer", "decoder_sparse_step": "a positive integer"}
  for key, ok in checks.items():
    if key != "decoder_sparse_step" and key not in hf:
      raise CheckpointError(f"{source}: missing field {key!r}")
    if not ok(hf.get(key, 1)):
      raise CheckpointError(f"{source}: field {key!r}={hf[key]!r}; expected {wanted[key]}")
  only = hf.get("mlp_only_layers") or []
  if not isinstance(only, list) or any(not isinstance(l, int) or not 0 <= l < L for l in only):
    raise CheckpointError(f"{source}: field 'mlp_only_layers'={only!r}; expected layer indices in 0..{L - 1}")
  for key in ("shared_expert_intermediate_size", "n_shared_experts"):  # Qwen2-MoE / DeepSeek shared experts.
    if hf.get(key):
      raise CheckpointError(f"{source}: field {key!r}={hf[key]!r}: shared experts are not supported")
  step = hf.get("decoder_sparse_step", 1)
  return dict(num_experts=E, experts_per_token=hf["num_experts_per_tok"], expert_mlp_dim=hf["moe_intermediate_size"],
              norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
              dense_layers=tuple(l for l in range(L) if l in only or (l + 1) % step),
              # transformers adds the loss only when output_router_logits is set.
              router_aux_coef=float(hf.get("router_aux_loss_coef", 0.0)) if hf.get("output_router_logits") else 0.0)


ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope_fields(hf: dict, source: str, arch: str) -> tuple[dict, dict]:
  """(ModelConfig rope fields, the local layers' rope dict) from `rope_parameters` (transformers 5)
  or `rope_theta` + `rope_scaling` (older files); Gemma 3 nests them per layer type."""
  params = hf.get("rope_parameters") or {}
  local: dict = {}
  if "full_attention" in params or "sliding_attention" in params:
    params, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
  rope = {**params, **(hf.get("rope_scaling") or {})}
  kind = rope.get("rope_type", rope.get("type")) or "default"
  if kind not in ROPE_TYPES:
    raise CheckpointError(f"{source}: field 'rope_scaling' type {kind!r} is not supported "
                          f"(supported: {list(ROPE_TYPES)})")
  if (local.get("rope_type") or "default") != "default":
    raise CheckpointError(f"{source}: field 'rope_parameters.sliding_attention' type {local['rope_type']!r} "
                          "is not supported (supported: 'default')")
  default_theta = 1e6 if arch == "gemma3" else 10_000.0
  out = dict(rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", default_theta))), rope_type=kind)
  if kind != "default":
    out["rope_factor"] = float(rope.get("factor") or 1.0)
  if kind in ("llama3", "yarn"):
    out["rope_original_max_pos"] = int(rope.get("original_max_position_embeddings")
                                       or hf.get("max_position_embeddings", 8192))
  if kind == "llama3":
    out.update(rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
               rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)))
  if kind == "yarn":
    factor = out["rope_factor"]
    attn = rope.get("attention_factor")
    if attn is None and rope.get("mscale") and rope.get("mscale_all_dim"):
      m = lambda s: 0.1 * s * math.log(factor) + 1.0 if factor > 1 else 1.0
      attn = m(rope["mscale"]) / m(rope["mscale_all_dim"])
    out.update(rope_beta_fast=float(rope.get("beta_fast") or 32.0), rope_beta_slow=float(rope.get("beta_slow") or 1.0),
               rope_attention_factor=float(attn or 0.0), rope_truncate=bool(rope.get("truncate", True)))
  return out, local


def _rope_to_hf(cfg: model_lib.ModelConfig) -> dict:
  """The (global layers') rope dict of config.json."""
  out = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
  if cfg.rope_type != "default":
    out["factor"] = cfg.rope_factor
  if cfg.rope_type in ("llama3", "yarn"):
    out["original_max_position_embeddings"] = cfg.rope_original_max_pos
  if cfg.rope_type == "llama3":
    out.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor)
  if cfg.rope_type == "yarn":
    out.update(beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow, truncate=cfg.rope_truncate)
    if cfg.rope_attention_factor:
      out["attention_factor"] = cfg.rope_attention_factor
  return out


def _num(x: float):
  """An integral float as an int (transformers' strict configs type-check some fields as int)."""
  return int(x) if float(x).is_integer() else x


def config_to_hf(cfg: model_lib.ModelConfig, eos_token_id=None, bos_token_id=None, pad_token_id=None) -> dict:
  rope = _rope_to_hf(cfg)
  max_pos = max(32_768, int(cfg.rope_original_max_pos * cfg.rope_factor) if cfg.rope_type != "default" else 0)
  common = dict(
      vocab_size=cfg.vocab_size, hidden_size=cfg.embed_dim, intermediate_size=cfg.mlp_dim,
      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
      max_position_embeddings=max_pos, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
      rope_parameters=rope, tie_word_embeddings=cfg.tie_embeddings, torch_dtype="float32", dtype="float32",
      eos_token_id=eos_token_id, bos_token_id=bos_token_id, pad_token_id=pad_token_id,
      attention_dropout=0.0, initializer_range=0.02)
  if cfg.rope_type != "default":  # Older transformers read the scaling from here.
    common["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
  if cfg.arch != "gemma3" and (cfg.local_layers or cfg.attn_softcap or cfg.final_softcap or cfg.query_scale):
    raise CheckpointError(f"model.local_layers / attn_softcap / final_softcap / query_scale are Gemma 3 "
                          f"features; model.arch={cfg.arch!r} cannot be written with them")
  if cfg.qk_norm != (cfg.arch in _QK_NORM):
    raise CheckpointError(f"model.qk_norm={cfg.qk_norm} cannot be written as model.arch={cfg.arch!r} "
                          "(q/k norms: qwen3, qwen3_moe and gemma3 have them, qwen2 and llama do not)")
  if cfg.arch in _QK_NORM:
    if cfg.qkv_bias:
      raise CheckpointError(f"model.qkv_bias=True cannot be written as model.arch={cfg.arch!r}")
    out = dict(architectures=[_CLASSES[cfg.arch]], model_type=_MODEL_TYPES[cfg.arch], attention_bias=False,
               **common)
    if cfg.arch == "qwen3":
      out.update(use_sliding_window=False, sliding_window=None)
      return out
    if cfg.arch == "qwen3_moe":
      out.update(use_sliding_window=False, sliding_window=None, num_experts=cfg.num_experts,
                 num_experts_per_tok=cfg.experts_per_token, moe_intermediate_size=cfg.expert_mlp_dim,
                 norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=list(cfg.dense_layers),
                 output_router_logits=cfg.router_aux_coef > 0, router_aux_loss_coef=cfg.router_aux_coef or 0.001)
      return out
    del out["hidden_act"]
    L = cfg.num_layers
    out.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=_num(cfg.query_scale or cfg.head_dim),
               sliding_window=cfg.sliding_window or 4096, rope_local_base_freq=cfg.rope_local_theta,
               layer_types=["sliding_attention" if l in cfg.local_layers else "full_attention" for l in range(L)],
               attn_logit_softcapping=cfg.attn_softcap or None, final_logit_softcapping=cfg.final_softcap or None,
               rope_parameters={"full_attention": rope,
                                "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta}},
               use_bidirectional_attention=False)
    return out
  if cfg.arch == "qwen2":
    if not cfg.qkv_bias:
      raise CheckpointError("model.qkv_bias=False cannot be written as Qwen2 (it always has QKV bias); "
                            "set model.arch='llama'")
    return dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False, **common)
  if cfg.qkv_bias:
    raise CheckpointError("model.qkv_bias=True cannot be written as Llama; set model.arch='qwen2'")
  return dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False,
              mlp_bias=False, **common)


# --- tensors <-> params ------------------------------------------------------------------------

def _layer_names(cfg: model_lib.ModelConfig, moe: bool = False) -> Iterator[tuple[str, str, Any]]:
  """(HF name suffix, our name, HF -> ours reshape) for one layer (`moe`: an expert layer, whose
  experts `_expert_names` lists)."""
  D, N, K, H, F = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  yield "input_layernorm.weight", "attn_norm/scale_D", (D,)
  if cfg.gemma:
    yield "post_attention_layernorm.weight", "post_attn_norm/scale_D", (D,)
    yield "pre_feedforward_layernorm.weight", "mlp_norm/scale_D", (D,)
  else:
    yield "post_attention_layernorm.weight", "mlp_norm/scale_D", (D,)
  # HF Linear weights are [out, in]; ours are [in, out...].
  yield "self_attn.q_proj.weight", "wq_DNH", (N, H, D)
  yield "self_attn.k_proj.weight", "wk_DKH", (K, H, D)
  yield "self_attn.v_proj.weight", "wv_DKH", (K, H, D)
  yield "self_attn.o_proj.weight", "wo_NHD", (D, N, H)
  if moe:
    yield "mlp.gate.weight", "router_DE", (cfg.num_experts, D)
  else:
    yield "mlp.gate_proj.weight", "w_gate_DF", (F, D)
    yield "mlp.up_proj.weight", "w_up_DF", (F, D)
    yield "mlp.down_proj.weight", "w_down_FD", (D, F)
  if cfg.qkv_bias:
    yield "self_attn.q_proj.bias", "bq_NH", (N, H)
    yield "self_attn.k_proj.bias", "bk_KH", (K, H)
    yield "self_attn.v_proj.bias", "bv_KH", (K, H)
  if cfg.qk_norm:
    yield "self_attn.q_norm.weight", "q_norm_H", (H,)
    yield "self_attn.k_norm.weight", "k_norm_H", (H,)
  if cfg.gemma:  # Gemma's post_attention_layernorm normalises the attention output; its MLP input
    # norm is pre_feedforward_layernorm (the Llama meaning of post_attention_layernorm).
    yield "post_feedforward_layernorm.weight", "post_mlp_norm/scale_D", (D,)


# An expert layer's experts: HF stores expert e's projections as mlp.experts.{e}.{proj}.weight
# ([out, in], as the dense MLP's); transformers 5 fuses them in memory but writes these names.
_EXPERT_NAMES = {"gate_proj": "w_gate_EDF", "up_proj": "w_up_EDF", "down_proj": "w_down_EFD"}
_TRANSPOSED = ("w_gate_DF", "w_up_DF", "w_down_FD", "router_DE")  # HF [out, in] = ours transposed.


def _to_ours(name: str, hf_arr: np.ndarray, hf_shape) -> np.ndarray:
  arr = hf_arr.reshape(hf_shape)
  if name in ("wq_DNH", "wk_DKH", "wv_DKH"):
    return arr.transpose(2, 0, 1)             # [N, H, D] -> [D, N, H]
  if name in _TRANSPOSED:
    return arr.T
  if name == "wo_NHD":
    return arr.transpose(1, 2, 0)             # [D, N, H] -> [N, H, D]
  return arr


def _to_hf(name: str, arr: np.ndarray) -> np.ndarray:
  if name in ("wq_DNH", "wk_DKH", "wv_DKH"):
    return arr.reshape(arr.shape[0], -1).T
  if name in _TRANSPOSED:
    return arr.T
  if name == "wo_NHD":
    return arr.reshape(-1, arr.shape[-1]).T
  if name in ("bq_NH", "bk_KH", "bv_KH"):
    return arr.reshape(-1)
  return arr


def _set(tree: dict, path: str, value) -> None:
  *parents, leaf = path.split("/")
  for p in parents:
    tree = tree.setdefault(p, {})
  tree[leaf] = value


def _get(tree: dict, path: str):
  for p in path.split("/"):
    tree = tree[p]
  return tree


def params_from_tensors(cfg: model_lib.ModelConfig, tensors: dict[str, np.ndarray],
                        origin: dict[str, str] | None = None, dtype=np.float32) -> dict:
  origin = origin or {}
  used = set()

  def take(name, shape):
    if name not in tensors:
      raise CheckpointError(f"missing tensor {name!r} (files: {sorted(set(origin.values())) or '?'})")
    arr = tensors[name]
    if int(np.prod(arr.shape)) != int(np.prod(shape)) or (len(shape) == arr.ndim and tuple(arr.shape) != tuple(shape)):
      raise CheckpointError(f"{origin.get(name, '?')}: tensor {name!r} has shape {tuple(arr.shape)}, "
                            f"expected {tuple(shape)} from config.json")
    used.add(name)
    return np.asarray(arr, dtype=np.float32)

  D, V = cfg.embed_dim, cfg.vocab_size
  params: dict = {}
  params["embed_VD"] = take("model.embed_tokens.weight", (V, D)).astype(dtype)
  params["final_norm"] = {"scale_D": take("model.norm.weight", (D,)).astype(dtype)}
  if not cfg.tie_embeddings:
    params["unembed_DV"] = take("lm_head.weight", (V, D)).T.astype(dtype)
  for r, (start, stop, moe) in enumerate(cfg.layer_runs):  # One stack per run of alike layers.
    layers: dict = {}
    for suffix, ours, hf_shape in _layer_names(cfg, moe):
      full_shape = _hf_shape(cfg, suffix, hf_shape)
      stacked = np.stack([_to_ours(ours.rsplit("/", 1)[-1], take(f"model.layers.{i}.{suffix}", full_shape),
                                   hf_shape) for i in range(start, stop)])
      _set(layers, ours, stacked.astype(dtype))
    if moe:
      layers.update({k: v.astype(dtype) for k, v in _experts_from_tensors(cfg, tensors, take, start, stop).items()})
    params[model_lib.run_name(r)] = layers
  ignored = {n for n in tensors if n not in used and not n.endswith("rotary_emb.inv_freq")}
  if cfg.tie_embeddings:
    ignored.discard("lm_head.weight")  # Some tied checkpoints still store the copy.
  if ignored:
    raise CheckpointError(f"unexpected tensors {sorted(ignored)[:5]} (files: {sorted(set(origin.values()))}); "
                          "the architecture in config.json does not match the weights")
  return params


def _experts_from_tensors(cfg: model_lib.ModelConfig, tensors: dict, take, start: int, stop: int) -> dict:
  """The stacked experts [L, E, ...] of layers start..stop-1, from per-expert tensors or from the
  fused `mlp.experts.gate_up_proj` [E, 2F, D] / `mlp.experts.down_proj` [E, D, F] of transformers 5."""
  E, D, F = cfg.num_experts, cfg.embed_dim, cfg.expert_mlp_dim
  out: dict = {name: [] for name in _EXPERT_NAMES.values()}
  for i in range(start, stop):
    fused = f"model.layers.{i}.mlp.experts.gate_up_proj"
    if fused in tensors:
      gate_up = take(fused, (E, 2 * F, D))
      out["w_gate_EDF"].append(gate_up[:, :F].transpose(0, 2, 1))
      out["w_up_EDF"].append(gate_up[:, F:].transpose(0, 2, 1))
      out["w_down_EFD"].append(take(f"model.layers.{i}.mlp.experts.down_proj", (E, D, F)).transpose(0, 2, 1))
      continue
    for proj, ours in _EXPERT_NAMES.items():
      shape = (D, F) if proj == "down_proj" else (F, D)
      out[ours].append(np.stack([take(f"model.layers.{i}.mlp.experts.{e}.{proj}.weight", shape).T for e in range(E)]))
  return {k: np.stack(v) for k, v in out.items()}


def _hf_shape(cfg: model_lib.ModelConfig, suffix: str, default=None) -> tuple[int, ...]:
  D, N, K, H, F = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  return {"input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
          "self_attn.q_proj.weight": (N * H, D), "self_attn.k_proj.weight": (K * H, D),
          "self_attn.v_proj.weight": (K * H, D), "self_attn.o_proj.weight": (D, N * H),
          "mlp.gate_proj.weight": (F, D), "mlp.up_proj.weight": (F, D), "mlp.down_proj.weight": (D, F),
          "self_attn.q_proj.bias": (N * H,), "self_attn.k_proj.bias": (K * H,),
          "self_attn.v_proj.bias": (K * H,)}.get(suffix, default)


def params_to_tensors(cfg: model_lib.ModelConfig, params: dict, dtype=np.float32) -> dict[str, np.ndarray]:
  get = lambda p: np.asarray(_get(params, p), dtype=np.float32)
  out = {"model.embed_tokens.weight": get("embed_VD"), "model.norm.weight": get("final_norm/scale_D")}
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = get("unembed_DV").T
  for r, (start, stop, moe) in enumerate(cfg.layer_runs):
    run = model_lib.run_name(r)
    for suffix, ours, _ in _layer_names(cfg, moe):
      stacked = get(f"{run}/{ours}")
      for i in range(start, stop):
        out[f"model.layers.{i}.{suffix}"] = _to_hf(ours.rsplit("/", 1)[-1], stacked[i - start])
    if moe:
      for proj, ours in _EXPERT_NAMES.items():
        stacked = get(f"{run}/{ours}")
        for i in range(start, stop):
          for e in range(cfg.num_experts):
            out[f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"] = stacked[i - start, e].T
  return {k: np.ascontiguousarray(v).astype(dtype) for k, v in out.items()}


# --- public API --------------------------------------------------------------------------------

def load_config(path: str, native_resolution: bool = False, **overrides) -> model_lib.ModelConfig:
  """The ModelConfig of a local HF model directory (its config.json), without reading weights.
  `native_resolution`: a Qwen2.5-VL's images keep their aspect ratios (`VisionConfig.native_resolution`)."""
  cfg_path = os.path.join(path, "config.json")
  if not os.path.exists(cfg_path):
    raise CheckpointError(f"{path}: no config.json (is this a Hugging Face model directory?)")
  if outside(path, "config.json"):
    raise CheckpointError(f"{path}: {outside(path, 'config.json')}")
  try:
    hf_cfg = json.load(open(cfg_path))
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
  except UnicodeDecodeError as e:
    raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
  if not isinstance(hf_cfg, dict):
    raise CheckpointError(f"{cfg_path}: a JSON {type(hf_cfg).__name__}, expected an object")
  try:
    if multimodal.is_multimodal(hf_cfg):
      vision = multimodal.vision_config(hf_cfg, cfg_path)
      return config_from_hf(multimodal.text_config(hf_cfg), f"{cfg_path} (text_config)", vision=vision, **overrides)
    if native_resolution and not qwen_vl.is_qwen_vl(hf_cfg):
      raise CheckpointError(f"{cfg_path}: model.vision.native_resolution=True needs a Qwen2.5-VL model")
    if qwen_vl.is_qwen_vl(hf_cfg):
      vision = qwen_vl.vision_config(hf_cfg, cfg_path, native_resolution)
      section = qwen_vl.mrope_section(hf_cfg, cfg_path)
      return config_from_hf(qwen_vl.text_config(hf_cfg), f"{cfg_path} (text_config)", vision=vision,
                            mrope_section=section, **overrides)
    return config_from_hf(hf_cfg, cfg_path, **overrides)
  except CheckpointError:
    raise
  except (TypeError, ValueError, AttributeError, KeyError) as e:  # Fields of the wrong type or range.
    raise CheckpointError(f"{cfg_path}: {e}") from None


def load(path: str, **overrides) -> tuple[model_lib.ModelConfig, dict]:
  """Reads a local HF model directory into (ModelConfig, params); `overrides` set e.g. dtype. A
  vision-language model (`multimodal`) has its tower and projector in params["vision"]."""
  cfg = load_config(path, **overrides)
  tensors, origin = read_dir_tensors(path)
  if "score.weight" in tensors:
    raise CheckpointError(f"{path}: a scalar-head model (tensor 'score.weight'), not a language model; "
                          "read it with hf.load_scalar")
  dtype = np.dtype(cfg.param_dtype)
  if cfg.vision is None:
    return cfg, params_from_tensors(cfg, tensors, origin, dtype=dtype)
  family = _vision_family(cfg)
  text, tower, projector = family.split(tensors, origin)
  params = params_from_tensors(_text_only(cfg), text, origin, dtype=dtype)
  return cfg, dict(params, vision=family.vision_params(cfg, tower, projector, origin, dtype))


def _vision_family(cfg: model_lib.ModelConfig):
  """The module mapping a vision-language model's directory: `multimodal` (Gemma 3) or `qwen_vl`."""
  return qwen_vl if cfg.vision.kind == "qwen2_5_vl" else multimodal


def _text_only(cfg: model_lib.ModelConfig) -> model_lib.ModelConfig:
  return dataclasses.replace(cfg, vision=None, mrope_section=())


def save(path: str, model_cfg: model_lib.ModelConfig, params: dict, *, tokenizer=None,
         eos_token_id=None, bos_token_id=None, pad_token_id=None, dtype=np.float32) -> None:
  """Writes a directory that `transformers.AutoModelForCausalLM.from_pretrained` loads (an adapted
  tree, see `lora`, is written merged: an ordinary model)."""
  params = lora_lib.merge(params)
  os.makedirs(path, exist_ok=True)
  if tokenizer is not None:
    eos_token_id = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    pad_token_id = tokenizer.pad_token_id if pad_token_id is None else pad_token_id
    tokenizer.save_pretrained(path)
  text_cfg = _text_only(model_cfg)
  hf_cfg = config_to_hf(text_cfg, eos_token_id, bos_token_id, pad_token_id)
  if model_cfg.vision is not None:
    hf_cfg = _vision_family(model_cfg).to_hf(hf_cfg, model_cfg)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_cfg, f, indent=2)
  if eos_token_id is not None:
    gen = {"eos_token_id": eos_token_id, "pad_token_id": pad_token_id, "bos_token_id": bos_token_id}
    with open(os.path.join(path, "generation_config.json"), "w") as f:
      json.dump({k: v for k, v in gen.items() if v is not None}, f, indent=2)
  tensors = params_to_tensors(text_cfg, {k: v for k, v in params.items() if k != "vision"}, dtype)
  if model_cfg.vision is not None:
    family = _vision_family(model_cfg)
    tensors = family.text_tensors(tensors) | family.vision_tensors(model_cfg, params["vision"], dtype)
  write_safetensors(os.path.join(path, "model.safetensors"), tensors)


# --- scalar-head models: ...ForSequenceClassification -----------------------------------------

def save_scalar(path: str, model_cfg: model_lib.ModelConfig, params: dict, *, tokenizer=None,
                pad_token_id=None, dtype=np.float32) -> None:
  """Writes a scalar-head model (`model.Transformer(head="scalar")`: a reward model) as the family's
  ...ForSequenceClassification directory (num_labels=1, `score.weight` [1, D]) that
  `transformers.AutoModelForSequenceClassification` loads. transformers scores a row at its
  rightmost token that is not `pad_token_id`, so the pad id must differ from every real token."""
  cls = {v: k for k, v in SCALAR_CLASSES.items()}.get(model_cfg.arch)
  if cls is None:
    raise CheckpointError(f"model.arch={model_cfg.arch!r} has no sequence-classification export; "
                          f"supported: {sorted(SCALAR_CLASSES.values())}")
  if "score_D" not in params:
    raise CheckpointError(f"{path}: the params have no scalar head 'score_D' (an LM is written with hf.save)")
  trunk = {k: v for k, v in params.items() if k not in ("score_D", "unembed_DV")}
  save(path, dataclasses.replace(model_cfg, tie_embeddings=True), trunk, tokenizer=tokenizer,
       pad_token_id=pad_token_id, dtype=dtype)
  cfg_path = os.path.join(path, "config.json")
  with open(cfg_path) as f:
    hf_cfg = json.load(f)
  if hf_cfg.get("pad_token_id") is None:
    raise CheckpointError(f"{path}: a reward model needs a pad token id (transformers finds each row's "
                          "last token by it); pass tokenizer= or pad_token_id=")
  hf_cfg.update(architectures=[cls], num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0},
                tie_word_embeddings=model_cfg.tie_embeddings)
  with open(cfg_path, "w") as f:
    json.dump(hf_cfg, f, indent=2)
  tensors = read_safetensors(os.path.join(path, "model.safetensors"))
  tensors = {k: np.array(v) for k, v in tensors.items()}
  tensors["score.weight"] = np.asarray(params["score_D"], np.float32).reshape(1, -1).astype(dtype)
  write_safetensors(os.path.join(path, "model.safetensors"), tensors)


def load_scalar(path: str, **overrides) -> tuple[model_lib.ModelConfig, dict]:
  """Reads a ...ForSequenceClassification directory with one label into (ModelConfig, params with
  `score_D`); a directory without a score head fails naming it."""
  cfg = load_config(path, **overrides)
  tensors, origin = read_dir_tensors(path)
  if "score.weight" not in tensors:
    raise CheckpointError(f"{path}: no score head (tensor 'score.weight'): not a reward model; train one "
                          "with launch.rm, or pass a ...ForSequenceClassification directory")
  score = tensors.pop("score.weight")
  if tuple(score.shape) != (1, cfg.embed_dim):
    raise CheckpointError(f"{origin['score.weight']}: tensor 'score.weight' has shape {tuple(score.shape)}, "
                          f"expected (1, {cfg.embed_dim}) (num_labels=1)")
  tensors.pop("lm_head.weight", None)
  params = params_from_tensors(dataclasses.replace(cfg, tie_embeddings=True), tensors, origin,
                               dtype=np.dtype(cfg.param_dtype))
  params["score_D"] = np.asarray(score, np.float32).reshape(-1).astype(np.dtype(cfg.param_dtype))
  return cfg, params
