"""Cached decoding: one token per row through a KV cache (dense rows, `kv_cache`, or pages,
`paged_cache`), the per-layer decode weights it reads, and a prefill after a cached prefix.

The teacher-forced model (`transformer`) keeps its layers stacked for `nn.scan`. The decode loop
instead reads a per-layer copy of the weights, made once per `generate` call, with q/k/v fused into
one matrix and gate/up into another: each decoded token then runs three matmuls fewer per layer and
never slices a stacked weight or cache (a slice inside the loop is a copy on every token).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dapo_jax.model import kv_cache as kvc
from dapo_jax.model import layers as layers_lib
from dapo_jax.model import lora as lora_lib
from dapo_jax.model import paged_cache as paged
from dapo_jax.model import quant
from dapo_jax.model.config import ModelConfig
from dapo_jax.model.transformer import Params, causal_mask, embed, positions, run_name

Cache = kvc.KVCache | paged.PagedCache  # A decode step reads either layout (`_attend_dense`, `_attend_paged`).


def decode_params(cfg: ModelConfig, params: Params) -> dict:
  """Per-layer weights for `decode_step` (`decode_layers`) and the model's ends (`decode_ends`)."""
  return dict(layers=decode_layers(cfg, params), **decode_ends(cfg, params))


def decode_layers(cfg: ModelConfig, params: Params) -> list[dict]:
  """Per-layer decode weights: matrices in the matmul dtype, the rest in the compute dtype.

  layers[l]: attn_norm, wqkv_DKJH (J = R + 2: the R query heads of KV group k, then its key and
  its value, so tensor parallelism splits K), bqkv_KJH (None without bias), wo_NHD, mlp_norm,
  w_gate_up_D2F, w_down_FD (an expert layer: router_DE and the stacked experts as they are): what
  `layer` reads.
  An adapted tree (`lora`) on a float base decodes with its adapters merged in (each token then
  costs what the base model's does). On an int8 base the matrices stay int8 (fused like the float
  ones, dequantized inside each matmul) and the adapters unmerged (layers[l]["lora"], as `dense`
  reads them): no float copy of the base is ever made, one layer's dequantized matrix at a time.
  """
  lora = None
  if lora_lib.is_adapted(params):
    if quant.is_quantized(params["base"]["layers"]["wq_DNH"]):
      lora = {"layers": params["lora"]["layers"], "scale": params["lora_scale"]}
      params = params["base"]
    else:
      params = dict(params["base"], layers=lora_lib.merge_layers(params))
  layers = []
  for r, (start, stop, _) in enumerate(cfg.layer_runs):
    layers += _decode_layers(cfg, params[run_name(r)], stop - start, lora)
  return layers


def decode_ends(cfg: ModelConfig, params: Params) -> dict:
  """embed_VD and final_scale_D in the compute dtype, and an untied model's unembed_DV in the matmul
  dtype (a tied one unembeds with embed_VD). Arrays already in their dtype are the params' own,
  not copies (a tied 49K x 576 embedding is 113 MB in fp32)."""
  if lora_lib.is_adapted(params):
    params = params["base"]
  ends = dict(embed_VD=params["embed_VD"].astype(cfg.dtype), final_scale_D=params["final_norm"]["scale_D"].astype(cfg.dtype))
  if not cfg.tie_embeddings:
    ends["unembed_DV"] = params["unembed_DV"].astype(cfg.operand_dtype)
  return ends


def _fuse(join_w, join_scale, *ws):
  """Stacked weights joined into one by `join_w`: float ones as they are, int8 ones ({"int8", "scale"})
  by joining their int8 matrices alike and their scales (the same axes, less the input) by `join_scale`."""
  if not quant.is_quantized(ws[0]):
    return join_w(*ws)
  return {"int8": join_w(*(w["int8"] for w in ws)), "scale": join_scale(*(w["scale"] for w in ws))}


