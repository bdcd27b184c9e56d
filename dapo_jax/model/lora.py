"""LoRA adapters as a separate tree on a frozen (optionally int8) base.

An adapted parameter tree is {"base": the model's params (layer matrices possibly int8, see
`quant`), "lora": {"layers": {weight: {"a": [L, in.., r], "b": [L, r, out..]}}}, "lora_scale":
fp32 scalar alpha / r}. A target projection y = x W becomes y = x W + lora_scale (x a) b
(`layers.dense`); b starts at 0, so the adapted model starts as the base. Only "lora" is
trained: gradients and optimizer state exist for the adapters alone (and a reward model's new
scalar head, `HEAD`). Dropout (PEFT's
lora_dropout) acts on the adapters' input in the train step's forward alone (`with_dropout`).
The reference model is the same tree with lora_scale = 0 (`adapters_off`): one forward with a
switch, no second base.
The sampler decodes an int8 base from its int8 matrices with the adapters unmerged, and a float
base with the adapters merged into its per-call decode weights (`merge_layers`; see
`model.decode_params`).
Target names are PEFT's (q_proj, ..., down_proj), so `peft_format.save_peft` / `peft_format.load_peft` exchange
adapters with `peft`.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from dapo_jax import errors, sharding
from dapo_jax.model import quant
from dapo_jax.model.config import ModelConfig

# PEFT target name -> (our weight, its HF module path inside a layer).
TARGETS = {"q_proj": ("wq_DNH", "self_attn.q_proj"), "k_proj": ("wk_DKH", "self_attn.k_proj"),
           "v_proj": ("wv_DKH", "self_attn.v_proj"), "o_proj": ("wo_NHD", "self_attn.o_proj"),
           "gate_proj": ("w_gate_DF", "mlp.gate_proj"), "up_proj": ("w_up_DF", "mlp.up_proj"),
           "down_proj": ("w_down_FD", "mlp.down_proj")}
ALL_TARGETS = tuple(TARGETS)


class LoraError(errors.UserError, ValueError):
  """A LoRA setting or adapter that cannot work with this model; the message names it."""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Adapters of rank `rank` on the `targets` projections of every layer; `base_quant` "int8"
  stores the frozen base's layer matrices as int8 (weight-only)."""
  rank: int = 16
  alpha: float = 32.0                  # adapter output scales by alpha / rank
  dropout: float = 0.0                 # probability of dropping an adapter input (training forwards only)
  targets: tuple[str, ...] = ALL_TARGETS
  base_quant: str = ""                 # "" (float base) | "int8"

  def __post_init__(self):
    object.__setattr__(self, "targets", tuple(self.targets))
    unknown = [t for t in self.targets if t not in TARGETS]
    if unknown:
      raise LoraError(f"model.lora.targets: {unknown} is not a projection of this model; expected names "
                      f"among {ALL_TARGETS}")
    if not self.targets:
      raise LoraError(f"model.lora.targets is empty; expected names among {ALL_TARGETS}")
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
      raise LoraError(f"model.lora.rank={self.rank!r}: expected an integer >= 1")
    if not self.alpha > 0:
      raise LoraError(f"model.lora.alpha={self.alpha!r}: expected a number > 0")
    if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
      raise LoraError(f"model.lora.dropout={self.dropout!r}: expected a probability in [0, 1)")
    if self.base_quant not in quant.KINDS:
      raise LoraError(f"model.base_quant={self.base_quant!r}: expected one of {quant.KINDS}")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  @property
  def weights(self) -> tuple[str, ...]:
    """Our names of the target weights."""
    return tuple(TARGETS[t][0] for t in self.targets)


# A scalar head (a reward model's `score_D`) is new, so it cannot be frozen: with adapters it sits
# in the trained tree ("lora") and is trained in full, as PEFT's modules_to_save trains a
# sequence classifier's `score`.
HEAD = "score_D"


def is_adapted(params) -> bool:
  return isinstance(params, dict) and "base" in params


