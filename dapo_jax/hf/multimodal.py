"""`Gemma3ForConditionalGeneration` directories <-> our vision-language params, without torch.

The language model is a Gemma 3 text model, which `convert` maps (and composes with this file's
parts); the vision tower (SigLIP) and the projector map here to params["vision"] (`model.vision`).
Reads the tensor names transformers writes (`language_model.model.*`, `vision_tower.*`,
`multi_modal_projector.*`) and those of other releases (`model.language_model.*`,
`vision_tower.vision_model.*`, ...); writes the first.
"""
from __future__ import annotations

from typing import Iterator

import jax
import numpy as np

from dapo_jax.hf.safetensors import CheckpointError
from dapo_jax.model.config import ModelConfig, VisionConfig

ARCHITECTURE = "Gemma3ForConditionalGeneration"

# Prefixes of the language model's tensors in released checkpoints -> `convert`'s names.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))
_VISION_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.",
                    "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


def is_multimodal(hf: dict) -> bool:
  return ARCHITECTURE in (hf.get("architectures") or [])


def vision_config(hf: dict, source: str) -> VisionConfig:
  """The tower and projector of a Gemma3ForConditionalGeneration config.json (its `vision_config` and the
  top-level image fields)."""
  for key in ("text_config", "vision_config"):
    if not isinstance(hf.get(key), dict):
      raise CheckpointError(f"{source}: missing field {key!r} (an object)")
  v = hf["vision_config"]
  if v.get("vision_use_head"):
    raise CheckpointError(f"{source}: field 'vision_config.vision_use_head'=true is not supported (Gemma 3 has none)")
  if v.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
    raise CheckpointError(f"{source}: field 'vision_config.hidden_act'={v['hidden_act']!r}; only 'gelu_pytorch_tanh'")
  try:
    return VisionConfig(
        image_size=int(v.get("image_size", 224)), patch_size=int(v.get("patch_size", 16)),
        embed_dim=int(v.get("hidden_size", 768)), mlp_dim=int(v.get("intermediate_size", 3072)),
        num_layers=int(v.get("num_hidden_layers", 12)), num_heads=int(v.get("num_attention_heads", 12)),
        num_channels=int(v.get("num_channels", 3)), norm_eps=float(v.get("layer_norm_eps", 1e-6)),
        tokens_per_image=int(hf.get("mm_tokens_per_image", 256)),
        image_token_id=int(hf.get("image_token_index", hf.get("image_token_id", 262_144))),
        boi_token_id=int(hf.get("boi_token_index", 255_999)), eoi_token_id=int(hf.get("eoi_token_index", 256_000)))
  except ValueError as e:
    raise CheckpointError(f"{source}: {e}") from None


def text_config(hf: dict) -> dict:
  """The language model's config.json fields, as a `Gemma3ForCausalLM`'s."""
  text = dict(hf["text_config"], architectures=["Gemma3ForCausalLM"])
  text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
  return text


def to_hf(text: dict, cfg: ModelConfig) -> dict:
  """config.json of a Gemma3ForConditionalGeneration: `text` (the language model's fields) and the tower's."""
  v = cfg.vision
  text = {k: val for k, val in text.items() if k not in ("architectures", "torch_dtype", "dtype")}
  return {"architectures": [ARCHITECTURE], "model_type": "gemma3", "text_config": text,
          "vision_config": {"model_type": "siglip_vision_model", "hidden_size": v.embed_dim,
                            "intermediate_size": v.mlp_dim, "num_hidden_layers": v.num_layers,
                            "num_attention_heads": v.num_heads, "num_channels": v.num_channels,
                            "image_size": v.image_size, "patch_size": v.patch_size, "layer_norm_eps": v.norm_eps,
                            "hidden_act": "gelu_pytorch_tanh", "vision_use_head": False, "attention_dropout": 0.0},
          "mm_tokens_per_image": v.tokens_per_image, "image_token_index": v.image_token_id,
          "boi_token_index": v.boi_token_id, "eoi_token_index": v.eoi_token_id,
          "tie_word_embeddings": cfg.tie_embeddings, "dtype": "float32", "initializer_range": 0.02}


def _vision_names(v: VisionConfig) -> Iterator[tuple[str, str, str]]:
  """(HF name, our name under params["vision"], how HF's array becomes ours) of the tower and projector."""
  yield "embeddings.patch_embedding.weight", "patch_ID", "conv"    # [Dv, C, p, p] -> [C*p*p, Dv]
  yield "embeddings.patch_embedding.bias", "patch_bias_D", ""
  yield "embeddings.position_embedding.weight", "pos_PD", ""
  yield "post_layernorm.weight", "post_norm_scale_D", ""
  yield "post_layernorm.bias", "post_norm_bias_D", ""