def _decode_layers(cfg: ModelConfig, p: dict, L: int, lora: dict | None = None) -> list[dict]:
  """`decode_params`' per-layer weights of one stack of L alike layers (with `lora`, {"layers",
  "scale"}: an int8 base's unmerged adapters)."""
  D, N, K, H = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  R = N // K
  cast = lambda x: x.astype(cfg.dtype)
  cast_w = lambda x: x if isinstance(x, dict) else x.astype(cfg.operand_dtype)  # int8 stays int8.
  at = lambda x, l: jax.tree.map(lambda a: a[l], x)
  wqkv_LDKJH = _fuse(lambda q, k, v: jnp.concatenate([q.reshape(L, D, K, R, H), k[:, :, :, None], v[:, :, :, None]], axis=3),
                     lambda q, k, v: jnp.concatenate([q.reshape(L, K, R, H), k[:, :, None], v[:, :, None]], axis=2),
                     p["wq_DNH"], p["wk_DKH"], p["wv_DKH"])
  bqkv_LKJH = None
  if cfg.qkv_bias:
    bqkv_LKJH = jnp.concatenate([p["bq_NH"].reshape(L, K, R, H), p["bk_KH"][:, :, None],
                                 p["bv_KH"][:, :, None]], axis=2)
  layers = [dict(attn_norm=dict(scale_D=cast(p["attn_norm"]["scale_D"][l])), wqkv_DKJH=cast_w(at(wqkv_LDKJH, l)),
                 bqkv_KJH=None if bqkv_LKJH is None else cast(bqkv_LKJH[l]), wo_NHD=cast_w(at(p["wo_NHD"], l)),
                 mlp_norm=dict(scale_D=cast(p["mlp_norm"]["scale_D"][l])))
            for l in range(L)]
  if "router_DE" in p:
    mlp = lambda l: {k: cast_w(p[k][l]) for k in ("router_DE",) + layers_lib.EXPERT_WEIGHTS}
  else:
    w_gate_up_LD2F = _fuse(lambda g, u: jnp.stack([g, u], axis=2), lambda g, u: jnp.stack([g, u], axis=1),
                           p["w_gate_DF"], p["w_up_DF"])
    mlp = lambda l: dict(w_gate_up_D2F=cast_w(at(w_gate_up_LD2F, l)), w_down_FD=cast_w(at(p["w_down_FD"], l)))
  for l, layer_p in enumerate(layers):  # The MLP or experts; family extras: q/k norms, post-norms.
    layer_p.update(mlp(l))
    layer_p.update({k: cast(p[k][l]) for k in ("q_norm_H", "k_norm_H") if k in p})
    layer_p.update({k: dict(scale_D=cast(p[k]["scale_D"][l])) for k in ("post_attn_norm", "post_mlp_norm") if k in p})
    if lora is not None:
      layer_p.update(lora={name: at(ad, l) for name, ad in lora["layers"].items()}, lora_scale=lora["scale"])
  return layers


