"""The slot pool's device side: its arrays (`SlotState`) and the jitted programs the engine runs on
them. Each program is compiled per model (a decode round: and sampler config) and shape, and shared
by every engine and session.

    prefill        a chunk of distinct prompts' keys, values and first-token logits
    prefill_shared the same for prompts sharing a prefix, which runs once
    prefill_cached the same for prompts whose prefix is in a paged cache's pages: only the rest runs
    start_samples  their samples into free slots: cache rows written, keys and budgets set
    start_paged    the same into a paged cache: the slots' page tables set, the prompts' new pages written
    write_prompt_pages  prefilled prompts' whole pages into the pool (a prefix cache's)
    assign_pages   pages added to slots' tables (a paged cache grows ahead of each round)
    decode_round   every busy slot one token per step, until enough have ended
    take_rows      ended slots' tokens and log-probs to the host
    move_rows      busy rows (cache included) into a pool of another width
    resume         an episode's observation tokens appended to its slot
    end_rows       slots ended early (a cancelled request)

The host side, which slot holds which sample and when each program runs, is `session.Session`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from dapo_jax.model import decode
from dapo_jax.model import kv_cache as kvc
from dapo_jax.model import paged_cache as paged
from dapo_jax.model import transformer as model_lib
from dapo_jax.rollout import sampling


@struct.dataclass
class SlotState:
  """The device side of the pool: S slots, C completion positions, a cache of P + C per slot (dense:
  a row of its own; paged: pages of a shared pool, through the slot's page table)."""
  tokens_SC: jax.Array     # completion tokens of each slot's sample (pad after its end)
  logp_SC: jax.Array       # fp32 log-probs of those tokens (temperature-scaled logits)
  step_S: jax.Array        # tokens the slot's sample has drawn
  done_S: jax.Array        # the sample ended (EOS or budget), or the slot is empty
  logits_SV: jax.Array     # fp32 logits of each slot's next token
  prompt_len_S: jax.Array  # real prompt tokens (positions continue from there)
  key_S: jax.Array         # uint32 key data of each slot's sample
  stop_at_S: jax.Array     # forced EOS as token stop_at (benchmarks' length hook); C + 1 = never
  cache: kvc.KVCache | paged.PagedCache
  # Episodes: tokens_SC[s, step:force_end_S[s]] are an observation's tokens, fed (not sampled)
  # one per decode step beside the other slots' sampling; policy_SC marks the sampled ones; the
  # current turn ends at EOS or once the sample has drawn turn_end_S tokens.
  policy_SC: jax.Array     # bool: the token was sampled by the policy
  force_end_S: jax.Array
  turn_end_S: jax.Array
  # Per-request sampling (`SamplerConfig.per_request`, a server): each slot's temperature and top-p.
  temperature_S: jax.Array
  top_p_S: jax.Array
  # Routing replay (`model.router_replay`): the experts each fed token went to in every expert layer,
  # int32 [S, C, L_moe, k] (-1: not fed); None otherwise.
  experts_SCLk: jax.Array | None = None




def empty(model_cfg: model_lib.ModelConfig, sampler_cfg: sampling.SamplerConfig, S: int, T: int, kv_dtype,
          page_size: int = 0, num_pages: int = 0, shards: int = 1, read: str = "gather",
          chunk_pages: int = 128) -> SlotState:
  """S free slots of T = prompt + completion positions (on the default device; the engine places them);
  page_size > 0: their cache is a pool of `num_pages` pages of that many positions per batch shard
  (`paged_cache`), which decoding reads by `read` (ragged: `chunk_pages` pages at a time)."""
  cfg, C = model_cfg, sampler_cfg.max_new_tokens
  dt = kv_dtype  # Writes into the cache cast to it (`kv_cache.update`, `write_row`).
  if page_size:
    cache = paged.empty(cfg.num_layers, num_pages, cfg.num_kv_heads, cfg.head_dim, page_size, S, T, dt, shards,
                        read, chunk_pages)
  else:
    cache = kvc.KVCache(k=[jnp.zeros((S, cfg.num_kv_heads, cfg.head_dim, T), dt) for _ in range(cfg.num_layers)],
                        v=[jnp.zeros((S, cfg.num_kv_heads, T, cfg.head_dim), dt) for _ in range(cfg.num_layers)],
                        mask_BS=jnp.zeros((S, T), bool))
  return SlotState(tokens_SC=jnp.full((S, C), sampler_cfg.pad_id, jnp.int32),
                   logp_SC=jnp.zeros((S, C), jnp.float32), step_S=jnp.zeros((S,), jnp.int32),
                   done_S=jnp.ones((S,), bool), logits_SV=jnp.zeros((S, cfg.vocab_size), jnp.float32),
                   prompt_len_S=jnp.zeros((S,), jnp.int32), key_S=jnp.zeros((S, 2), jnp.uint32),
                   stop_at_S=jnp.full((S,), C + 1, jnp.int32), cache=cache,
                   policy_SC=jnp.zeros((S, C), bool), force_end_S=jnp.zeros((S,), jnp.int32),
                   turn_end_S=jnp.full((S,), C, jnp.int32),
                   temperature_S=jnp.full((S,), sampler_cfg.temperature, jnp.float32),
                   top_p_S=jnp.full((S,), sampler_cfg.top_p, jnp.float32),
                   experts_SCLk=jnp.full((S, C, cfg.num_moe_layers, cfg.experts_per_token), -1, jnp.int32)
                   if cfg.router_replay == "R3" else None)


def sample_key_data(key_data: jax.Array, prompt_id: jax.Array, sample: jax.Array) -> jax.Array:
  """The key of sample g of prompt q: fold_in(fold_in(key, q), g), as raw key data."""
  key = jax.random.wrap_key_data(key_data)
  return jax.random.key_data(jax.random.fold_in(jax.random.fold_in(key, prompt_id), sample))





@functools.partial(jax.jit, static_argnums=(0,))
def prefill(model_cfg: model_lib.ModelConfig, params, prompt_UP, mask_UP, images_UMD=None):
  """The next-token logits [U, V] of U distinct prompts and their keys and values [L, U, K, P, H]: the
  model's part of an insert, one program per (U, P) bucket, shared by every sampler of the model. A
  vision-language model's prompts bring their image vectors (`vision.image_features`)."""
  logits_U1V, (k_LUKPH, v_LUKPH) = model_lib.forward(
      model_cfg, params, prompt_UP, model_lib.positions(mask_UP),
      model_lib.attention_mask(model_cfg, prompt_UP, mask_UP), logits_from=prompt_UP.shape[1] - 1, emit_kv=True,
      images_BMD=images_UMD)
  return logits_U1V[:, -1], k_LUKPH, v_LUKPH


@functools.partial(jax.jit, static_argnums=(0,))
def prefill_shared(model_cfg: model_lib.ModelConfig, params, prefix_1N, suffix_UT, suffix_mask_UT):
  """`prefill` of U prompts [prefix_1N | suffix u] whose common prefix runs through the model once:
  the same logits [U, V], and keys and values [L, U, K, N + T, H] laid out as the prompts
  [prefix | left-padded suffix]. One program per (N, U, T)."""
  logits_UV, (k_L1KNH, v_L1KNH), (k_LUKTH, v_LUKTH) = model_lib.prefill_after_prefix(
      model_cfg, params, prefix_1N, suffix_UT, suffix_mask_UT)
  whole = lambda p, s: jnp.concatenate([jnp.broadcast_to(p, (*s.shape[:3], *p.shape[3:])), s], axis=3)
  return logits_UV, whole(k_L1KNH, k_LUKTH), whole(v_L1KNH, v_LUKTH)


@functools.partial(jax.jit, static_argnums=(0,))
def prefill_cached(model_cfg: model_lib.ModelConfig, dparams, k_pools, v_pools, pages_n, suffix_UT, suffix_mask_UT):
  """`prefill_shared` whose prefix is n whole pages of a paged cache's pool (a prefix cache's, ids
  `pages_n` over the whole pool): their keys and values are read, and only the suffixes run through the
  model (`decode.prefill_after_cache`). The same logits [U, V], and keys and values [L, U, K, N + T, H]
  laid out as the prompts [prefix | left-padded suffix]. One program per (n, U, T)."""
  def prefix(pool_KNpH):  # [N, K, H]: the pages' tokens in order.
    K, _, p, H = pool_KNpH.shape
    return pool_KNpH[:, pages_n].transpose(1, 2, 0, 3).reshape(pages_n.shape[0] * p, K, H)
  k_LNKH, v_LNKH = jnp.stack([prefix(k) for k in k_pools]), jnp.stack([prefix(v) for v in v_pools])
  logits_UV, (k_LUKTH, v_LUKTH) = decode.prefill_after_cache(model_cfg, dparams, k_LNKH, v_LNKH, suffix_UT,
                                                                suffix_mask_UT)
  whole = lambda p_LNKH, s: jnp.concatenate(
      [jnp.broadcast_to(p_LNKH.transpose(0, 2, 1, 3)[:, None].astype(s.dtype), (*s.shape[:3], p_LNKH.shape[1],
                                                                                s.shape[4])), s], axis=3)
  return logits_UV, whole(k_LNKH, k_LUKTH), whole(v_LNKH, v_LUKTH)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
def start_samples(pad_id: int, state: SlotState, key_S, logits_UV, k_LUKPH, v_LUKPH, mask_UP, src_S, slot_S,
                   stop_at_S, turn_end_S, temperature_S, top_p_S, n) -> SlotState:
  """Starts sample a < n in slot slot_S[a] from prefilled prompt src_S[a] with key key_S[a]. The
  arguments are slot-sized whatever the number of samples (entries a >= n: slot ids out of range),
  and the cache rows are written one by one in place, so an insert compiles once per prefill shape
  and costs the rows it writes."""
  P, C = mask_UP.shape[1], state.tokens_SC.shape[1]
  start = state.cache.size - C - P
  mask_UT = jnp.pad(mask_UP, ((0, 0), (start, C)))

  def write(a, cache):
    u = src_S[a]
    return kvc.write_row(cache, slot_S[a], start, k_LUKPH[:, u], v_LUKPH[:, u], mask_UT[u])

  cache = jax.lax.fori_loop(0, n, write, state.cache)
  return _started(pad_id, state, cache, key_S, logits_UV, mask_UP, src_S, slot_S, stop_at_S, turn_end_S,
                  temperature_S, top_p_S)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
def start_paged(pad_id: int, state: SlotState, key_S, logits_UV, k_LUKPH, v_LUKPH, mask_UP, src_S, slot_S,
                stop_at_S, turn_end_S, temperature_S, top_p_S, table_SM, src_GW, page_GW, dst_GW,
                n_writes) -> SlotState:
  """`start_samples` into a paged cache: slot slot_S[a] takes page table table_SM[a], and for w <
  n_writes logical page page_GW[g, w] of prefilled prompt src_GW[g, w] is copied into page dst_GW[g, w]
  of shard g's pool (the prompt pages that no running sample of the shard holds yet, and each
  sample's own copy of its prompt's last, partial page). The write arrays have a fixed size per slot
  count; their entries w >= n_writes, or whose page is out of the shard's range, are ignored."""
  P, C = mask_UP.shape[1], state.tokens_SC.shape[1]
  start = state.cache.size - C - P
  mask_UT = jnp.pad(mask_UP, ((0, 0), (start, C)))
  cache = paged.write_pages(state.cache, k_LUKPH, v_LUKPH, mask_UP, src_GW, page_GW, dst_GW, n_writes)
  cache = cache.replace(table_BM=cache.table_BM.at[slot_S].set(table_SM, mode="drop"),
                        mask_BS=cache.mask_BS.at[slot_S].set(mask_UT[src_S], mode="drop"))
  return _started(pad_id, state, cache, key_S, logits_UV, mask_UP, src_S, slot_S, stop_at_S, turn_end_S,
                  temperature_S, top_p_S)


@functools.partial(jax.jit, donate_argnums=(0,))
def write_prompt_pages(state: SlotState, k_LUKPH, v_LUKPH, mask_UP, src_GW, page_GW, dst_GW, n) -> SlotState:
  """`start_paged`'s page writes alone: prefilled prompts' pages into the pool (a prefix cache's)."""
  return state.replace(cache=paged.write_pages(state.cache, k_LUKPH, v_LUKPH, mask_UP, src_GW, page_GW, dst_GW, n))


def _started(pad_id, state, cache, key_S, logits_UV, mask_UP, src_S, slot_S, stop_at_S, turn_end_S, temperature_S,
             top_p_S) -> SlotState:
  """`state` with the samples of `start_samples` set up in their slots, beside `cache` (written)."""
  put = lambda x, v: x.at[slot_S].set(v, mode="drop")
  return SlotState(
      tokens_SC=put(state.tokens_SC, pad_id), logp_SC=put(state.logp_SC, 0.0),
      step_S=put(state.step_S, 0), done_S=put(state.done_S, False),
      logits_SV=put(state.logits_SV, logits_UV[src_S]),
      prompt_len_S=put(state.prompt_len_S, jnp.sum(mask_UP, axis=1, dtype=jnp.int32)[src_S]),
      key_S=put(state.key_S, key_S), stop_at_S=put(state.stop_at_S, stop_at_S), cache=cache,
      policy_SC=put(state.policy_SC, False), force_end_S=put(state.force_end_S, 0),
      turn_end_S=put(state.turn_end_S, turn_end_S), temperature_S=put(state.temperature_S, temperature_S),
      top_p_S=put(state.top_p_S, top_p_S),
      experts_SCLk=None if state.experts_SCLk is None else put(state.experts_SCLk, -1))


@functools.partial(jax.jit, donate_argnums=(0,))
def assign_pages(state: SlotState, slot_W, col_W, page_W) -> SlotState:
  """table[slot_W[w], col_W[w]] = page_W[w] (entries with a slot out of range: none)."""
  table_BM = state.cache.table_BM.at[slot_W, col_W].set(page_W, mode="drop")
  return state.replace(cache=state.cache.replace(table_BM=table_BM))


sample_keys = jax.jit(jax.vmap(sample_key_data, in_axes=(None, 0, 0)))  # [A, 2] key data, one program per width.


def move_rows(state: SlotState, rows_N, row_sharding) -> SlotState:
  """A pool of N rows: row n is row rows_N[n] of `state` (cache included), or empty where out of range. A
  paged cache's pool stays as it is: the rows' page tables move."""
  if not isinstance(state.cache, paged.PagedCache):
    return _move_rows(state, rows_N, row_sharding)
  k, v = state.cache.k, state.cache.v
  moved = _move_rows(state.replace(cache=state.cache.replace(k=[], v=[])), rows_N, row_sharding)
  return moved.replace(cache=moved.cache.replace(k=k, v=v))


@functools.partial(jax.jit, static_argnums=(2,))
def _move_rows(state: SlotState, rows_N, row_sharding) -> SlotState:
  take = lambda x, fill=0: jax.lax.with_sharding_constraint(
      jnp.take(x, rows_N, axis=0, mode="fill", fill_value=fill), row_sharding)
  return jax.tree.map(take, state).replace(done_S=take(state.done_S, True))


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def decode_round(model_cfg: model_lib.ModelConfig, sc: sampling.SamplerConfig, dparams, state: SlotState, target_ended,
            max_steps) -> tuple[SlotState, jax.Array]:
  """Decodes until `target_ended` samples have ended in this round, all have, or `max_steps`."""
  C = sc.max_new_tokens
  P = state.cache.size - C
  eos = jnp.asarray(sc.eos_ids or (-1,), jnp.int32)
  rows_S = jnp.arange(state.step_S.shape[0])
  done_at_start = state.done_S

  def cond(carry):
    i, s = carry
    ended = jnp.sum(s.done_S & ~done_at_start)
    return (i < max_steps) & (ended < target_ended) & ~jnp.all(s.done_S)

  def body(carry):
    i, s = carry
    keys = jax.random.wrap_key_data(s.key_S)
    u_S = jax.vmap(lambda k, t: jax.random.uniform(jax.random.fold_in(k, t)))(keys, s.step_S)
    if sc.per_request:
      tok_S, logp_S = sampling.choose_rows(s.logits_SV, u_S, s.temperature_S, s.top_p_S, sc.top_k, sc.raw_logprobs)
    else:
      tok_S, logp_S = sampling.choose(s.logits_SV, u_S, sc)
    running_S = ~s.done_S
    forced_S = s.step_S == s.stop_at_S - 1
    tok_S = jnp.where(forced_S, eos[0], tok_S)
    observed_S = s.step_S < s.force_end_S  # An observation's token: fed, not sampled.
    tok_S = jnp.where(observed_S, s.tokens_SC[rows_S, jnp.minimum(s.step_S, C - 1)], tok_S)
    logp_S = jnp.where(observed_S, 0.0, logp_S)
    tok_S = jnp.where(running_S, tok_S, sc.pad_id)
    col_S = jnp.where(running_S, s.step_S, C)  # Out of range: ended rows write nothing.
    tokens_SC = s.tokens_SC.at[rows_S, col_S].set(tok_S, mode="drop")
    logp_SC = s.logp_SC.at[rows_S, col_S].set(logp_S, mode="drop")
    policy_SC = s.policy_SC.at[rows_S, col_S].set(~observed_S, mode="drop")
    ended_S = running_S & ~observed_S & (jnp.isin(tok_S, eos) | (s.step_S + 1 >= jnp.minimum(s.turn_end_S, C)))
    index_S = jnp.minimum(P + s.step_S, P + C - 1)
    cache = kvc.write_mask_rows(s.cache, running_S, index_S)
    if isinstance(cache, paged.PagedCache):  # An ended row writes nothing: its pages may be another's now.
      index_S = jnp.where(running_S, index_S, cache.size)
    logits_SV, cache, *experts = decode.decode_step(model_cfg, dparams, tok_S, s.prompt_len_S + s.step_S, cache,
                                                    index_S, with_experts=s.experts_SCLk is not None)
    experts_SCLk = s.experts_SCLk
    if experts:  # Routing replay: the experts token col_S went to (its forward is this step's).
      experts_SCLk = experts_SCLk.at[rows_S, col_S].set(experts[0], mode="drop")
    return i + 1, s.replace(tokens_SC=tokens_SC, logp_SC=logp_SC, policy_SC=policy_SC, step_S=s.step_S + running_S,
                            done_S=s.done_S | ended_S, logits_SV=logits_SV, cache=cache, experts_SCLk=experts_SCLk)

  steps, state = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state))
  return state, steps


