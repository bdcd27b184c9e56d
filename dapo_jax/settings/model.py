"""The `model` and `tokenizer` sections: which policy a run trains and how its numbers are computed."""
from __future__ import annotations

import dataclasses

from dapo_jax.model import lora as lora_lib
from dapo_jax.model.config import REMAT_POLICIES, VISION_KINDS, ModelConfig, VisionConfig
from dapo_jax.settings.section import Section, check

INITS = ("random", "hf", "gguf", "sft")
DTYPES = ("float32", "bfloat16", "float16")
# Fields of `model` that are not in an HF config.json: they apply to a loaded model too.
RUNTIME_FIELDS = ("param_dtype", "dtype", "matmul_dtype", "remat", "attn_chunk", "logits_chunk",
                  "router_aux_coef", "expert_chunk", "attention_impl", "router_replay", "sequence_attention")


@dataclasses.dataclass(frozen=True)
class Lora(Section):
  """`model.lora`: adapters of rank `rank` on the `targets` projections of every layer (PEFT's names),
  the base frozen; the reference model is the base with its adapters off. rank 0 = full fine-tuning."""
  NAME = "model.lora"
  rank: int = 0                    # adapter rank; 0 = no adapters (full fine-tuning)
  alpha: float = lora_lib.LoraConfig.alpha
  dropout: float = lora_lib.LoraConfig.dropout
  targets: tuple[str, ...] = lora_lib.ALL_TARGETS

  def check(self) -> None:
    self.number("rank", 0, integer=True, allowed=">= 0 (0 = full fine-tuning)")


_VISION = VisionConfig  # Its defaults are Gemma 3's tower.


@dataclasses.dataclass(frozen=True)
class Vision(Section):
  """`model.vision`: the vision tower and projector of a model built here (`model.vision`; a loaded
  model's come from its config.json). Its image tokens are the tokenizer's (`data.images`)."""
  NAME = "model.vision"
  image_size: int = 0              # S, pixels a side; 0 = a text model (no tower)
  kind: str = _VISION.kind         # siglip (Gemma 3's tower, model.arch=gemma3) | qwen2_5_vl (model.arch=qwen2)
  patch_size: int = _VISION.patch_size
  embed_dim: int = _VISION.embed_dim
  mlp_dim: int = _VISION.mlp_dim
  num_layers: int = _VISION.num_layers
  num_heads: int = _VISION.num_heads
  tokens_per_image: int = _VISION.tokens_per_image   # M, soft tokens per image (a square)
  merge_size: int = _VISION.merge_size               # qwen2_5_vl: patches a side merged into a token
  window_size: int = _VISION.window_size             # qwen2_5_vl: pixels a side of an attention window
  full_attention_layers: tuple[int, ...] = _VISION.full_attention_layers  # qwen2_5_vl: layers without windows
  # qwen2_5_vl: each image keeps its aspect ratio and token count (`VisionConfig.native_resolution`); True
  # turns it on for a loaded Qwen2.5-VL too
  native_resolution: bool = _VISION.native_resolution

  def check(self) -> None:
    self.number("image_size", 0, integer=True)
    if self.image_size:
      self.choice("kind", VISION_KINDS)
      for f in ("patch_size", "embed_dim", "mlp_dim", "num_layers", "num_heads", "tokens_per_image", "merge_size",
                "window_size"):
        self.number(f, 1, integer=True)

  def config(self, tok) -> VisionConfig | None:
    """The tower these fields describe, its token ids the tokenizer's (`images.image_token_ids`; no `tok`:
    the defaults); None: no tower."""
    if not self.image_size:
      return None
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    if tok is None:  # Shapes alone (launch.plan): the token ids do not matter.
      return VisionConfig(**fields)
    from dapo_jax.data import images as images_lib
    boi, img, eoi = images_lib.image_token_ids(tok, "model.vision", self.kind)
    return VisionConfig(**fields, image_token_id=img, boi_token_id=boi, eoi_token_id=eoi)