def decode_step(cfg: ModelConfig, dparams: dict, tok_B: jax.Array, pos_B: jax.Array, cache: Cache,
                index: jax.Array, with_experts: bool = False) -> tuple[jax.Array, Cache]:
  """One token per row through the cache: writes slot `index` of every layer, returns (logits_BV fp32, cache);
  `with_experts`: (logits_BV, cache, the experts each row's token went to in every expert layer [B, L_moe, k]).
  `index` is one slot for all rows, or one per row ([B]: a continuous batch; a paged cache's rows
  at `cache.size` or beyond write nothing). A paged cache stores the token by its position `pos_B`.

  `cache.mask_BS` must already mark slot `index` (see `kv_cache.write_mask`); a row attends to
  every marked slot, which are exactly its real tokens up to and including this one (local layers:
  the last `sliding_window` of them; a row's real slots are contiguous, so slot distance is
  position distance).
  """
  tables = {False: layers_lib.rope_table(pos_B[:, None], cfg)}
  mask_B1S = cache.mask_BS[:, None, :]
  masks = {False: mask_B1S}
  if cfg.local_layers:
    tables[True] = layers_lib.rope_table(pos_B[:, None], cfg, local=True)
    offset = index if jnp.ndim(index) == 0 else index[:, None, None]
    masks[True] = layers_lib.windowed(mask_B1S, cfg.sliding_window, offset=offset)
  attend_cache = _attend_paged if isinstance(cache, paged.PagedCache) else _attend_dense
  x_BD = embed(cfg, dparams["embed_VD"], tok_B)
  ks, vs, experts = [], [], []
  for l, (p, k_l, v_l) in enumerate(zip(dparams["layers"], cache.k, cache.v)):
    local = l in cfg.local_layers
    attend = functools.partial(attend_cache, cfg, k_l, v_l, cache, index, tables[local], masks[local])
    if isinstance(cache, paged.PagedCache):
      attend = functools.partial(attend, pos_B=pos_B, windowed=local)
    x_BD, (k_l, v_l), routing = layers_lib.layer(cfg, p, x_BD, attend)
    ks.append(k_l)
    vs.append(v_l)
    if routing is not None:
      experts.append(routing[1])
  x_BD = layers_lib.norm(cfg, x_BD, dparams["final_scale_D"])
  if "unembed_DV" in dparams:
    logits_BV = layers_lib.matmul("BD,DV->BV", x_BD, dparams["unembed_DV"], cfg, jnp.float32)
  else:  # Tied: as fast as a stored transpose on CPU, without its copy of the embedding.
    logits_BV = layers_lib.matmul("BD,VD->BV", x_BD, dparams["embed_VD"], cfg, jnp.float32)
  logits_BV = layers_lib.output_logits(cfg, logits_BV)
  if with_experts:
    return logits_BV, cache.replace(k=ks, v=vs), jnp.stack(experts, axis=1).astype(jnp.int32)
  return logits_BV, cache.replace(k=ks, v=vs)


def prefill_after_cache(cfg: ModelConfig, dparams: dict, k_LNKH: jax.Array, v_LNKH: jax.Array, suffix_UT: jax.Array,
                        suffix_mask_UT: jax.Array):
  """`prefill_after_prefix` whose prefix's keys and values are given ([L, N, K, H] each: a prefix cache's
  pages): only the U left-padded suffixes run through the model (decode weights, `decode_params`),
  attending to the prefix and causally to themselves, positions continuing from N. Returns the next-
  token logits [U, V] (fp32) and the suffixes' keys and values ([L, U, K, T, H] each). No sliding window
  (a window over a cached prefix is not kept)."""
  U, T = suffix_UT.shape
  L, N, K, H = k_LNKH.shape
  R = cfg.num_heads // K
  table = layers_lib.rope_table(N + positions(suffix_mask_UT), cfg)
  mask_UTS = jnp.concatenate([jnp.ones((U, T, N), bool), causal_mask(suffix_mask_UT)], axis=2)
  kw = layers_lib.attn_kw(cfg)

  def attend(k_NKH, v_NKH, q_XKRH, k_XKH, v_XKH):
    q_UTKRH = layers_lib.rope(q_XKRH.reshape(U, T, K * R, H), table).reshape(U, T, K, R, H)
    k_UTKH = layers_lib.rope(k_XKH.reshape(U, T, K, H), table)
    v_UTKH = v_XKH.reshape(U, T, K, H)
    whole = lambda prefix_NKH, own_UTKH: jnp.concatenate(
        [jnp.broadcast_to(prefix_NKH.astype(own_UTKH.dtype), (U, N, K, H)), own_UTKH], axis=1)
    o_UTKRH = layers_lib.attend_rows(q_UTKRH, whole(k_NKH, k_UTKH), whole(v_NKH, v_UTKH), mask_UTS, **kw)
    return o_UTKRH.reshape(U * T, K * R, H), (k_UTKH.transpose(0, 2, 1, 3), v_UTKH.transpose(0, 2, 1, 3))

  x_XD = embed(cfg, dparams["embed_VD"], suffix_UT.reshape(-1))
  ks, vs = [], []
  for p, k_NKH, v_NKH in zip(dparams["layers"], k_LNKH, v_LNKH):
    x_XD, (k_UKTH, v_UKTH), _ = layers_lib.layer(cfg, p, x_XD, functools.partial(attend, k_NKH, v_NKH))
    ks.append(k_UKTH)
    vs.append(v_UKTH)
  x_UD = layers_lib.norm(cfg, x_XD.reshape(U, T, -1)[:, -1], dparams["final_scale_D"])
  if "unembed_DV" in dparams:
    logits_UV = layers_lib.matmul("BD,DV->BV", x_UD, dparams["unembed_DV"], cfg, jnp.float32)
  else:
    logits_UV = layers_lib.matmul("BD,VD->BV", x_UD, dparams["embed_VD"], cfg, jnp.float32)
  return layers_lib.output_logits(cfg, logits_UV), (jnp.stack(ks), jnp.stack(vs))


