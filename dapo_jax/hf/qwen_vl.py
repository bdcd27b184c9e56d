"""`Qwen2_5_VLForConditionalGeneration` directories <-> our vision-language params, without torch.

The language model is a Qwen2 text model with M-RoPE (`ModelConfig.mrope_section`), which `convert`
maps; the vision transformer and its patch merger map here to params["vision"] (`qwen_vision`). Reads
the tensor names of released checkpoints and of transformers' saves (`model.*`, `visual.*`, `lm_head.*`)
and of its in-memory layout (`model.language_model.*`, `model.visual.*`); writes the first.

Every image of a run has one size (`VisionConfig.image_size`, static shapes); HF's config has none (its
processor keeps aspect ratios), so it is read from `vision_config.image_size` where an export wrote it,
else `DEFAULT_IMAGE_SIZE`.
"""
from __future__ import annotations

import jax
import numpy as np

from dapo_jax.hf.safetensors import CheckpointError
from dapo_jax.model.config import ModelConfig, VisionConfig

ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
DEFAULT_IMAGE_SIZE = 448  # 32 x 32 patches of 14: 256 tokens an image.

_TEXT_PREFIXES = (("model.language_model.", "model."), ("lm_head.", "lm_head."), ("model.", "model."))
_VISION_PREFIXES = ("model.visual.", "visual.")


def is_qwen_vl(hf: dict) -> bool:
  return ARCHITECTURE in (hf.get("architectures") or [])


def _rope(text: dict) -> dict:
  return dict(text.get("rope_parameters") or {}, **(text.get("rope_scaling") or {}))


def vision_config(hf: dict, source: str, native_resolution: bool = False) -> VisionConfig:
  """The tower of a Qwen2_5_VLForConditionalGeneration config.json (`vision_config` and the top-level
  token ids); its images keep their aspect ratios where the export says so or `native_resolution`."""
  for key in ("text_config", "vision_config"):
    if not isinstance(hf.get(key), dict):
      raise CheckpointError(f"{source}: missing field {key!r} (an object)")
  v = hf["vision_config"]
  if v.get("hidden_act", "silu") != "silu":
    raise CheckpointError(f"{source}: field 'vision_config.hidden_act'={v['hidden_act']!r}; only 'silu'")
  p, m = int(v.get("patch_size", 14)), int(v.get("spatial_merge_size", 2))
  size = int(v.get("image_size", DEFAULT_IMAGE_SIZE))
  try:
    return VisionConfig(
        kind="qwen2_5_vl", image_size=size, patch_size=p, merge_size=m,
        temporal_patch_size=int(v.get("temporal_patch_size", 2)), embed_dim=int(v.get("hidden_size", 1280)),
        mlp_dim=int(v.get("intermediate_size", 3420)), num_layers=int(v.get("depth", 32)),
        num_heads=int(v.get("num_heads", 16)), num_channels=int(v.get("in_channels", 3)),
        window_size=int(v.get("window_size", 112)),
        full_attention_layers=tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31))),
        rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 10_000.0)),
        native_resolution=native_resolution or bool(v.get("native_resolution", False)),
        tokens_per_image=(size // (p * m)) ** 2, image_token_id=int(hf.get("image_token_id", 151_655)),
        boi_token_id=int(hf.get("vision_start_token_id", 151_652)),
        eoi_token_id=int(hf.get("vision_end_token_id", 151_653)))
  except ValueError as e:
    raise CheckpointError(f"{source}: {e}") from None


def mrope_section(hf: dict, source: str) -> tuple[int, ...]:
  section = _rope(hf["text_config"]).get("mrope_section")
  if not section:
    raise CheckpointError(f"{source}: missing field 'text_config.rope_parameters.mrope_section'")
  return tuple(int(n) for n in section)


def text_config(hf: dict) -> dict:
  """The language model's config.json fields, as a `Qwen2ForCausalLM`'s (M-RoPE read by `mrope_section`)."""
  text = dict(hf["text_config"], architectures=["Qwen2ForCausalLM"])
  rope = {k: val for k, val in _rope(text).items() if k not in ("mrope_section", "type")}
  rope["rope_type"] = "default" if rope.get("rope_type", "default") in ("default", "mrope") else rope["rope_type"]
  text["rope_parameters"], text["rope_scaling"] = rope, None
  text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
  return text


