"""Interchange formats: Hugging Face directories (`convert`: load, save, load_scalar, save_scalar),
safetensors, PEFT adapters and GGUF files, which convert through them. No torch, no remote code."""
from dapo_jax.hf.convert import (
                                 SCALAR_CLASSES,
                                 SUPPORTED,
                                 config_from_hf,
                                 config_to_hf,
                                 load,
                                 load_config,
                                 load_scalar,
                                 params_from_tensors,
                                 params_to_tensors,
                                 save,
                                 save_scalar,
)
from dapo_jax.hf.safetensors import CheckpointError