def _attend_dense(cfg, k_BKHS, v_BKSH, cache, index, table, mask_B1S, q_BKRH, k_BKH, v_BKH):
  """A decode step's attention of one layer through a dense cache: writes the rows' new keys and values
  at `index`, then attends. Returns (o_BNH, (k_BKHS, v_BKSH))."""
  k_BKHS, v_BKSH = kvc.update(k_BKHS, v_BKSH, layers_lib.rope(k_BKH[:, :, None], table), v_BKH[:, :, None], index)
  return _attend_one(cfg, q_BKRH, table, k_BKHS, v_BKSH, mask_B1S), (k_BKHS, v_BKSH)


def _attend_paged(cfg, k_KNpH, v_KNpH, cache, index_B, table, mask_B1S, q_BKRH, k_BKH, v_BKH, *, pos_B,
                  windowed):
  """`_attend_dense` through a paged cache: the new keys and values go to the rows' pages as token
  `pos_B`, which are then read by `cache.read` (`paged_cache`): gathered into the dense view (the dense
  attention's very numbers), in place (ragged), or by the Pallas kernel (a layer whose mask marks all its
  tokens; a sliding window's reads ragged). Returns (o_BNH, (k_KNpH, v_KNpH))."""
  live_B = index_B < cache.size
  k_KNpH, v_KNpH = paged.update(k_KNpH, v_KNpH, cache.table_BM, layers_lib.rope(k_BKH[:, :, None], table)[:, :, 0],
                                v_BKH, pos_B, live_B, cache.shards)
  if cache.read == "gather":
    k_BKHS, v_BKSH = paged.read(k_KNpH, v_KNpH, cache.table_BM, cache.mask_BS, cache.shards)
    return _attend_one(cfg, q_BKRH, table, k_BKHS, v_BKSH, mask_B1S), (k_KNpH, v_KNpH)
  kw = layers_lib.attn_kw(cfg)
  q_BKRH = layers_lib.rope(q_BKRH, table)
  if cache.read == "kernel" and not windowed:  # The kernels attend to a row's tokens [0, pos_B].
    o_BKRH = paged.kernel_attend(q_BKRH, k_KNpH, v_KNpH, cache.table_BM, pos_B + 1, cache.shards, kw["scale"],
                                 kw["softcap"])
  else:
    C = cache.table_BM.shape[1] * cache.page_size
    if windowed:  # The window's run of tokens, as the dense mask has it.
      tokens_BC = paged.token_mask(cache.mask_BS, C, mask_B1S[:, 0])
    else:  # All the row's tokens so far.
      tokens_BC = jnp.arange(C)[None, :] <= pos_B[:, None]
    o_BKRH = paged.attend(q_BKRH, k_KNpH, v_KNpH, cache.table_BM, tokens_BC, live_B, cache.chunk_pages,
                          cache.shards, kw["scale"], kw["softcap"])
  return o_BKRH.reshape(o_BKRH.shape[0], -1, o_BKRH.shape[-1]), (k_KNpH, v_KNpH)


def _attend_one(cfg, q_BKRH, table, k_BKHS, v_BKSH, mask_B1S) -> jax.Array:
  """One query per row against its cache row: [B, N, H]."""
  q_BKR1H = layers_lib.rope(q_BKRH, table)[:, :, :, None]
  o_BKRH = layers_lib.attention(q_BKR1H, k_BKHS, v_BKSH, mask_B1S, k_layout="BKHS", **layers_lib.attn_kw(cfg))
  return o_BKRH[:, :, :, 0].reshape(o_BKRH.shape[0], -1, o_BKRH.shape[-1])