def adapter_shapes(cfg: ModelConfig, name: str, rank: int) -> tuple[tuple, tuple, str, str]:
  """(a shape, b shape, a's input letters, b's output letters) of one layer's adapter on `name`."""
  dims = dict(D=cfg.embed_dim, F=cfg.mlp_dim, N=cfg.num_heads, K=cfg.num_kv_heads, H=cfg.head_dim)
  letters = name.rsplit("_", 1)[1]
  n_in = quant.MATRICES[name]
  ins, outs = letters[:n_in], letters[n_in:]
  return tuple(dims[c] for c in ins) + (rank,), (rank,) + tuple(dims[c] for c in outs), ins, outs


def init(cfg: ModelConfig, lcfg: LoraConfig, rng: jax.Array) -> dict:
  """Fresh adapters: a as PEFT's default (Kaiming-uniform, bound 1/sqrt(fan_in)), b = 0."""
  layers = {}
  for i, name in enumerate(lcfg.weights):
    a_shape, b_shape, _, _ = adapter_shapes(cfg, name, lcfg.rank)
    bound = 1.0 / math.sqrt(math.prod(a_shape[:-1]))
    a = jax.random.uniform(jax.random.fold_in(rng, i), (cfg.num_layers,) + a_shape, jnp.float32, -bound, bound)
    layers[name] = {"a": a, "b": jnp.zeros((cfg.num_layers,) + b_shape, jnp.float32)}
  return {"layers": layers}


def adapt(cfg: ModelConfig, lcfg: LoraConfig, params: dict, rng: jax.Array, adapters: dict | None = None) -> dict:
  """The adapted tree of base `params`: quantized as `lcfg.base_quant` says, with `adapters`
  (e.g. `peft_format.load_peft`'s) or fresh ones. An adapted tree is returned as it is."""
  if is_adapted(params):
    return params
  lora = adapters if adapters is not None else init(cfg, lcfg, rng)
  base = params
  if HEAD in params:  # A reward model's head trains in full, beside the adapters.
    base = {k: v for k, v in params.items() if k != HEAD}
    lora = dict(lora, **{HEAD: params[HEAD]})
  return {"base": quant.quantize_base(base, lcfg.base_quant), "lora": lora,
          "lora_scale": jnp.asarray(lcfg.scale, jnp.float32)}


def adapters_off(params: dict) -> dict:
  """The same base with its adapters switched off (the reference model); shares every array but
  the scale."""
  return dict(params, lora_scale=jnp.zeros_like(params["lora_scale"]))


def with_dropout(params: dict, rate: float, rng: jax.Array) -> dict:
  """The adapted tree as the train step's forward sees it: every adapter input x is replaced by
  x * mask / (1 - rate), mask ~ Bernoulli(1 - rate), before `a` (PEFT's lora_dropout), with masks
  drawn from `rng` (one per layer and target). Nothing else adds this entry, so the sampler, the
  π_old and reference log-probs and evaluation never drop. `rate` 0 returns `params` unchanged."""
  if not rate:
    return params
  return dict(params, lora_dropout={"rate": jnp.asarray(rate, jnp.float32), "rng": rng})