@dataclasses.dataclass(frozen=True)
class Model(Section, ModelConfig):
  """`model`: the architecture fields of `ModelConfig` (documented there; a loaded model takes them from
  its config.json, all but `RUNTIME_FIELDS`) and where the initial weights come from."""
  NAME = "model"
  # "random" (from the fields below), "hf" (from hf_dir), "gguf" (from gguf: a .gguf file, "smollm2" or
  # "gemma3_270m", converted once into WORKDIR/model) or "sft" (random, then the SFT warm start, reused later).
  init: str = "random"
  hf_dir: str = ""                 # init="hf": a local Hugging Face model directory
  gguf: str = ""                   # init="gguf": a .gguf file, "smollm2" or "gemma3_270m"
  vocab_size: int = 0              # 0 = the tokenizer's, rounded up to a multiple of 64
  embed_dim: int = 128             # D (the default job's small Qwen2)
  mlp_dim: int = 384               # F
  num_layers: int = 4              # L
  num_heads: int = 4               # N, query heads
  num_kv_heads: int = 2            # K, key/value heads (grouped-query attention)
  head_dim: int = 32               # H
  qkv_bias: bool = True            # the default family, qwen2, has q/k/v biases
  remat: str = "dots"              # on XLA:CPU "dots" is also the fastest for training
  lora: Lora = Lora()              # LoRA adapters (the `Lora` section)
  vision: Vision = Vision()        # a vision tower for images in prompts (the `Vision` section; arch gemma3)
  base_quant: str = lora_lib.LoraConfig.base_quant   # "int8": the frozen base's layer matrices (needs lora.rank)
  train_vision: bool = False       # RL trains the vision tower and projector too (each pass runs it on the pixels)

  def __post_init__(self):
    self.check()  # The section's one-line errors first, then the architecture's own.
    super().__post_init__()

  def check(self) -> None:
    self.choice("init", INITS)
    self.choice("remat", tuple(REMAT_POLICIES))
    for f in ("param_dtype", "dtype"):
      self.choice(f, DTYPES)
    self.choice("matmul_dtype", ("",) + DTYPES, f"'' or one of {DTYPES}")
    self.number("vocab_size", 0, integer=True)
    self.number("attn_chunk", 0, integer=True)
    self.number("logits_chunk", 0, integer=True)
    check(not (self.train_vision and self.lora.rank), "model.train_vision", self.train_vision,
          "False with model.lora.rank > 0 (the adapters are the language model's; the tower stays frozen)")
    if self.init in ("random", "sft"):
      for f in ("embed_dim", "mlp_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
        self.number(f, 1, integer=True)
      check(self.num_heads % self.num_kv_heads == 0, "model.num_heads", self.num_heads,
            f"a multiple of model.num_kv_heads={self.num_kv_heads}")
      check(self.head_dim % 2 == 0, "model.head_dim", self.head_dim, "an even number (rotary embeddings)")
      self.number("rope_theta", 0, lo_open=True)
      self.number("norm_eps", 0, lo_open=True)
    check(not self.base_quant or self.lora.rank > 0, "model.base_quant", self.base_quant,
          "'' without LoRA (only a frozen base is quantized: set model.lora.rank)")
    self.lora_config()  # LoRA's own checks (targets, alpha, dropout, base_quant).

  def architecture(self, vocab_size: int, tok=None) -> ModelConfig:
    """The `ModelConfig` these fields describe, with `vocab_size` unless the section sets one (and the
    vision tower's image tokens `tok`'s)."""
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(ModelConfig)}
    vision = self.vision.config(tok) if self.vision.image_size else None
    return ModelConfig(**{**fields, "vocab_size": self.vocab_size or vocab_size, "vision": vision})

  def runtime_overrides(self) -> dict:
    """The fields that apply to a model loaded from disk (not in its config.json)."""
    out = {f: getattr(self, f) for f in RUNTIME_FIELDS}
    return dict(out, native_resolution=True) if self.vision.native_resolution else out

  def lora_config(self) -> lora_lib.LoraConfig | None:
    """LoRA adapters on a frozen base (lora.rank > 0), or None: full fine-tuning."""
    if self.lora.rank == 0:
      return None
    return lora_lib.LoraConfig(rank=self.lora.rank, alpha=self.lora.alpha, dropout=self.lora.dropout,
                               targets=tuple(self.lora.targets), base_quant=self.base_quant)


@dataclasses.dataclass(frozen=True)
class Tokenizer(Section):
  """`tokenizer`: a directory to load, or the size of a BPE trained on the task's text."""
  NAME = "tokenizer"
  path: str = ""                   # "" = the model's (hf, gguf), else a BPE trained on the task text into WORKDIR
  vocab_size: int = 256            # the trained BPE's vocabulary

  def check(self) -> None:
    self.number("vocab_size", 1, integer=True)