_decode_layers = jax.jit(decode.decode_layers, static_argnums=(0,))


def decode_params(model_cfg: model_lib.ModelConfig, params) -> dict:
  """`decode.decode_params`, with only the per-layer weights made by a program (its outputs are new
  arrays): the embedding and final norm are the params' own arrays where their dtype matches."""
  return dict(layers=_decode_layers(model_cfg, params), **decode.decode_ends(model_cfg, params))


end_rows = jax.jit(lambda state, end_S: state.replace(done_S=state.done_S | end_S), donate_argnums=(0,))

take_rows = jax.jit(lambda tokens_SC, logp_SC, policy_SC, rows_A: (tokens_SC[rows_A], logp_SC[rows_A],
                                                                    policy_SC[rows_A]))
take_experts = jax.jit(lambda experts_SCLk, rows_A: experts_SCLk[rows_A])


@functools.partial(jax.jit, donate_argnums=(0,))
def resume(state: SlotState, slot, obs_N, n, turn_tokens) -> SlotState:
  """Slot `slot` continues its episode: the observation obs_N[:n] is written after the tokens it
  has drawn, to be fed through the decode loop (`force_end_S`); its next turn may draw
  `turn_tokens` tokens after that. One program per observation bucket N."""
  C = state.tokens_SC.shape[1]
  step = state.step_S[slot]
  cols_N = jnp.where(jnp.arange(obs_N.shape[0]) < n, step + jnp.arange(obs_N.shape[0]), C)
  return state.replace(tokens_SC=state.tokens_SC.at[slot, cols_N].set(obs_N, mode="drop"),
                       force_end_S=state.force_end_S.at[slot].set(step + n),
                       turn_end_S=state.turn_end_S.at[slot].set(step + n + turn_tokens),
                       done_S=state.done_S.at[slot].set(False))
