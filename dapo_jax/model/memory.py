"""Per-device memory plan of a config: parameters, optimizer state, gradients, activations
(with and without rematerialisation), and the sampler's KV cache, for the config's mesh.

A mixture of experts holds E / mesh.expert experts per device; its router's probabilities are kept
for the backward pass, and each expert layer's dispatch buffers (every assignment of the expert
group's tokens of one `expert_chunk` block: dropless, so sized for the worst case) live while it runs.

With LoRA the parameters are the frozen base (its layer matrices in int8 with fp32 scales when
`base_quant` is "int8") plus the fp32 adapters; gradients and AdamW state exist for the adapters
alone; the sampler holds a per-call copy of the layer matrices (int8 for an int8 base, whose
adapters decode unmerged; merged float for a float base)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dapo_jax import sharding
from dapo_jax.model import lora as lora_lib
from dapo_jax.model import transformer as model_lib

ACCELERATORS_GB = {"H100-80GB": 80, "H200-141GB": 141, "TPU-v5p-95GB": 95, "TPU-v5e-16GB": 16}
GB = 1e9


@dataclasses.dataclass
class Plan:
  params: float
  optimizer: float
  gradients: float
  activations_no_remat: float
  activations_remat: float   # remat="full": each layer's input is kept
  activations_dots: float    # remat="dots": each layer's input and its matmul outputs are kept
  kv_cache: float
  devices: int
  remat: str
  adapters: float = 0.0          # LoRA adapter bytes (included in `params`)
  decode_weights: float = 0.0    # LoRA: the sampler's per-call layer matrices (int8, or merged float)
  experts_per_device: int = 0    # MoE: experts each device holds (per expert layer)
  dispatch: float = 0.0          # MoE: one expert layer's dispatch buffers (included in the activations)

  @property
  def train_total(self) -> float:
    act = {"none": self.activations_no_remat, "full": self.activations_remat,
           "dots": self.activations_dots}[self.remat]
    return self.params + self.optimizer + self.gradients + act

  @property
  def sample_total(self) -> float:
    # The optimizer state stays resident.
    return self.params + self.optimizer + self.kv_cache + self.decode_weights

  @property
  def peak(self) -> float:
    return max(self.train_total, self.sample_total)

  def fits(self, gb: float, headroom: float = 0.9) -> bool:
    return self.peak <= headroom * gb * GB


def plan(mc: model_lib.ModelConfig, mesh_shape: dict, *, rows_per_update: int, num_microbatches: int,
         prompt_len: int, completion_len: int, gen_rows: int, lora: lora_lib.LoraConfig | None = None) -> Plan:
  """Bytes per device. Rows are sequences; one update sees rows_per_update rows in micro-batches."""
  e, s = mesh_shape.get("expert", 1), mesh_shape.get("sequence", 1)
  devices = mesh_shape["data"] * mesh_shape["fsdp"] * e * s * mesh_shape["tensor"]
  model_shards = mesh_shape["fsdp"] * mesh_shape["tensor"]     # Parameters: FSDP x tensor (experts: x expert).
  batch_shards = sharding.batch_shards(mesh_shape)             # Rows: data x FSDP x expert.
  p_bytes = jnp.dtype(mc.param_dtype).itemsize
  c_bytes = jnp.dtype(mc.dtype).itemsize
  n = (mc.num_params - mc.num_expert_params) + mc.num_expert_params / e  # Per model shard.
  params = n * p_bytes / model_shards
  optimizer = 2 * n * 4 / model_shards                          # AdamW mu and nu, fp32.
  gradients = n * 4 / model_shards
  adapters = decode_weights = 0.0
  if lora is not None:
    D, F, N, K, H, L = mc.embed_dim, mc.mlp_dim, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.num_layers
    matrices = L * (D * H * (2 * N + 2 * K) + 3 * D * F)
    if lora.base_quant == "int8":  # One byte per weight, an fp32 scale per output channel.
      base = matrices + 4 * L * (H * (N + 2 * K) + 2 * D + 2 * F) + (n - matrices) * p_bytes
    else:
      base = n * p_bytes
    a = lora_lib.param_count(mc, lora)
    adapters = a * 4 / model_shards
    params = base / model_shards + adapters
    optimizer = 2 * a * 4 / model_shards
    gradients = a * 4 / model_shards
    # The sampler's per-call layer matrices, whole per FSDP shard: an int8 base's fused int8 copy
    # (adapters unmerged), or a float base's merged float copy.
    decode_bytes = 1 if lora.base_quant == "int8" else c_bytes
    decode_weights = matrices * decode_bytes / mesh_shape["tensor"]
  T = prompt_len + completion_len
  rows = max(rows_per_update / num_microbatches / batch_shards, 1)
  tokens = rows * T / s  # The sequence axis splits a row's tokens (its queries; keys and values are gathered).
  t = mesh_shape["tensor"]
  D, F, N, K, H, L, V = (mc.embed_dim, mc.mlp_dim, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.num_layers,
                         mc.vocab_size)
  # Saved for the backward pass per token and layer (compute dtype), split by tensor parallelism
  # where the tensor is: norms and residuals (D), q/k/v/o (N·H + 2K·H + N·H), MLP (3F).
  per_token_layer = c_bytes * (4 * D + (2 * N * H + 2 * K * H + 3 * F) / t)
  dots_token_layer = c_bytes * (D + ((N + 2 * K) * H + 2 * F) / t)  # remat="dots": q/k/v, gate/up
  L_moe = L - (sum(not mc.is_moe_layer(l) for l in range(L)) if mc.moe else L)
  dispatch = moe_token_layer = 0.0
  if mc.moe:
    # An expert layer keeps its router's fp32 probabilities and its block inputs; a block's
    # dispatch buffers (gathered rows x_AD, y_AD; gate, up, h [A, F/t]) are rematerialised.
    Fe, k = mc.expert_mlp_dim, mc.experts_per_token
    block = min(mc.expert_chunk or tokens, tokens)
    dispatch = 2 * e * block * k * c_bytes * (2 * D + 3 * Fe / t)  # Forward and backward copies.
    moe_token_layer = c_bytes * (4 * D + (2 * N * H + 2 * K * H) / t) + 4 * mc.num_experts
    if not mc.expert_chunk:  # One block: its buffers are saved for the backward pass.
      moe_token_layer += e * k * c_bytes * (2 * D + 3 * Fe / t)
  layer_tokens = (L - L_moe) * per_token_layer + L_moe * moe_token_layer  # Summed over the layers.
  widest = max(per_token_layer if L > L_moe else 0, moe_token_layer)     # The layer being recomputed.
  q_block = mc.attn_chunk if mc.attn_chunk and T / s > mc.attn_chunk else T / s
  scores = 2 * 4 * rows * (N / t) * q_block * T                # fp32 scores + probs of one query block
  logits = 2 * 4 * rows * completion_len / s * V / t             # fp32 logits and their gradient.
  gathered = 2 * rows * T * max(K / t, 1) * H * c_bytes if s > 1 else 0.0  # One layer's keys and values, whole.
  act_full = tokens * layer_tokens + L * (scores if q_block == T / s else 0) + logits + dispatch + gathered
  act_remat = L * tokens * D * c_bytes + tokens * widest + scores + logits + dispatch + gathered
  # "dots" keeps q/k/v and gate/up (attention scores are batched matmuls: recomputed); experts as "full".
  dots_layers = (L - L_moe) * dots_token_layer + L_moe * c_bytes * (D + (N + 2 * K) * H / t)
  act_dots = tokens * dots_layers + tokens * widest + scores + logits + dispatch + gathered
  kv_rows = gen_rows / batch_shards
  kv = 2 * L * kv_rows * T * (K / min(K, t)) * H * c_bytes if K >= t else 2 * L * kv_rows * T * H * c_bytes
  return Plan(params, optimizer, gradients, act_full, act_remat, act_dots, kv, devices, mc.remat, adapters,
              decode_weights, mc.num_experts // e if mc.moe else 0, dispatch)


def report(p: Plan, name: str = "") -> str:
  lines = [f"memory plan per device{(' for ' + name) if name else ''} ({p.devices} devices, remat={p.remat})"]
  rows = [("parameters", p.params), ("optimizer state (AdamW)", p.optimizer), ("gradients", p.gradients),
          ("activations, no remat", p.activations_no_remat), ("activations, remat=full", p.activations_remat),
          ("activations, remat=dots", p.activations_dots),
          ("KV cache (sampling)", p.kv_cache), ("peak (train or sample)", p.peak)]
  if p.adapters:
    rows[1:1] = [("  of which LoRA adapters", p.adapters)]
    rows.insert(-1, ("decode weights (LoRA)", p.decode_weights))
  if p.experts_per_device:
    lines.append(f"  {'experts per device':28s} {p.experts_per_device:10d}    (per expert layer)")
    rows.insert(6, ("  of which expert dispatch", p.dispatch))
  lines += [f"  {k:28s} {v / GB:10.2f} GB" for k, v in rows]
  lines += [f"  fits {acc:14s} {'yes' if p.fits(gb) else 'NO'}" for acc, gb in ACCELERATORS_GB.items()]
  return "\n".join(lines)