def to_hf(text: dict, cfg: ModelConfig) -> dict:
  """config.json of a Qwen2_5_VLForConditionalGeneration: `text` (the language model's fields) and the tower's."""
  v = cfg.vision
  text = {k: val for k, val in text.items() if k not in ("architectures", "torch_dtype", "dtype", "model_type")}
  text.update(model_type="qwen2_5_vl_text", rope_parameters=dict(text["rope_parameters"],
                                                                 mrope_section=list(cfg.mrope_section)))
  text.pop("rope_theta", None)
  return {"architectures": [ARCHITECTURE], "model_type": "qwen2_5_vl", "text_config": text,
          "vision_config": {"model_type": "qwen2_5_vl_vision", "depth": v.num_layers, "hidden_size": v.embed_dim,
                            "intermediate_size": v.mlp_dim, "num_heads": v.num_heads, "in_channels": v.num_channels,
                            "out_hidden_size": cfg.embed_dim, "patch_size": v.patch_size,
                            "spatial_merge_size": v.merge_size, "temporal_patch_size": v.temporal_patch_size,
                            "window_size": v.window_size, "fullatt_block_indexes": list(v.full_attention_layers),
                            "hidden_act": "silu", "image_size": v.image_size,
                            "native_resolution": v.native_resolution,
                            "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta}},
          "image_token_id": v.image_token_id, "vision_start_token_id": v.boi_token_id,
          "vision_end_token_id": v.eoi_token_id, "tie_word_embeddings": cfg.tie_embeddings, "dtype": "float32"}


# (HF name under a block, our name under params["vision"]["layers"], transposed); qkv is split below.
_LAYER_NAMES = (("norm1.weight", "norm1_D", False), ("norm2.weight", "norm2_D", False),
                ("attn.proj.weight", "wo_DD", True), ("attn.proj.bias", "bo_D", False),
                ("mlp.gate_proj.weight", "gate_DF", True), ("mlp.gate_proj.bias", "gate_bias_F", False),
                ("mlp.up_proj.weight", "up_DF", True), ("mlp.up_proj.bias", "up_bias_F", False),
                ("mlp.down_proj.weight", "down_FD", True), ("mlp.down_proj.bias", "down_bias_D", False))
_MERGER_NAMES = (("merger.ln_q.weight", "merge_norm_D", False), ("merger.mlp.0.weight", "merge_fc1_GG", True),
                 ("merger.mlp.0.bias", "merge_fc1_bias_G", False), ("merger.mlp.2.weight", "merge_fc2_GE", True),
                 ("merger.mlp.2.bias", "merge_fc2_bias_E", False))


def split(tensors: dict, origin: dict) -> tuple[dict, dict, dict]:
  """(the language model's tensors under `convert`'s names, the tower's, {}), by prefix."""
  text, tower = {}, {}
  for name, arr in tensors.items():
    prefix = next((p for p in _VISION_PREFIXES if name.startswith(p)), None)
    if prefix:
      tower[name[len(prefix):]] = arr
      continue
    text_prefix = next(((p, to) for p, to in _TEXT_PREFIXES if name.startswith(p)), None)
    if text_prefix is None:
      raise CheckpointError(f"{origin.get(name, '?')}: unexpected tensor {name!r} in a {ARCHITECTURE} checkpoint")
    text[text_prefix[1] + name[len(text_prefix[0]):]] = arr
  return text, tower, {}


def vision_params(cfg: ModelConfig, tower: dict, projector: dict, origin: dict, dtype=np.float32) -> dict:
  """params["vision"] from the tower's tensors (`split`)."""
  v = cfg.vision
  tower = dict(tower)

  def take(name: str, transpose: bool = False):
    if name not in tower:
      raise CheckpointError(f"missing vision tensor {name!r} (files: {sorted(set(origin.values())) or '?'})")
    arr = np.asarray(tower.pop(name), np.float32)
    return arr.T if transpose else arr

  conv = take("patch_embed.proj.weight")  # [Dv, C, T, p, p]
  vparams = {"patch_ID": conv.reshape(conv.shape[0], -1).T}
  vparams.update({ours: take(name, t) for name, ours, t in _MERGER_NAMES})
  layers = {ours: [] for _, ours, _ in _LAYER_NAMES} | {f"{w}{n}_{s}": [] for w, s in (("w", "DD"), ("b", "D"))
                                                         for n in "qkv"}
  for i in range(v.num_layers):
    for name, ours, t in _LAYER_NAMES:
      layers[ours].append(take(f"blocks.{i}.{name}", t))
    qkv_w, qkv_b = np.split(take(f"blocks.{i}.attn.qkv.weight"), 3), np.split(take(f"blocks.{i}.attn.qkv.bias"), 3)
    for n, w, b in zip("qkv", qkv_w, qkv_b):
      layers[f"w{n}_DD"].append(w.T)
      layers[f"b{n}_D"].append(b)
  vparams["layers"] = {k: np.stack(a) for k, a in layers.items()}
  G = v.embed_dim * v.merge_size ** 2
  expected = {"patch_ID": (v.num_channels * v.temporal_patch_size * v.patch_size ** 2, v.embed_dim),
              "merge_fc1_GG": (G, G), "merge_fc2_GE": (G, cfg.embed_dim)}
  for name, shape in expected.items():
    if vparams[name].shape != shape:
      raise CheckpointError(f"vision tensor {name} has shape {vparams[name].shape}, expected {shape} from config.json")
  if tower:
    raise CheckpointError(f"unexpected vision tensors {sorted(tower)[:5]}; vision_config does not match the weights")
  return jax.tree.map(lambda a: a.astype(dtype), vparams)


def text_tensors(tensors: dict) -> dict:
  """The language model's tensors: `convert`'s names are transformers' here."""
  return dict(tensors)


def vision_tensors(cfg: ModelConfig, vparams: dict, dtype=np.float32) -> dict[str, np.ndarray]:
  """The tower's tensors of params["vision"], as transformers writes them."""
  v = cfg.vision
  vp = jax.tree.map(lambda a: np.asarray(a, np.float32), vparams)
  shape = (v.embed_dim, v.num_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
  out = {"visual.patch_embed.proj.weight": vp["patch_ID"].T.reshape(shape)}
  out.update({f"visual.{name}": vp[ours].T if t else vp[ours] for name, ours, t in _MERGER_NAMES})
  layers = vp["layers"]
  for i in range(v.num_layers):
    for name, ours, t in _LAYER_NAMES:
      out[f"visual.blocks.{i}.{name}"] = layers[ours][i].T if t else layers[ours][i]
    out[f"visual.blocks.{i}.attn.qkv.weight"] = np.concatenate([layers[f"w{n}_DD"][i].T for n in "qkv"])
    out[f"visual.blocks.{i}.attn.qkv.bias"] = np.concatenate([layers[f"b{n}_D"][i] for n in "qkv"])
  return {k: np.ascontiguousarray(a).astype(dtype) for k, a in out.items()}
