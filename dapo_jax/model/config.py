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


VISION_KINDS = ("siglip", "qwen2_5_vl")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
  """A vision tower and its projector: Gemma 3's SigLIP tower with its pooling projector (kind "siglip", HF
  `vision_config` and the top-level fields), or Qwen2.5-VL's windowed ViT with its patch merger (kind
  "qwen2_5_vl")."""
  image_size: int = 896         # S: pixels a side (the image processor resizes every image to it)
  patch_size: int = 14          # p: P = (S/p)^2 patches
  embed_dim: int = 1152         # Dv
  mlp_dim: int = 4304
  num_layers: int = 27
  num_heads: int = 16
  num_channels: int = 3
  norm_eps: float = 1e-6
  tokens_per_image: int = 256   # M: soft tokens an image becomes (siglip: pooled patches; qwen2_5_vl: merged)
  image_token_id: int = 262_144  # the placeholder a prompt holds M of per image
  boi_token_id: int = 255_999   # begin / end of image, around the placeholders (the chat template's)
  eoi_token_id: int = 256_000
  kind: str = "siglip"          # siglip (Gemma 3) | qwen2_5_vl
  # Qwen2.5-VL's tower: a still image is `temporal_patch_size` equal frames; `merge_size`^2 neighbouring
  # patches become one token; attention runs in windows of `window_size` pixels a side except in
  # `full_attention_layers`; patches carry 2D rotary positions of base `rope_theta`.
  temporal_patch_size: int = 2
  merge_size: int = 2
  window_size: int = 112
  full_attention_layers: tuple[int, ...] = ()
  rope_theta: float = 10_000.0
  # Qwen2.5-VL: each image keeps its aspect ratio and its own token count, as transformers' processor
  # makes them (`smart_resize`, at most S^2 pixels: up to `tokens_per_image` tokens); False: every image
  # resized to S x S.
  native_resolution: bool = False

  def __post_init__(self):
    object.__setattr__(self, "full_attention_layers", tuple(int(l) for l in self.full_attention_layers))
    side = self.image_size // self.patch_size
    if self.kind not in VISION_KINDS:
      raise ValueError(f"model.vision.kind={self.kind!r}; expected one of {VISION_KINDS}")
    if self.image_size % self.patch_size:
      raise ValueError(f"model.vision.image_size={self.image_size} must be a multiple of patch_size={self.patch_size}")
    if self.embed_dim % self.num_heads:
      raise ValueError(f"model.vision.embed_dim={self.embed_dim} must be a multiple of num_heads={self.num_heads}")
    if self.native_resolution and self.kind != "qwen2_5_vl":
      raise ValueError(f"model.vision.native_resolution=True needs kind 'qwen2_5_vl', not {self.kind!r}")
    if self.kind == "qwen2_5_vl":
      if side % self.merge_size or self.tokens_per_image != (side // self.merge_size) ** 2:
        raise ValueError(f"model.vision.image_size={self.image_size} must be a multiple of patch_size x merge_size "
                         f"= {self.patch_size * self.merge_size}, and tokens_per_image={self.tokens_per_image} "
                         f"its merged tokens, (image_size / {self.patch_size * self.merge_size})^2")
      if (self.embed_dim // self.num_heads) % 4:
        raise ValueError(f"model.vision.embed_dim / num_heads = {self.embed_dim // self.num_heads} must be a "
                         "multiple of 4 (2D rotary positions)")
      bad = [l for l in self.full_attention_layers if not 0 <= l < self.num_layers]
      if bad:
        raise ValueError(f"model.vision.full_attention_layers={self.full_attention_layers} names layers outside "
                         f"0..{self.num_layers - 1}")
      return
    pooled = round(self.tokens_per_image ** 0.5)
    if pooled * pooled != self.tokens_per_image or side % pooled:
      raise ValueError(f"model.vision.tokens_per_image={self.tokens_per_image} must be a square whose side divides "
                       f"the {side} patches a side")

  @property
  def num_patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2

  @property
  def grid(self) -> tuple[int, int]:
    """Qwen2.5-VL: (patches a side, merged tokens a side) of one image."""
    g = self.image_size // self.patch_size
    return g, g // self.merge_size

  @property
  def bidirectional(self) -> bool:
    """An image's placeholders see each other both ways (Gemma 3); Qwen2.5-VL keeps attention causal."""
    return self.kind == "siglip"


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
  attention_impl: str = "einsum"  # the attention core: einsum (ours: heads-major, fastest on XLA:CPU) |
                           # xla | cudnn (`jax.nn.dot_product_attention`; cudnn = fused flash attention on
                           # NVIDIA GPUs, bf16/fp16 only). Soft-capped scores and the shared-prompt layout
                           # stay on einsum (`layers.attention`)
  # How a shard's queries reach the keys of the other shards of mesh.sequence: gather (each layer's keys
  # and values gathered whole) | ring (`ring_attention`: blocks passed around; packed sequences only).
  sequence_attention: str = "gather"
  logits_chunk: int = 0    # completion positions unembedded at once by the RL objectives (0 = all): the
                           # B x C x V logits never exist whole, forward or backward (a 262K vocabulary)
  arch: str = "qwen2"      # HF family written by hf.save: qwen2 | llama | qwen3 | qwen3_moe | gemma3
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
  # Mixture of experts (Qwen3-MoE): every layer not in `dense_layers` replaces its MLP by
  # `num_experts` SwiGLU experts of width `expert_mlp_dim`; a router sends each token to its
  # `experts_per_token` most probable experts and sums their outputs weighted by those probabilities.
  num_experts: int = 0                 # E (0 = a dense model)
  experts_per_token: int = 0           # k, the top-k of the router
  expert_mlp_dim: int = 0              # F of one expert
  norm_topk_prob: bool = False         # renormalise the k chosen probabilities to sum to 1
  dense_layers: tuple[int, ...] = ()   # layers that keep the dense MLP (HF mlp_only_layers, decoder_sparse_step)
  router_aux_coef: float = 0.0         # weight of the load-balancing loss in training (0 = off, as verl)
  expert_chunk: int = 0                # tokens per device per expert-dispatch block (0 = all at once);
                                       # bounds the dispatch buffers of long rows, as attn_chunk the scores
  # Routing replay (verl's names): "R3" = the sampler records each token's experts and the π_old and
  # update passes route the completion tokens to them (rollout routing replay); "R2" = the π_old pass
  # records them and the updates route so (vanilla routing replay); "disabled" = off.
  router_replay: str = "disabled"
  # A vision-language model (Gemma 3 or Qwen2.5-VL with images): its vision tower and projector; None = text only.
  vision: VisionConfig | None = None
  # Qwen2.5-VL's multimodal rotary positions (M-RoPE): the H/2 frequencies split in sections that rotate by
  # an image token's (temporal, height, width) position; text rotates by its position in all three. () = off.
  mrope_section: tuple[int, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "local_layers", tuple(int(l) for l in self.local_layers))
    object.__setattr__(self, "dense_layers", tuple(int(l) for l in self.dense_layers))
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat={self.remat!r}; expected one of {sorted(REMAT_POLICIES)}")
    if self.arch not in ARCHS:
      raise ValueError(f"model.arch={self.arch!r}; expected one of {ARCHS}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"model.attention_impl={self.attention_impl!r}; expected one of {ATTENTION_IMPLS}")
    if self.attention_impl == "cudnn" and self.dtype not in ("bfloat16", "float16"):
      raise ValueError(f"model.attention_impl='cudnn' runs in bfloat16 or float16 only; model.dtype={self.dtype!r} "
                       "(set model.dtype=bfloat16, or attention_impl=xla)")
    if self.sequence_attention not in ("gather", "ring"):
      raise ValueError(f"model.sequence_attention={self.sequence_attention!r}; expected 'gather' or 'ring'")
    if self.sequence_attention == "ring" and self.attn_softcap:
      raise ValueError("model.sequence_attention='ring' has no soft-capped scores (model.attn_softcap); use 'gather'")
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
    self._check_experts()
    object.__setattr__(self, "mrope_section", tuple(int(n) for n in self.mrope_section))
    if isinstance(self.vision, VisionConfig):
      family = {"siglip": "gemma3", "qwen2_5_vl": "qwen2"}[self.vision.kind]
      if self.arch != family:
        raise ValueError(f"model.vision.kind={self.vision.kind!r} is set with model.arch={self.arch!r}: its "
                         f"images go with arch {family!r}")
    if self.mrope_section and (sum(self.mrope_section) != self.head_dim // 2 or len(self.mrope_section) != 3
                               or getattr(self.vision, "kind", None) != "qwen2_5_vl"):
      raise ValueError(f"model.mrope_section={self.mrope_section}: three sections summing to head_dim / 2 = "
                       f"{self.head_dim // 2}, with a qwen2_5_vl vision tower")
    if getattr(self.vision, "kind", None) == "qwen2_5_vl" and not self.mrope_section:
      raise ValueError("model.vision.kind='qwen2_5_vl' needs model.mrope_section (its three rotary sections)")
    for f in ("param_dtype", "dtype", "matmul_dtype"):
      name = getattr(self, f)
      if f == "matmul_dtype" and not name:
        continue  # "" = dtype
      try:
        jnp.dtype(name)
      except TypeError as e:
        raise ValueError(f"{f}={name!r} is not a dtype name") from e

  def _check_experts(self) -> None:
    if (self.arch == "qwen3_moe") != (self.num_experts > 0):
      raise ValueError(f"model.num_experts={self.num_experts} with model.arch={self.arch!r}: experts (num_experts "
                       "> 0) go with arch 'qwen3_moe' and only with it")
    if self.router_replay not in ROUTER_REPLAY:
      raise ValueError(f"model.router_replay={self.router_replay!r}; expected one of {ROUTER_REPLAY}")
    if self.router_replay != "disabled" and not self.moe:
      raise ValueError(f"model.router_replay={self.router_replay!r} replays experts: it needs an expert model "
                       "(model.num_experts > 0)")
    if not self.moe:
      return
    if not 1 <= self.experts_per_token <= self.num_experts:
      raise ValueError(f"model.experts_per_token={self.experts_per_token} must be in 1..num_experts={self.num_experts}")
    if self.expert_mlp_dim < 1:
      raise ValueError(f"model.expert_mlp_dim={self.expert_mlp_dim} must be positive")
    bad = [l for l in self.dense_layers if not 0 <= l < self.num_layers]
    if bad:
      raise ValueError(f"model.dense_layers={self.dense_layers} names layers outside 0..{self.num_layers - 1}")
    if self.expert_chunk < 0:
      raise ValueError(f"model.expert_chunk={self.expert_chunk} must be >= 0")
    if self.router_aux_coef < 0:
      raise ValueError(f"model.router_aux_coef={self.router_aux_coef} must be >= 0")

  @property
  def moe(self) -> bool:
    return self.num_experts > 0

  def is_moe_layer(self, l: int) -> bool:
    return self.moe and l not in self.dense_layers

  @property
  def num_moe_layers(self) -> int:
    return sum(self.is_moe_layer(l) for l in range(self.num_layers))

  @property
  def layer_runs(self) -> tuple[tuple[int, int, bool], ...]:
    """(start, stop, moe) of each maximal run of consecutive layers of one kind (MLP or experts).

    Each run is one scanned stack of identical layers; a model whose layers are all alike (every
    dense model, every released Qwen3-MoE) is one run.
    """
    runs, start = [], 0
    for l in range(1, self.num_layers + 1):
      if l == self.num_layers or self.is_moe_layer(l) != self.is_moe_layer(start):
        runs.append((start, l, self.is_moe_layer(start)))
        start = l
    return tuple(runs)

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
    per_layer = D * H * (2 * N + 2 * K) + 2 * D + (H * (N + 2 * K) if self.qkv_bias else 0)
    per_layer += (2 * H if self.qk_norm else 0) + (2 * D if self.gemma else 0)
    moe_layers = sum(self.is_moe_layer(l) for l in range(L))
    mlps = (L - moe_layers) * 3 * D * F + moe_layers * self.num_experts * D * (1 + 3 * self.expert_mlp_dim)
    return V * D * (1 if self.tie_embeddings else 2) + L * per_layer + mlps + D

  @property
  def num_expert_params(self) -> int:
    """Parameters of the experts and routers (they shard over the mesh's expert axis)."""
    moe_layers = sum(self.is_moe_layer(l) for l in range(self.num_layers))
    return moe_layers * self.num_experts * self.embed_dim * (1 + 3 * self.expert_mlp_dim)

  @property
  def num_active_params(self) -> int:
    """Parameters one token's forward reads: those of the k experts it is routed to, not all E."""
    if not self.moe:
      return self.num_params
    moe_layers = sum(self.is_moe_layer(l) for l in range(self.num_layers))
    unused = self.num_experts - self.experts_per_token
    return self.num_params - moe_layers * unused * 3 * self.embed_dim * self.expert_mlp_dim

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
  def qwen3_30b_a3b(cls, **kw) -> "ModelConfig":
    """Qwen3-30B-A3B: 48 layers of 128 experts, 8 per token (3.3B of its 30.5B parameters active)."""
    return cls(vocab_size=151_936, embed_dim=2048, mlp_dim=6144, num_layers=48, num_heads=32,
               num_kv_heads=4, head_dim=128, rope_theta=1e6, norm_eps=1e-6, qkv_bias=False,
               tie_embeddings=False, arch="qwen3_moe", qk_norm=True, num_experts=128, experts_per_token=8,
               expert_mlp_dim=768, norm_topk_prob=True, **kw)

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


ARCHS = ("qwen2", "llama", "qwen3", "qwen3_moe", "gemma3")
ATTENTION_IMPLS = ("einsum", "xla", "cudnn")
ROUTER_REPLAY = ("disabled", "R2", "R3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
