"""The architecture and numerics of a model: `ModelConfig`, with presets of the released models.

Frozen, so it can be a static jit argument. `dapo_jax.model` builds the network it describes;
`hf.config_from_hf` reads one from a Hugging Face config.json.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture and numerics of one model. Frozen, so it can be a static jit argument."""
  vocab_size: int          # V
  embed_dim: int           # D
  mlp_dim: int             # F
  num_layers: int          # L
  num_heads: int           # N
  num_kv_heads: int        # K
  head_dim: int            # H
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  qkv_bias: bool = False   # Qwen2 has it, Llama does not
  tie_embeddings: bool = True
  param_dtype: str = "float32"
  dtype: str = "float32"   # compute dtype: bfloat16 on GPU/TPU, float32 on CPU
  matmul_dtype: str = ""   # operands of the weight matmuls ("" = dtype), fp32 accumulation; bfloat16
                           # with dtype=float32 is mixed precision, 2x the matmul rate of CPUs with
                           # AVX512-BF16 (XLA:CPU runs a bf16 dot with f32 output on its fast path)
  remat: str = "none"      # what the backward pass re-computes: none | full (all but each layer's
                           # input) | dots (all but matmul outputs; the fastest on XLA:CPU too)
  attn_chunk: int = 0      # queries per attention block (0 = all at once); bounds score memory for long rows
  arch: str = "qwen2"      # HF family written by hf.save: qwen2 | llama | qwen3 | gemma3
  qk_norm: bool = False    # RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
  # RoPE scaling of the (global) layers, as HF `rope_scaling`: default | linear | llama3 | yarn.
  rope_type: str = "default"
  rope_factor: float = 1.0             # linear, llama3, yarn: context extension factor
  rope_low_freq_factor: float = 1.0    # llama3
  rope_high_freq_factor: float = 4.0   # llama3
  rope_original_max_pos: int = 8192    # llama3, yarn: pre-training context length
  rope_beta_fast: float = 32.0         # yarn ramp bounds (rotations)
  rope_beta_slow: float = 1.0
  rope_attention_factor: float = 0.0   # yarn: cos/sin scale (0 = 0.1 ln(factor) + 1)
  rope_truncate: bool = True           # yarn: round the correction range to whole dims
  # Local (sliding-window) layers, Gemma 3: they attend to the last `sliding_window` positions
  # (the query's own included) and use RoPE base `rope_local_theta`, unscaled.
  sliding_window: int = 0
  local_layers: tuple[int, ...] = ()   # indices of the local layers
  rope_local_theta: float = 10_000.0
  query_scale: float = 0.0             # attention scores scale by query_scale**-0.5 (0 = head_dim)
  attn_softcap: float = 0.0            # scores -> c*tanh(scores/c) before the softmax (0 = off)
  final_softcap: float = 0.0           # logits -> c*tanh(logits/c) (0 = off)

  def __post_init__(self):
    object.__setattr__(self, "local_layers", tuple(int(l) for l in self.local_layers))
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat={self.remat!r}; expected one of {sorted(REMAT_POLICIES)}")
    if self.arch not in ARCHS:
      raise ValueError(f"model.arch={self.arch!r}; expected one of {ARCHS}")
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"model.rope_type={self.rope_type!r}; expected one of {ROPE_TYPES}")
    if self.rope_type != "default" and self.rope_factor <= 0:
      raise ValueError(f"model.rope_factor={self.rope_factor} must be positive")
    if self.rope_type == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
      raise ValueError(f"model.rope_high_freq_factor={self.rope_high_freq_factor} must exceed "
                       f"model.rope_low_freq_factor={self.rope_low_freq_factor}")
    bad = [l for l in self.local_layers if not 0 <= l < self.num_layers]
    if bad:
      raise ValueError(f"model.local_layers={self.local_layers} names layers outside 0..{self.num_layers - 1}")
    if self.local_layers and self.sliding_window <= 0:
      raise ValueError(f"model.local_layers={self.local_layers} needs model.sliding_window > 0")
    for f in ("param_dtype", "dtype", "matmul_dtype"):
      name = getattr(self, f)
      if f == "matmul_dtype" and not name:
        continue  # "" = dtype
      try:
        jnp.dtype(name)
      except TypeError as e:
        raise ValueError(f"{f}={name!r} is not a dtype name") from e

  @property
  def operand_dtype(self) -> str:
    """The dtype the weight matmuls read their operands in."""
    return self.matmul_dtype or self.dtype

  @property
  def gemma(self) -> bool:
    """Gemma's layer: (1 + w) norms, post-norms, GeGLU, embedding scaled by sqrt(D)."""
    return self.arch == "gemma3"

  @property
  def num_params(self) -> int:
    D, F, N, K, H, V, L = (self.embed_dim, self.mlp_dim, self.num_heads, self.num_kv_heads,
                           self.head_dim, self.vocab_size, self.num_layers)
    per_layer = D * H * (2 * N + 2 * K) + 3 * D * F + 2 * D + (H * (N + 2 * K) if self.qkv_bias else 0)
    per_layer += (2 * H if self.qk_norm else 0) + (2 * D if self.gemma else 0)
    return V * D * (1 if self.tie_embeddings else 2) + L * per_layer + D

  # Presets (Qwen2.5 family, from their HF config.json files).
  @classmethod
  def qwen2_5_32b(cls, **kw) -> "ModelConfig":
    return cls(vocab_size=152_064, embed_dim=5120, mlp_dim=27_648, num_layers=64, num_heads=40,
               num_kv_heads=8, head_dim=128, rope_theta=1e6, norm_eps=1e-5, qkv_bias=True,
               tie_embeddings=False, **kw)

  @classmethod
  def qwen2_5_7b(cls, **kw) -> "ModelConfig":
    return cls(vocab_size=152_064, embed_dim=3584, mlp_dim=18_944, num_layers=28, num_heads=28,
               num_kv_heads=4, head_dim=128, rope_theta=1e6, norm_eps=1e-6, qkv_bias=True,
               tie_embeddings=False, **kw)

  @classmethod
  def qwen2_5_0_5b(cls, **kw) -> "ModelConfig":
    return cls(vocab_size=151_936, embed_dim=896, mlp_dim=4864, num_layers=24, num_heads=14,
               num_kv_heads=2, head_dim=64, rope_theta=1e6, norm_eps=1e-6, qkv_bias=True,
               tie_embeddings=True, **kw)


  @classmethod
  def qwen3_8b(cls, **kw) -> "ModelConfig":
    return cls(vocab_size=151_936, embed_dim=4096, mlp_dim=12_288, num_layers=36, num_heads=32,
               num_kv_heads=8, head_dim=128, rope_theta=1e6, norm_eps=1e-6, qkv_bias=False,
               tie_embeddings=False, arch="qwen3", qk_norm=True, **kw)

  @classmethod
  def llama3_1_8b(cls, **kw) -> "ModelConfig":
    return cls(vocab_size=128_256, embed_dim=4096, mlp_dim=14_336, num_layers=32, num_heads=32,
               num_kv_heads=8, head_dim=128, rope_theta=500_000.0, norm_eps=1e-5, qkv_bias=False,
               tie_embeddings=False, arch="llama", rope_type="llama3", rope_factor=8.0,
               rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_pos=8192, **kw)

  @classmethod
  def gemma3_4b(cls, **kw) -> "ModelConfig":
    """The text model of Gemma 3 4B (every 6th layer global, the rest a 1024-token window)."""
    L = 34
    return cls(vocab_size=262_208, embed_dim=2560, mlp_dim=10_240, num_layers=L, num_heads=8,
               num_kv_heads=4, head_dim=256, rope_theta=1e6, norm_eps=1e-6, qkv_bias=False,
               tie_embeddings=True, arch="gemma3", qk_norm=True, rope_type="linear", rope_factor=8.0,
               sliding_window=1024, local_layers=tuple(l for l in range(L) if (l + 1) % 6),
               rope_local_theta=10_000.0, query_scale=256.0, **kw)


ARCHS = ("qwen2", "llama", "qwen3", "gemma3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
