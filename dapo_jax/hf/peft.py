"""LoRA adapters in PEFT's format: `save_peft` writes an adapter directory (adapter_config.json +
adapter_model.safetensors) that `peft.PeftModel.from_pretrained` loads onto the transformers base;
`load_peft` reads one back as the starting point of `lora.adapt`.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np

from dapo_jax.hf.safetensors import CheckpointError, read_safetensors, write_safetensors
from dapo_jax.model import lora as lora_lib
from dapo_jax.model import transformer as model_lib
from dapo_jax.paths import outside

# PEFT's Linear adapter computes y = x W^T + (alpha / r) * (x A^T) B^T with lora_A.weight [r, in]
# and lora_B.weight [out, in->r]: ours are a = A^T and b = B^T with the in/out axes unflattened in
# the same order as the HF weight's.

def _integral(x: float):
  """An integral float as an int (PEFT's config types lora_alpha as int)."""
  return int(x) if float(x).is_integer() else x


def _peft_name(layer: int, module: str, which: str) -> str:
  return f"base_model.model.model.layers.{layer}.{module}.lora_{which}.weight"


def save_peft(path: str, model_cfg: model_lib.ModelConfig, params: dict, base_model: str = "",
              dropout: float = 0.0) -> None:
  """Writes the adapters of an adapted tree as a PEFT LoRA adapter directory (adapter_config.json and
  adapter_model.safetensors), which `peft.PeftModel.from_pretrained` loads onto the base model.
  `dropout` is recorded as the adapter's lora_dropout (the run's `model.lora.dropout`)."""
  if not lora_lib.is_adapted(params):
    raise ValueError("save_peft needs an adapted parameter tree (lora.adapt); these params have no adapters")
  adapters = params["lora"]["layers"]
  names = {ours: (peft, module) for peft, (ours, module) in lora_lib.TARGETS.items()}
  targets = [names[n][0] for n in adapters]
  rank = next(iter(adapters.values()))["a"].shape[-1]
  tensors = {}
  for ours, ab in adapters.items():
    a, b = np.asarray(ab["a"], np.float32), np.asarray(ab["b"], np.float32)
    for l in range(model_cfg.num_layers):
      tensors[_peft_name(l, names[ours][1], "A")] = a[l].reshape(-1, rank).T
      tensors[_peft_name(l, names[ours][1], "B")] = b[l].reshape(rank, -1).T
  os.makedirs(path, exist_ok=True)
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model or None,
            "r": int(rank), "lora_alpha": _integral(float(params["lora_scale"]) * rank), "lora_dropout": float(dropout),
            "target_modules": sorted(targets), "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "use_dora": False, "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
            "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}
  with open(os.path.join(path, "adapter_config.json"), "w") as f:
    json.dump(config, f, indent=2)
  write_safetensors(os.path.join(path, "adapter_model.safetensors"), tensors)


def load_peft(path: str, model_cfg: model_lib.ModelConfig, base_quant: str = "") -> tuple[lora_lib.LoraConfig, dict]:
  """(LoraConfig, adapters) of a PEFT LoRA adapter directory for this model: the starting point of
  `lora.adapt(model_cfg, lora_cfg, params, rng, adapters)`. Fails naming the file and tensor when the
  adapter was made for another base (shapes) or uses a feature we do not run."""
  cfg_path = os.path.join(path, "adapter_config.json")
  if not os.path.exists(cfg_path):
    raise CheckpointError(f"{path}: no adapter_config.json (is this a PEFT adapter directory?)")
  for fn in ("adapter_config.json", "adapter_model.safetensors"):
    if outside(path, fn):
      raise CheckpointError(f"{path}: {outside(path, fn)}")
  try:
    config = json.load(open(cfg_path))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
  if not isinstance(config, dict) or config.get("peft_type") != "LORA":
    raise CheckpointError(f"{cfg_path}: peft_type={config.get('peft_type') if isinstance(config, dict) else None!r}, "
                          "expected 'LORA'")
  for key, ok in (("use_rslora", False), ("use_dora", False), ("fan_in_fan_out", False)):
    if config.get(key, ok) != ok:
      raise CheckpointError(f"{cfg_path}: {key}={config[key]!r} is not supported (expected {ok})")
  if config.get("rank_pattern") or config.get("alpha_pattern") or config.get("layers_to_transform") is not None:
    raise CheckpointError(f"{cfg_path}: per-layer ranks, alphas or layer subsets are not supported")
  if config.get("modules_to_save") or config.get("bias", "none") != "none":
    raise CheckpointError(f"{cfg_path}: modules_to_save / trained biases are not supported (adapters only)")
  targets = config.get("target_modules")
  if isinstance(targets, str) or not isinstance(targets, list):
    raise CheckpointError(f"{cfg_path}: target_modules={targets!r}: expected a list of projection names")
  try:
    lcfg = lora_lib.LoraConfig(rank=config.get("r"), alpha=config.get("lora_alpha"),
                               dropout=config.get("lora_dropout", 0.0),
                               targets=tuple(sorted(targets, key=list(lora_lib.TARGETS).index)
                                             if set(targets) <= set(lora_lib.TARGETS) else targets),
                               base_quant=base_quant)
  except (lora_lib.LoraError, TypeError) as e:
    raise CheckpointError(f"{cfg_path}: {e}") from None
  st_path = os.path.join(path, "adapter_model.safetensors")
  if not os.path.exists(st_path):
    raise CheckpointError(f"{path}: no adapter_model.safetensors")
  tensors = read_safetensors(st_path)
  used, layers = set(), {}
  for peft in lcfg.targets:
    ours, module = lora_lib.TARGETS[peft]
    a_shape, b_shape, _, _ = lora_lib.adapter_shapes(model_cfg, ours, lcfg.rank)
    a_hf = (lcfg.rank, math.prod(a_shape[:-1]))
    b_hf = (math.prod(b_shape[1:]), lcfg.rank)
    per_layer = {"a": [], "b": []}
    for l in range(model_cfg.num_layers):
      for which, hf_shape, shape in (("A", a_hf, a_shape), ("B", b_hf, b_shape)):
        name = _peft_name(l, module, which)
        if name not in tensors:
          raise CheckpointError(f"{st_path}: missing tensor {name!r} (target {peft}, {model_cfg.num_layers} layers)")
        arr = tensors[name]
        if tuple(arr.shape) != hf_shape:
          raise CheckpointError(f"{st_path}: tensor {name!r} has shape {tuple(arr.shape)}, expected {hf_shape} "
                                "for this base model (an adapter for another base?)")
        used.add(name)
        per_layer[which.lower()].append(np.asarray(arr, np.float32).T.reshape(shape))
    layers[ours] = {k: np.stack(v) for k, v in per_layer.items()}
  extra = sorted(set(tensors) - used)
  if extra:
    raise CheckpointError(f"{st_path}: unexpected tensors {extra[:3]}: not adapters of {lcfg.targets} on "
                          f"{model_cfg.num_layers} layers of this base")
  return lcfg, {"layers": layers}
