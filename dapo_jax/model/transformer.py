"""Decoder-only transformer of the Llama / Qwen2 / Qwen3 / Qwen3-MoE / Gemma 3 families (flax.linen).

RMSNorm, rotary embeddings (with Llama 3 / linear / YaRN scaling), grouped-query attention
(N query heads share K KV heads, N = K*R), SwiGLU MLP, optional QKV bias (Qwen2), tied or untied
embeddings. Qwen3 adds per-head q/k RMSNorm; Gemma 3 adds (1 + w) norms, post-norms around
attention and MLP, GeGLU, a scaled embedding, sliding-window (local) layers with their own RoPE
base, and logit soft-capping; Qwen3-MoE replaces the MLP of its expert layers by a router and E
stacked experts. One layer function serves every family. Layers are stacked with `nn.scan`, so
compile time does not grow with depth and every layer parameter has a leading L axis: one stack
per run of alike layers (`ModelConfig.layer_runs`; an MoE model that mixes dense-MLP and expert
layers has several, named by `run_name`, every other model one, "layers"). Parameters carry
logical axis names derived from their shape-suffixed names.
Parameters live in `param_dtype`, activations in `dtype`; the weight matmuls read their operands in
`matmul_dtype` and accumulate in fp32; logits and softmax are fp32.
"""
from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from dapo_jax import sharding
from dapo_jax.model import layers as layers_lib
from dapo_jax.model import lora as lora_lib
from dapo_jax.model import packed_attention, quant, ring_attention, vision
from dapo_jax.model.config import REMAT_POLICIES, ModelConfig  # noqa: F401 (model.ModelConfig is public API)

Params = Any
def _param(module: nn.Module, name: str, shape, init, cfg: ModelConfig):
  """A parameter whose logical axes come from its shape suffix: 'wq_DNH' -> (embed, heads, head_dim)."""
  letters = name.rsplit("_", 1)[1]
  init = nn.with_logical_partitioning(init, sharding.axes_of(letters))
  return module.param(name, init, shape, jnp.dtype(cfg.param_dtype)).astype(cfg.dtype)


_normal = nn.initializers.normal(0.02)


def _matrix(module: nn.Module, name: str, shape, cfg: ModelConfig):
  """A layer matrix: a float parameter, or a frozen base's int8 one ({"int8", "scale"}, as stored)."""
  if module.has_variable("params", name):
    w = module.get_variable("params", name)
    if quant.is_quantized(w):
      return w
  return _param(module, name, shape, _normal, cfg)