_LAYER_NAMES = (("layer_norm1.weight", "ln1_scale_D", ""), ("layer_norm1.bias", "ln1_bias_D", ""),
                ("layer_norm2.weight", "ln2_scale_D", ""), ("layer_norm2.bias", "ln2_bias_D", ""),
                ("mlp.fc1.weight", "fc1_DF", "T"), ("mlp.fc1.bias", "fc1_bias_F", ""),
                ("mlp.fc2.weight", "fc2_FD", "T"), ("mlp.fc2.bias", "fc2_bias_D", ""),
                ("self_attn.q_proj.weight", "wq_DD", "T"), ("self_attn.q_proj.bias", "bq_D", ""),
                ("self_attn.k_proj.weight", "wk_DD", "T"), ("self_attn.k_proj.bias", "bk_D", ""),
                ("self_attn.v_proj.weight", "wv_DD", "T"), ("self_attn.v_proj.bias", "bv_D", ""),
                ("self_attn.out_proj.weight", "wo_DD", "T"), ("self_attn.out_proj.bias", "bo_D", ""))
_PROJECTOR_NAMES = (("mm_input_projection_weight", "proj_DE"), ("mm_soft_emb_norm.weight", "soft_norm_D"))


def split(tensors: dict, origin: dict) -> tuple[dict, dict, dict]:
  """(the language model's tensors under `convert`'s names, the tower's, the projector's), by prefix."""
  text, tower, projector = {}, {}, {}
  for name, arr in tensors.items():
    if name.startswith(_PROJECTOR_PREFIXES):
      projector[name.split("multi_modal_projector.", 1)[1]] = arr
      continue
    tower_prefix = next((p for p in _VISION_PREFIXES if name.startswith(p)), None)
    if tower_prefix:
      tower[name[len(tower_prefix):]] = arr
      continue
    text_prefix = next(((p, to) for p, to in _TEXT_PREFIXES if name.startswith(p)), None)
    if text_prefix is None:
      raise CheckpointError(f"{origin.get(name, '?')}: unexpected tensor {name!r} in a {ARCHITECTURE} checkpoint")
    text[text_prefix[1] + name[len(text_prefix[0]):]] = arr
  return text, tower, projector


def vision_params(cfg: ModelConfig, tower: dict, projector: dict, origin: dict, dtype=np.float32) -> dict:
  """params["vision"] from the tower's and the projector's tensors (`split`)."""
  v = cfg.vision
  tower, projector = dict(tower), dict(projector)

  def take(source: dict, name: str, how: str):
    if name not in source:
      raise CheckpointError(f"missing vision tensor {name!r} (files: {sorted(set(origin.values())) or '?'})")
    arr = np.asarray(source.pop(name), np.float32)
    if how == "conv":
      return arr.reshape(arr.shape[0], -1).T
    return arr.T if how == "T" else arr

  vparams = {ours: take(tower, name, how) for name, ours, how in _vision_names(v)}
  vparams["layers"] = {ours: np.stack([take(tower, f"encoder.layers.{i}.{name}", how) for i in range(v.num_layers)])
                       for name, ours, how in _LAYER_NAMES}
  vparams.update({ours: take(projector, name, "") for name, ours in _PROJECTOR_NAMES})
  expected = {"patch_ID": (v.num_channels * v.patch_size ** 2, v.embed_dim), "pos_PD": (v.num_patches, v.embed_dim),
              "proj_DE": (v.embed_dim, cfg.embed_dim)}
  for name, shape in expected.items():
    if vparams[name].shape != shape:
      raise CheckpointError(f"vision tensor {name} has shape {vparams[name].shape}, expected {shape} from config.json")
  left = sorted(tower) + sorted(projector)
  if left:
    raise CheckpointError(f"unexpected vision tensors {left[:5]}; vision_config does not match the weights")
  return jax.tree.map(lambda a: a.astype(dtype), vparams)


def text_tensors(tensors: dict) -> dict:
  """The language model's tensors (`convert`'s names) under the names transformers writes."""
  return {"language_model." + k: arr for k, arr in tensors.items()}


def vision_tensors(cfg: ModelConfig, vparams: dict, dtype=np.float32) -> dict[str, np.ndarray]:
  """The tower's and the projector's tensors of params["vision"], as transformers writes them."""
  v = cfg.vision
  vp = jax.tree.map(lambda a: np.asarray(a, np.float32), vparams)
  out = {}
  for name, ours, how in _vision_names(v):
    arr = vp[ours]
    if how == "conv":
      arr = arr.T.reshape(v.embed_dim, v.num_channels, v.patch_size, v.patch_size)
    out[f"vision_tower.{name}"] = arr
  for name, ours, how in _LAYER_NAMES:
    for i in range(v.num_layers):
      arr = vp["layers"][ours][i]
      out[f"vision_tower.encoder.layers.{i}.{name}"] = arr.T if how == "T" else arr
  for name, ours in _PROJECTOR_NAMES:
    out[f"multi_modal_projector.{name}"] = vp[ours]
  return {k: np.ascontiguousarray(a).astype(dtype) for k, a in out.items()}