def dropout_key(seed: int, update: jax.Array, microbatch) -> jax.Array:
  """The dropout key of one micro-batch of one optimizer update: a function of the run's seed and
  the update count (`TrainState.step`, checkpointed), so a resumed run draws the same masks."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), update), microbatch)


def flax_variables(params) -> dict:
  """The flax variables `model.Transformer` applies: {"params": base} and, adapted, {"lora": ...}
  (with dropout: the rate and one key per layer, which `nn.scan` hands to each layer)."""
  if not is_adapted(params):
    return {"params": params}
  base = params["base"]
  lora = dict(params["lora"], scale=params["lora_scale"])
  if HEAD in lora:
    base = dict(base, **{HEAD: lora.pop(HEAD)})
  drop = params.get("lora_dropout")
  if drop is not None:
    num_layers = jax.tree.leaves(params["lora"]["layers"])[0].shape[0]
    lora["layers"] = dict(lora["layers"], dropout_rng=jax.random.split(drop["rng"], num_layers))
    lora["dropout_rate"] = drop["rate"]
  return {"params": base, "lora": lora}


def merge_layers(params: dict, dtype=jnp.float32) -> dict:
  """The base's "layers" with the adapters merged in and int8 matrices dequantized: W + scale * a b."""
  base, scale = params["base"], params["lora_scale"].astype(jnp.float32)
  layers = dict(base["layers"])
  for name, w in layers.items():
    if name not in quant.MATRICES:
      continue
    w = quant.dequantize(w, quant.MATRICES[name]) if quant.is_quantized(w) else w.astype(jnp.float32)
    ad = params["lora"]["layers"].get(name)
    if ad is not None:
      a_LIr = ad["a"].reshape(ad["a"].shape[0], -1, ad["a"].shape[-1]).astype(jnp.float32)
      b_LrO = ad["b"].reshape(ad["b"].shape[0], ad["b"].shape[1], -1).astype(jnp.float32)
      w = w + scale * jnp.einsum("LIr,LrO->LIO", a_LIr, b_LrO, precision="highest").reshape(w.shape)
    layers[name] = w.astype(dtype)
  return layers


def merge(params: dict) -> dict:
  """An ordinary (float) parameter tree equal to the adapted model: for export and comparison."""
  if not is_adapted(params):
    return params
  base = params["base"]
  head = {HEAD: params["lora"][HEAD]} if HEAD in params["lora"] else {}
  return dict(base, layers=merge_layers(params, base["embed_VD"].dtype), **head)


# --- shardings --------------------------------------------------------------------------------

def boxed(cfg: ModelConfig, lcfg: LoraConfig, base_boxed: dict) -> dict:
  """The adapted tree of `base_boxed` (model.init_boxed's, abstract or not) with logical-axis boxes:
  adapters shard like their weight's input (a) and output (b) axes, the rank axis is whole;
  int8 matrices like their weight, their scales like its output axes."""
  layers = dict(base_boxed["layers"])
  if lcfg.base_quant:
    for name, num_in in quant.MATRICES.items():
      box = layers[name]
      names = box.names
      q = jax.ShapeDtypeStruct(box.value.shape, jnp.int8)
      s = jax.ShapeDtypeStruct(box.value.shape[:1] + box.value.shape[1 + num_in:], jnp.float32)
      layers[name] = {"int8": box.replace_boxed(q), "scale": nn.Partitioned(s, names[:1] + names[1 + num_in:])}
  adapters = {}
  for name in lcfg.weights:
    a_shape, b_shape, ins, outs = adapter_shapes(cfg, name, lcfg.rank)
    L = (cfg.num_layers,)
    adapters[name] = {
        "a": nn.Partitioned(jax.ShapeDtypeStruct(L + a_shape, jnp.float32), ("layers",) + sharding.axes_of(ins) + (None,)),
        "b": nn.Partitioned(jax.ShapeDtypeStruct(L + b_shape, jnp.float32), ("layers", None) + sharding.axes_of(outs))}
  scale = nn.Partitioned(jax.ShapeDtypeStruct((), jnp.float32), ())
  base = {k: v for k, v in dict(base_boxed, layers=layers).items() if k != HEAD}
  head = {HEAD: base_boxed[HEAD]} if HEAD in base_boxed else {}
  return {"base": base, "lora": {"layers": adapters, **head}, "lora_scale": scale}


def param_count(cfg: ModelConfig, lcfg: LoraConfig) -> int:
  """Trainable adapter parameters."""
  total = 0
  for name in lcfg.weights:
    a_shape, b_shape, _, _ = adapter_shapes(cfg, name, lcfg.rank)
    total += math.prod(a_shape) + math.prod(b_shape)
  return total * cfg.num_layers