class RMSNorm(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    scale_D = _param(self, "scale_D", (x_BTD.shape[-1],), layers_lib.norm_init(self.cfg), self.cfg)
    return layers_lib.norm(self.cfg, x_BTD, scale_D)


class Block(nn.Module):
  """One layer's parameters (training layout), applied to one or two segments of rows.

  Layout "rows": one segment [B, T, D]. Layout "packed": packed sequences [B, T, D], attention inside
  their segments (`packed_attention`; the mask is a `packed_attention.Segments`). Layout
  "shared_prompt": Q prompts [Q, P, D] and their B = Q*G completions [B, C, D], completion row qG+g
  continuing prompt q (a rollout group shares one prompt forward). Layout "prefix_prompt": a prefix
  [1, N, D] every prompt begins with, the Q prompts' rest [Q, P, D] and the completions [B, C, D] (no
  sliding window). Dense layers run on
  every token of every segment at once; only attention sees the segments. With `emit_kv`, also
  returns this call's keys and values ([B, K, T, H] each, one pair per segment).
  `local` (scanned over layers, a traced bool) selects the sliding window and the local RoPE table.
  With `moe`, the MLP is a router and E experts; the layer then sows its routing statistics
  (`router_stats`) into the "router" collection, and with `emit_experts` the experts each token went
  to ([X, k]). `routes_Xk` (scanned with `local`; -1 rows: none) are experts recorded elsewhere (the
  sampler's, or π_old's): with `replay` the tokens go to them (routing replay, `layers.route`), and
  either way the layer sows how often its own top-k holds them (`agreement`).
  """
  cfg: ModelConfig
  layout: str = "rows"
  emit_kv: bool = False
  moe: bool = False
  replay: bool = False
  emit_experts: bool = False

  @nn.compact
  def __call__(self, segments: tuple, shared: tuple, scanned: tuple):
    local, routes_Xk = scanned
    cfg = self.cfg
    D, N, K, H, F = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    tables, local_tables, masks, lora_switch, real = shared
    window = None
    if cfg.local_layers:  # Local layers: the window and their own rotary table.
      window = jnp.where(local, cfg.sliding_window, jnp.iinfo(jnp.int32).max)
      tables = jax.tree.map(lambda g, l: jnp.where(local, l, g), tables, local_tables)
      if self.layout != "packed":  # Packed segments are windowed by position (`packed_attention`).
        masks = (layers_lib.windowed(masks[0], window),) + tuple(masks[1:])
    p = {"attn_norm": {"scale_D": _scale_param(self, "attn_norm")}}
    p["wq_DNH"] = _matrix(self, "wq_DNH", (D, N, H), cfg)
    p["wk_DKH"] = _matrix(self, "wk_DKH", (D, K, H), cfg)
    p["wv_DKH"] = _matrix(self, "wv_DKH", (D, K, H), cfg)
    if cfg.qk_norm:
      p["q_norm_H"] = _param(self, "q_norm_H", (H,), layers_lib.norm_init(cfg), cfg)
      p["k_norm_H"] = _param(self, "k_norm_H", (H,), layers_lib.norm_init(cfg), cfg)
    if cfg.qkv_bias:
      zeros = nn.initializers.zeros
      p["bq_NH"] = _param(self, "bq_NH", (N, H), zeros, cfg)
      p["bk_KH"] = _param(self, "bk_KH", (K, H), zeros, cfg)
      p["bv_KH"] = _param(self, "bv_KH", (K, H), zeros, cfg)
    p["wo_NHD"] = _matrix(self, "wo_NHD", (N, H, D), cfg)
    p["mlp_norm"] = {"scale_D": _scale_param(self, "mlp_norm")}
    if cfg.gemma:
      p["post_attn_norm"] = {"scale_D": _scale_param(self, "post_attn_norm")}
      p["post_mlp_norm"] = {"scale_D": _scale_param(self, "post_mlp_norm")}
    if self.moe:
      E, Fe = cfg.num_experts, cfg.expert_mlp_dim
      p["router_DE"] = _param(self, "router_DE", (D, E), _normal, cfg)
      p["w_gate_EDF"] = _param(self, "w_gate_EDF", (E, D, Fe), _normal, cfg)
      p["w_up_EDF"] = _param(self, "w_up_EDF", (E, D, Fe), _normal, cfg)
      p["w_down_EFD"] = _param(self, "w_down_EFD", (E, Fe, D), _normal, cfg)
    else:
      p["w_gate_DF"] = _matrix(self, "w_gate_DF", (D, F), cfg)
      p["w_up_DF"] = _matrix(self, "w_up_DF", (D, F), cfg)
      p["w_down_FD"] = _matrix(self, "w_down_FD", (F, D), cfg)
    if lora_switch is not None:  # Adapters of an adapted tree (see `lora`), this layer's slice.
      p["lora"] = {n: self.get_variable("lora", n) for n in quant.MATRICES if self.has_variable("lora", n)}
      p["lora_scale"] = lora_switch["scale"]
      if "dropout_rate" in lora_switch:  # A training forward (`lora.with_dropout`): this layer's key.
        p["lora_dropout"] = (lora_switch["dropout_rate"], self.get_variable("lora", "dropout_rng"))

    shapes = [s.shape[:2] for s in segments]
    sizes = [b * t for b, t in shapes]

    def per_segment(a_X, *trailing):
      """[X, ...] -> one [rows, T, ...] array per segment."""
      parts = jnp.split(a_X, list(itertools.accumulate(sizes))[:-1]) if len(sizes) > 1 else [a_X]
      return [a.reshape(b, t, *trailing) for a, (b, t) in zip(parts, shapes)]

    def attend(q_XKRH, k_XKH, v_XKH):
      R = N // K
      qs = [layers_lib.rope(q, t) for q, t in zip(per_segment(q_XKRH.reshape(-1, N, H), N, H), tables)]
      qs = [q.reshape(*q.shape[:2], K, R, H) for q in qs]
      ks = [layers_lib.rope(k, t) for k, t in zip(per_segment(k_XKH, K, H), tables)]
      vs = per_segment(v_XKH, K, H)
      if self.layout == "rows":
        outs = [self._attend_rows(qs[0], ks[0], vs[0], masks[0])]
      elif self.layout == "packed":
        outs = [self._attend_packed(qs[0], ks[0], vs[0], masks[0], window)]
      elif self.layout == "prefix_prompt":  # The prefix; the prompts after it; completions after both.
        kw = layers_lib.attn_kw(cfg)
        real_1N, real_QP = masks[0][:, -1], masks[1][:, -1]
        outs = [layers_lib.attend_rows(qs[0], ks[0], vs[0], masks[0], **kw),
                layers_lib.attend_after_contexts(qs[1], ks[1], vs[1], masks[1], [(ks[0], vs[0], real_1N)], **kw),
                layers_lib.attend_after_contexts(qs[2], ks[2], vs[2], masks[2],
                                                 [(ks[0], vs[0], real_1N), (ks[1], vs[1], real_QP)], **kw)]
      else:  # Prompts attend among themselves; completions to their prompt, then to themselves.
        mask_QPP, mask_BCC = masks  # mask_QPP is windowed already; its last row is not.
        outs = [self._attend_rows(qs[0], ks[0], vs[0], mask_QPP),
                self._attend_completions(qs[1], ks[1], vs[1], mask_BCC, ks[0], vs[0], shared[2][0][:, -1], window)]
      # [B, K, T, H] per segment: (k, v) of the rows, or (k, v) of the prompts then of the completions.
      kv = tuple(a.transpose(0, 2, 1, 3) for pair in zip(ks, vs) for a in pair) if self.emit_kv else None
      return jnp.concatenate([o.reshape(-1, N, H) for o in outs]), kv

    # Dense projections run on flattened tokens: 2-D matmuls whose gradients XLA computes
    # without transposed copies.
    x_XD = jnp.concatenate([s.reshape(-1, D) for s in segments])
    x_XD, kv, routing = layers_lib.layer(cfg, p, x_XD, attend, routes_Xk if self.replay else None)
    if routing is not None:
      real_X = jnp.concatenate([r.reshape(-1) for r in real])
      self.sow("router", "stats", router_stats(*routing, real_X))
      if routes_Xk is not None:
        self.sow("router", "agree", agreement(cfg, routing[0], routes_Xk, real_X))
      if self.emit_experts:
        self.sow("router", "experts", routing[1].astype(jnp.int32))
    # A one-row segment (a shared prefix) is whole on every batch shard.
    return tuple(sharding.constrain(s, "BTD" if s.shape[0] > 1 else (None, "seq", "embed"))
                 for s in per_segment(x_XD, D)), kv

  def _attend_completions(self, q_BCKRH, k_BCKH, v_BCKH, mask_BCC, k_QPKH, v_QPKH, mask_QP, window):
    """`layers.attend_shared_prompt`, in blocks of `attn_chunk` completion queries as `_attend_rows`
    runs rows: the scores of one block at a time, each block rematerialised."""
    kw = layers_lib.attn_kw(self.cfg)
    attend = lambda q, mask, offset: layers_lib.attend_shared_prompt(
        q, k_BCKH, v_BCKH, mask, k_QPKH, v_QPKH, mask_QP, window=window, query_offset=offset, **kw)
    return _query_blocks(attend, q_BCKRH, mask_BCC, self.cfg.attn_chunk)

  def _attend_packed(self, q_BTKRH, k_BTKH, v_BTKH, segments: packed_attention.Segments, window):
    """Packed sequences: over their block pairs where they have them, else dense under their mask; by a ring
    over mesh.sequence with `sequence_attention="ring"`."""
    if self.cfg.sequence_attention == "ring":
      return ring_attention.attend(q_BTKRH, k_BTKH, v_BTKH, segments, window, self.cfg.attn_chunk,
                                   layers_lib.attn_kw(self.cfg)["scale"])
    if not segments.block:
      return self._attend_rows(q_BTKRH, k_BTKH, v_BTKH, segments.dense_mask(window))
    return packed_attention.attend_blocks(q_BTKRH, k_BTKH, v_BTKH, segments, window, self.cfg.attn_chunk,
                                          **layers_lib.attn_kw(self.cfg))

  def _attend_rows(self, q_BTKRH, k_BTKH, v_BTKH, mask_BTS):
    c = self.cfg.attn_chunk
    kw = layers_lib.attn_kw(self.cfg)
    attend = lambda q, mask, offset: layers_lib.attend_rows(q, k_BTKH, v_BTKH, mask, **kw)
    return _query_blocks(attend, q_BTKRH, mask_BTS, c)


def _query_blocks(attend, q_BTKRH, mask_BTS, c: int):
  """`attend(q, mask, offset)` over blocks of `c` queries (offset: the block's first), each block
  rematerialised, so that scores never exceed [B, K, R, c, S] in memory; 0 (or T <= c): all at once.
  A T that c does not divide is padded with zero queries that see what the last query sees (never
  nothing: no fully masked row for any attention implementation), sliced off after (a row of P + C - 1
  tokens, what an update's forward reads, is rarely a multiple of c)."""
  B, T, K, R, H = q_BTKRH.shape
  if not (c and T > c):
    return attend(q_BTKRH, mask_BTS, 0)
  n = -(-T // c)
  pad = lambda x, mode: jnp.pad(x, ((0, 0), (0, n * c - T)) + ((0, 0),) * (x.ndim - 2), mode=mode)
  q_nBcKRH = jnp.moveaxis(pad(q_BTKRH, "constant").reshape(B, n, c, K, R, H), 1, 0)
  mask_nBcS = jnp.moveaxis(pad(mask_BTS, "edge").reshape(B, n, c, -1), 1, 0)
  block = jax.checkpoint(lambda a: attend(*a))
  out_nBcKRH = jax.lax.map(block, (q_nBcKRH, mask_nBcS, jnp.arange(n) * c))
  return jnp.moveaxis(out_nBcKRH, 0, 1).reshape(B, n * c, K, R, H)[:, :T]


def agreement(cfg: ModelConfig, probs_XE: jax.Array, routes_Xk: jax.Array, real_X: jax.Array) -> dict:
  """How often this router's own top-k holds the recorded experts `routes_Xk`, over the real tokens
  that have a record: {"hits": Σ over them of the fraction of their k recorded experts in the top-k,
  "tokens": their count} (fp32, no gradient)."""
  own_Xk = jax.lax.top_k(jax.lax.stop_gradient(probs_XE), cfg.experts_per_token)[1]
  recorded_X = (routes_Xk[:, 0] >= 0) & (real_X > 0)
  held_X = jnp.mean(jnp.any(routes_Xk[:, :, None] == own_Xk[:, None, :], axis=-1), axis=-1)
  w_X = recorded_X.astype(jnp.float32)
  return {"hits": jnp.sum(held_X * w_X), "tokens": jnp.sum(w_X)}


def router_stats(probs_XE: jax.Array, expert_Xk: jax.Array, real_X: jax.Array) -> dict:
  """One expert layer's routing over the real tokens: assignments per expert `counts_E`, summed
  router probabilities `probs_E` (differentiable: the load-balancing loss's gradient flows here)
  and the token count."""
  E, k = probs_XE.shape[-1], expert_Xk.shape[-1]
  real_X = real_X.astype(jnp.float32)
  counts_E = jax.ops.segment_sum(jnp.repeat(real_X, k), expert_Xk.reshape(-1), num_segments=E)
  return {"counts_E": jax.lax.stop_gradient(counts_E), "probs_E": jnp.einsum("XE,X->E", probs_XE, real_X),
          "tokens": jnp.sum(real_X)}


def run_name(i: int) -> str:
  """The parameter subtree of the i-th run of alike layers (`ModelConfig.layer_runs`)."""
  return "layers" if i == 0 else f"layers_{i}"


def _scale_param(module: nn.Module, name: str) -> jax.Array:
  """An RMSNorm scale stored as {name: {"scale_D": ...}} (the parameter tree HF import expects)."""
  return RMSNormScale(module.cfg, name=name)()


class RMSNormScale(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self) -> jax.Array:
    return _param(self, "scale_D", (self.cfg.embed_dim,), layers_lib.norm_init(self.cfg), self.cfg)


HEADS = ("lm", "scalar", "hidden")


class Transformer(nn.Module):
  """The trunk (embedding, scanned layers, final norm) and a head on it.

  Head "lm": logits [B, T, V] (fp32). Head "scalar": one value per position [B, T] (fp32) from a
  D-vector `score_D` (a reward model's or value model's head). Head "hidden": the final norm's
  output [B, T, D], for `unembed` to turn into logits a chunk of positions at a time. Inputs are one
  segment of rows (layout "rows"), packed sequences (layout "packed"), (prompts, completions) (layout
  "shared_prompt", see `Block`) or (prefix, prompts, completions) (layout "prefix_prompt"): then the
  outputs are those at the positions predicting each completion token, [B, C, ...].
  """
  cfg: ModelConfig
  head: str = "lm"
  layout: str = "rows"
  emit_kv: bool = False  # also return every layer's keys/values: ([L, B, K, T, H], [L, B, K, T, H]), per segment
  replay: bool = False   # route the tokens that `routes` records to those experts (routing replay)
  emit_experts: bool = False  # sow each expert layer's per-token experts (`experts_of`)

  @nn.compact
  def __call__(self, tokens: tuple, pos: tuple, masks: tuple, logits_from: int = 0, images: tuple = (),
               routes: tuple = ()):
    """`routes`: per segment, each token's experts in every expert layer recorded elsewhere, [B, T, L_moe,
    k] int (-1: none; a segment's None: none), for routing replay (`replay`) or its agreement statistics."""
    cfg = self.cfg
    embed_VD = _param(self, "embed_VD", (cfg.vocab_size, cfg.embed_dim), _normal, cfg)
    x = tuple(embed(cfg, embed_VD, t) for t in tokens)
    if images:  # One [B, M, D] array of image vectors (or None) per segment: placed at its placeholders.
      x = tuple(x_ if f is None else vision.place(x_, t, f, cfg.vision.image_token_id)
                for x_, t, f in zip(x, tokens, images))
    x = tuple(sharding.constrain(x_, "BTD") for x_ in x)

    block = Block
    if cfg.remat != "none":
      block = nn.remat(Block, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)
    tables = tuple(layers_lib.rope_table(p, cfg, tokens_BT=t, images_BME=f)
                   for p, t, f in zip(pos, tokens, images or (None,) * len(tokens)))
    local_tables = tuple(layers_lib.rope_table(p, cfg, local=True) for p in pos) if cfg.local_layers else None
    local_L = jnp.asarray([l in cfg.local_layers for l in range(cfg.num_layers)])
    lora_switch = None  # The adapters' scale and, in a training forward, their dropout rate.
    if self.has_variable("lora", "scale"):
      lora_switch = {k: self.get_variable("lora", k) for k in ("scale", "dropout_rate") if self.has_variable("lora", k)}
    if self.layout == "packed":
      real = (masks[0].real_BT(),)
    else:  # A token sees itself iff it is real.
      real = tuple(jnp.diagonal(m, axis1=-2, axis2=-1) for m in masks)
    if self.layout not in ("rows", "packed"):  # Routing statistics count a shared segment once per row.
      real = tuple(r * (tokens[-1].shape[0] // t.shape[0]) for r, t in zip(real, tokens))
    shared = (tables, local_tables, masks, lora_switch, real)
    routes_LXk = _routes_by_layer(cfg, routes, tokens) if routes else None
    kvs, moe_seen = [], 0
    for r, (start, stop, moe) in enumerate(cfg.layer_runs):
      layers = nn.scan(block, variable_axes={"params": 0, "lora": 0, "router": 0}, split_rngs={"params": True},
                       in_axes=(nn.broadcast, 0), length=stop - start,
                       metadata_params={nn.PARTITION_NAME: "layers"})
      run_routes = None
      if moe and routes_LXk is not None:
        run_routes, moe_seen = routes_LXk[moe_seen:moe_seen + stop - start], moe_seen + stop - start
      x, kv = layers(cfg, self.layout, self.emit_kv, moe, self.replay, self.emit_experts, name=run_name(r))(
          x, shared, (local_L[start:stop], run_routes))
      kvs.append(kv)
    kv = jax.tree.map(lambda *a: jnp.concatenate(a), *kvs) if self.emit_kv else None

    if self.layout == "shared_prompt" and self.emit_kv:  # A prefill after a shared prefix: each row's next token.
      x_BTD = x[1][:, -1:]
    elif self.layout in ("shared_prompt", "prefix_prompt"):
      # Completion token 0 is predicted at the prompt's last position, token t at completion t-1.
      x_QPD, x_BCD = x[-2:]
      G = x_BCD.shape[0] // x_QPD.shape[0]
      x_BTD = jnp.concatenate([jnp.repeat(x_QPD[:, -1:], G, axis=0), x_BCD[:, :-1]], axis=1)
    else:
      x_BTD = x[0][:, logits_from:]  # Skip unneeded unembeddings.
    x_BTD = RMSNorm(cfg, name="final_norm")(x_BTD)
    if self.head == "hidden":
      if not cfg.tie_embeddings:  # Declared, so the tree is the lm head's.
        _param(self, "unembed_DV", (cfg.embed_dim, cfg.vocab_size), _normal, cfg)
      return (x_BTD, kv) if self.emit_kv else x_BTD
    if self.head == "scalar":
      score_D = _param(self, "score_D", (cfg.embed_dim,), nn.initializers.zeros, cfg)
      out = layers_lib.matmul("BTD,D->BT", x_BTD, score_D, cfg, jnp.float32)
    else:
      if cfg.tie_embeddings:
        logits_BTV = layers_lib.matmul("BTD,VD->BTV", x_BTD, embed_VD, cfg, jnp.float32)
      else:
        unembed_DV = _param(self, "unembed_DV", (cfg.embed_dim, cfg.vocab_size), _normal, cfg)
        logits_BTV = layers_lib.matmul("BTD,DV->BTV", x_BTD, unembed_DV, cfg, jnp.float32)
      out = sharding.constrain(layers_lib.output_logits(cfg, logits_BTV), "BTV")
    return (out, kv) if self.emit_kv else out


def _routes_by_layer(cfg: ModelConfig, routes: tuple, tokens: tuple) -> jax.Array:
  """Per-segment recorded experts [B, T, L_moe, k] (None: none) -> [L_moe, X, k] int32 in the order a
  block flattens its tokens (segment after segment, row-major)."""
  L, k = sum(stop - start for start, stop, moe in cfg.layer_runs if moe), cfg.experts_per_token
  flat = [jnp.full((t.size, L, k), -1, jnp.int32) if r is None else r.reshape(t.size, L, k).astype(jnp.int32)
          for r, t in zip(routes, tokens)]
  return jnp.concatenate(flat).transpose(1, 0, 2)


def experts_of(cfg: ModelConfig, collection: dict, tokens: tuple) -> tuple:
  """The "router" collection of an apply with `emit_experts` -> per segment, each token's experts in
  every expert layer, [B, T, L_moe, k] int32 (the layout `routes` takes)."""
  per_run = [collection[run_name(r)]["experts"][0] for r, (_, _, moe) in enumerate(cfg.layer_runs) if moe]
  LXk = jnp.concatenate(per_run)  # [L_moe, X, k]
  out, at = [], 0
  for t in tokens:
    out.append(LXk[:, at:at + t.size].transpose(1, 0, 2).reshape(*t.shape, LXk.shape[0], LXk.shape[2]))
    at += t.size
  return tuple(out)


def unembed(cfg: ModelConfig, params: Params, x_BTD: jax.Array) -> jax.Array:
  """The lm head on head "hidden"'s output: logits [B, T, V] (fp32), exactly as head "lm" gives them."""
  if lora_lib.is_adapted(params):
    params = params["base"]
  if cfg.tie_embeddings:
    logits_BTV = layers_lib.matmul("BTD,VD->BTV", x_BTD, params["embed_VD"].astype(cfg.dtype), cfg, jnp.float32)
  else:
    logits_BTV = layers_lib.matmul("BTD,DV->BTV", x_BTD, params["unembed_DV"].astype(cfg.dtype), cfg, jnp.float32)
  return sharding.constrain(layers_lib.output_logits(cfg, logits_BTV), "BTV")


def embed(cfg: ModelConfig, embed_VD: jax.Array, tokens: jax.Array) -> jax.Array:
  """Token embeddings; Gemma scales them by sqrt(D), the factor rounded to the compute dtype as HF does.
  An image placeholder outside the vocabulary embeds as token 0 (`vision.place` replaces it)."""
  if cfg.vision is not None and cfg.vision.image_token_id >= cfg.vocab_size:
    tokens = jnp.where(tokens == cfg.vision.image_token_id, 0, tokens)
  x = jnp.take(embed_VD, tokens, axis=0)
  return x * jnp.asarray(cfg.embed_dim ** 0.5, x.dtype) if cfg.gemma else x


def init_params(cfg: ModelConfig, rng: jax.Array, head: str = "lm") -> Params:
  """Random parameters (unboxed: plain arrays in `param_dtype`)."""
  return nn.meta.unbox(init_boxed(cfg, rng, head))


def init_boxed(cfg: ModelConfig, rng: jax.Array, head: str = "lm") -> Params:
  """Random parameters boxed with their logical axes (`nn.get_partition_spec` reads them): the one
  source of parameter shardings (under `jax.eval_shape`, nothing is computed)."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  params = Transformer(cfg, head).init(rng, (tokens,), (tokens,), (jnp.ones((1, 1, 1), bool),))["params"]
  if cfg.vision is not None:  # The tower and projector, sharded as the text model's weights are.
    params = {**params, "vision": vision.boxed(vision.init_params(cfg.vision, cfg.embed_dim,
                                                                 jax.random.fold_in(rng, 1)))}
  return params


def positions(mask_BT: jax.Array) -> jax.Array:
  """Position ids of left-padded rows: 0 at the first real token (padding gets 0)."""
  return jnp.maximum(jnp.cumsum(mask_BT.astype(jnp.int32), axis=-1) - 1, 0)


def _apply(module: Transformer, params: Params, *args, with_router: bool = False):
  """`module.apply`; with `with_router`, (out, routing statistics of the expert layers, see `routing`)."""
  if "vision" in params:  # The tower runs outside the module (`vision.image_features`).
    params = {k: v for k, v in params.items() if k != "vision"}
  if not with_router:
    return module.apply(lora_lib.flax_variables(params), *args)
  out, state = module.apply(lora_lib.flax_variables(params), *args, mutable=["router"])
  stats = routing(module.cfg, state.get("router", {}))
  if module.emit_experts:
    stats["experts"] = experts_of(module.cfg, state["router"], args[0])
  return out, stats


def routing(cfg: ModelConfig, collection: dict) -> dict:
  """The "router" collection of an apply -> {"counts_LE", "probs_LE": [L_moe, E], "tokens_L": [L_moe]},
  the expert layers in order; with recorded routes, also "agree_L" and "recorded_L" [L_moe]: the
  recorded experts this router's own top-k held, and the recorded tokens (`agreement`)."""
  runs = [collection[run_name(r)] for r, (_, _, moe) in enumerate(cfg.layer_runs) if moe]
  cat = lambda kind, key: jnp.concatenate([s[kind][0][key] for s in runs])
  out = {"counts_LE": cat("stats", "counts_E"), "probs_LE": cat("stats", "probs_E"), "tokens_L": cat("stats", "tokens")}
  if runs and "agree" in runs[0]:
    out.update(agree_L=cat("agree", "hits"), recorded_L=cat("agree", "tokens"))
  return out


def forward(cfg: ModelConfig, params: Params, tokens_BT, pos_BT, mask_BTS, logits_from: int = 0,
            emit_kv: bool = False, head: str = "lm", with_router: bool = False, images_BMD=None,
            routes_BTLk=None, replay: bool = False, emit_experts: bool = False):
  """Teacher-forced outputs of the head (fp32 logits [B, T', V], or values [B, T']) for positions
  >= logits_from (static).

  With `emit_kv`, returns (out, (k_LBKTH, v_LBKTH)): every layer's keys and values, to fill a cache.
  With `with_router` (an MoE model), returns (that, routing statistics): see `routing`.
  `images_BMD`: each row's image vectors (`vision.image_features`), placed at its image placeholders
  (`mask_BTS` then opens each image's attention both ways: `attention_mask`).
  `mask_BTS` may be a `packed_attention.Segments` instead: packed sequences (`pos_BT` their positions).
  `routes_BTLk`: each token's experts recorded elsewhere (-1: none), replayed with `replay` (`Transformer`);
  `emit_experts` (with `with_router`): the statistics hold each token's experts, "experts" ([B, T, L_moe, k]).
  """
  images = () if images_BMD is None else (images_BMD,)
  layout = "packed" if isinstance(mask_BTS, packed_attention.Segments) else "rows"
  routes = () if routes_BTLk is None else (routes_BTLk,)
  out = _apply(Transformer(cfg, head, layout, emit_kv, replay, emit_experts), params, (tokens_BT,), (pos_BT,),
               (mask_BTS,), logits_from, images, routes, with_router=with_router)
  if with_router and emit_experts:
    out[1]["experts"] = out[1]["experts"][0]
  return out


def prefill_after_prefix(cfg: ModelConfig, params: Params, prefix_1N: jax.Array, suffix_UT: jax.Array,
                         suffix_mask_UT: jax.Array):
  """U prompts that share their first N tokens, the prefix running through the model once.

  Row u is [prefix_1N | suffix_UT[u]] with the suffix left-padded (positions continue from N). Returns
  the next-token logits [U, V] (fp32) and every layer's keys and values of the prefix ([L, 1, K, N, H]
  each) and of the suffixes ([L, U, K, T, H] each): what `forward` with `emit_kv` gives on the whole
  rows, up to the order in which a softmax adds its terms.
  """
  N = prefix_1N.shape[1]
  prefix_mask_1N = jnp.ones(prefix_1N.shape, bool)
  logits_U1V, (k_L1KNH, v_L1KNH, k_LUKTH, v_LUKTH) = _apply(
      Transformer(cfg, "lm", "shared_prompt", emit_kv=True), params, (prefix_1N, suffix_UT),
      (positions(prefix_mask_1N), N + positions(suffix_mask_UT)),
      (causal_mask(prefix_mask_1N), causal_mask(suffix_mask_UT)))
  return logits_U1V[:, -1], (k_L1KNH, v_L1KNH), (k_LUKTH, v_LUKTH)


def causal_mask(mask_BT: jax.Array) -> jax.Array:
  """[B, T, T] attention mask of rows attending to themselves: causal, real keys only."""
  T = mask_BT.shape[1]
  return jnp.tril(jnp.ones((T, T), bool))[None] & mask_BT.astype(bool)[:, None, :]


def attention_mask(cfg: ModelConfig, tokens_BT: jax.Array, mask_BT: jax.Array) -> jax.Array:
  """[B, T, T] mask of left-padded rows: causal over real keys, and, for Gemma 3 with images, both ways
  among each image's placeholders (`vision.image_attention`)."""
  mask_BTS = causal_mask(mask_BT)
  if cfg.vision is None or not cfg.vision.bidirectional:
    return mask_BTS
  return vision.image_attention(mask_BTS, tokens_BT, cfg.vision.image_token_id) & mask_BT.astype(bool)[:, None, :]


def logits(model_cfg: ModelConfig, params: Params, tokens_BT: jax.Array, mask_BT: jax.Array,
           logits_from: int = 0, with_router: bool = False, images_BMD=None, **routing_kw) -> jax.Array:
  """Teacher-forced logits [B, T, V] (fp32) of left-padded rows; mask 1 = real token.

  With `logits_from`, only positions logits_from..T-1 are unembedded ([B, T - logits_from, V]).
  With `with_router` (an MoE model), returns (logits, routing statistics): see `routing`.
  `images_BMD`: the rows' image vectors, as `forward`'s; `routing_kw`: its routing replay arguments.
  """
  return forward(model_cfg, params, tokens_BT, positions(mask_BT), attention_mask(model_cfg, tokens_BT, mask_BT),
                 logits_from=logits_from, with_router=with_router, images_BMD=images_BMD, **routing_kw)


def completion_logits(model_cfg: ModelConfig, params: Params, prompt_QP: jax.Array, prompt_mask_QP: jax.Array,
                      completion_BC: jax.Array, completion_mask_BC: jax.Array, head: str = "lm",
                      with_router: bool = False, images_QMD=None, routes_BCLk=None, replay: bool = False,
                      emit_experts: bool = False) -> jax.Array:
  """Logits [B, C, V] (fp32) predicting each completion token, for G = B/Q completions per prompt.

  Equals `logits` on the rows [prompt q | completion qG+g] (positions P-1 .. P+C-2), but each
  prompt's tokens pass through the model once rather than G times. `with_router`: as `logits`.
  `images_QMD`: each prompt's image vectors (a vision-language model). `routes_BCLk`: the completion
  tokens' recorded experts, replayed with `replay` (`forward`'s `routes_BTLk`).
  """
  G = completion_BC.shape[0] // prompt_QP.shape[0]
  C = completion_BC.shape[1]
  prompt_len_B = jnp.repeat(jnp.sum(prompt_mask_QP, axis=-1, dtype=jnp.int32), G)
  pos_BC = prompt_len_B[:, None] + jnp.arange(C)[None, :]
  images = () if images_QMD is None else (images_QMD, None)
  routes = () if routes_BCLk is None else (None, routes_BCLk)
  return _apply(Transformer(model_cfg, head, "shared_prompt", replay=replay, emit_experts=emit_experts), params,
                (prompt_QP, completion_BC),
                (positions(prompt_mask_QP), pos_BC),
                (attention_mask(model_cfg, prompt_QP, prompt_mask_QP), causal_mask(completion_mask_BC)), 0, images,
                routes, with_router=with_router)


def shared_prefix_len(reals, multiple: int) -> int:
  """The tokens all the prompts `reals` (each its real tokens) begin with, each keeping at least one
  of its own (its first logits come from its last token), rounded down to a multiple of `multiple`;
  0 for fewer than two prompts or `multiple` 0. What the prefix layouts share."""
  if not multiple or len(reals) < 2:
    return 0
  n = min(len(r) for r in reals) - 1
  for r in reals[1:]:
    differ = np.flatnonzero(np.asarray(r[:n]) != np.asarray(reals[0][:n]))
    n = int(differ[0]) if differ.size else n
  return n // multiple * multiple


def completion_logits_after_prefix(model_cfg: ModelConfig, params: Params, prefix_1N: jax.Array,
                                   suffix_QP: jax.Array, suffix_mask_QP: jax.Array, completion_BC: jax.Array,
                                   completion_mask_BC: jax.Array, head: str = "lm",
                                   with_router: bool = False, routes_BCLk=None, replay: bool = False,
                                   emit_experts: bool = False) -> jax.Array:
  """`completion_logits` of prompts that all begin with `prefix_1N`: prompt q is [prefix | the
  real tokens of suffix_QP[q]] (left-padded; positions continue from N). The prefix passes through
  the model once for the whole batch, each prompt's rest once per group. No sliding window."""
  N = prefix_1N.shape[1]
  G = completion_BC.shape[0] // suffix_QP.shape[0]
  C = completion_BC.shape[1]
  prefix_mask_1N = jnp.ones(prefix_1N.shape, bool)
  prompt_len_B = N + jnp.repeat(jnp.sum(suffix_mask_QP, axis=-1, dtype=jnp.int32), G)
  pos_BC = prompt_len_B[:, None] + jnp.arange(C)[None, :]
  routes = () if routes_BCLk is None else (None, None, routes_BCLk)
  return _apply(Transformer(model_cfg, head, "prefix_prompt", replay=replay, emit_experts=emit_experts), params,
                (prefix_1N, suffix_QP, completion_BC),
                (positions(prefix_mask_1N), N + positions(suffix_mask_QP), pos_BC),
                (causal_mask(prefix_mask_1N), causal_mask(suffix_mask_QP), causal_mask(completion_mask_BC)), 0, (),
                routes, with_router=with_router)


def last_token_scores(model_cfg: ModelConfig, params: Params, tokens_BT, mask_BT) -> jax.Array:
  """Scalar-head output at each row's last real token [B] (fp32): a reward model's score of
  prompt + response (what transformers' ...ForSequenceClassification returns for the row)."""
  T = tokens_BT.shape[1]
  values_BT = forward(model_cfg, params, tokens_BT, positions(mask_BT), causal_mask(mask_BT), head="scalar")
  last_B = jnp.max(jnp.where(mask_BT, jnp.arange(T)[None, :], 0), axis=1)
  return jnp.take_along_axis(values_BT, last_B[:, None], axis=1)[:, 0]


def packed_attention_mask(segment_ids_BT, branch_ids_BT=None):
  """[B, T, T] mask: query t sees key s iff s <= t and both are in the same (non-padding) document,
  and, with `branch_ids_BT`, the key is in the document's trunk (branch 0) or in the query's branch."""
  seg_BT = jnp.asarray(segment_ids_BT)
  T = seg_BT.shape[1]
  same_BTS = (seg_BT[:, :, None] == seg_BT[:, None, :]) & (seg_BT[:, None, :] > 0)
  if branch_ids_BT is not None:
    br_BT = jnp.asarray(branch_ids_BT)
    same_BTS &= (br_BT[:, None, :] == 0) | (br_BT[:, :, None] == br_BT[:, None, :])
  return same_BTS & jnp.tril(jnp.ones((T, T), bool))[None]
