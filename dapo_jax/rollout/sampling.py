"""Batched generation: one jitted program, prefill then a `lax.while_loop` decode with a KV cache.

Log-probs of sampled tokens come from the temperature-scaled logits (before top-k/top-p
truncation), which is the quantity the trainer recomputes for π_old.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from dapo_jax.model import decode as decode_lib
from dapo_jax.model import kv_cache as kvc
from dapo_jax.model import transformer as model_lib


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """Static sampling knobs (a change recompiles)."""
  max_new_tokens: int             # C: completion buffer length
  temperature: float = 1.0        # 0.0 = greedy
  top_p: float = 1.0              # nucleus mass; 1.0 = off
  top_k: int = 0                  # keep the k most likely tokens; 0 = off
  eos_ids: tuple[int, ...] = ()   # a row stops at the first of any of these
  pad_id: int = 0                 # written after a row has stopped
  per_request: bool = False       # the engine's rows carry their own temperature and top-p (a server)
  raw_logprobs: bool = False      # per_request: record the model's log-probs (temperature 1), not the sampled ones

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
    if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
      raise ValueError(f"bad sampling parameters: temperature={self.temperature}, top_p={self.top_p}, "
                       f"top_k={self.top_k}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


@struct.dataclass
class Samples:
  tokens_BC: jax.Array     # int32 completion tokens, pad_id after the end
  logp_BC: jax.Array       # fp32 log-prob of each sampled token (temperature-scaled logits)
  mask_BC: jax.Array       # bool: tokens up to and including the first EOS
  length_B: jax.Array      # int32 number of completion tokens (EOS included)
  truncated_B: jax.Array   # bool: no EOS within the budget
  policy_BC: jax.Array | None = None   # episodes: tokens the policy sampled (None: all of mask_BC)
  switch_B: jax.Array | None = None    # partial rollouts: first token drawn by updated params (-1: none)
  experts_BCLk: jax.Array | None = None  # routing replay: each fed token's experts per expert layer (-1: none)


@struct.dataclass
class SamplingState:
  step: jax.Array          # int32 scalar: completion tokens chosen so far
  tokens_BC: jax.Array     # completion buffer
  logp_BC: jax.Array       # log-probs of the chosen tokens
  done_B: jax.Array        # bool: row has emitted an EOS
  length_B: jax.Array      # tokens emitted per row, EOS included
  logits_BV: jax.Array     # fp32 logits for the next token
  cache: kvc.KVCache
  rng: jax.Array


def scaled_logits(logits_BV: jax.Array, cfg: SamplerConfig) -> jax.Array:
  return logits_BV if cfg.greedy else logits_BV / cfg.temperature


def truncate(z_BV: jax.Array, top_k: int, top_p: float) -> jax.Array:
  """Top-k, then top-p (nucleus) on what is left; dropped logits become -inf."""
  neg_inf = jnp.array(-jnp.inf, z_BV.dtype)
  if top_k and top_k < z_BV.shape[-1]:
    kth_B1 = jax.lax.top_k(z_BV, top_k)[0][:, -1:]
    z_BV = jnp.where(z_BV < kth_B1, neg_inf, z_BV)
  if top_p < 1.0:
    sorted_BV = jnp.sort(z_BV, axis=-1)[:, ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    # Keep a token while the mass strictly before it is below top_p (the first one always stays).
    keep_BV = (jnp.cumsum(probs_BV, axis=-1) - probs_BV) < top_p
    threshold_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    z_BV = jnp.where(z_BV < threshold_B1, neg_inf, z_BV)
  return z_BV


def sample_inverse_cdf(logp_BV: jax.Array, u_B: jax.Array, block: int = 128) -> jax.Array:
  """Draws token i with probability exp(logp[i]) by inverting the CDF at u in [0, 1).

  Exact like Gumbel-max but needs one uniform per row instead of V: on CPU the V random numbers
  and logarithms cost more than the model itself for large vocabularies. The CDF is built in two
  levels (block masses, then one block), so no O(V log V) scan runs over the whole vocabulary.
  A token of probability 0 is never drawn.
  """
  B, V = logp_BV.shape
  nb = -(-V // block)
  p_Bnb = jnp.pad(jnp.exp(logp_BV), ((0, 0), (0, nb * block - V))).reshape(B, nb, block)
  mass_Bn = p_Bnb.sum(-1)
  cdf_Bn = jnp.cumsum(mass_Bn, -1)
  u_B = u_B * cdf_Bn[:, -1]
  blk_B = jnp.sum(cdf_Bn < u_B[:, None], -1)  # First block whose cumulative mass reaches u.
  pick = lambda x_Bn: jnp.take_along_axis(x_Bn, blk_B[:, None], axis=1)[:, 0]
  p_Bb = jnp.take_along_axis(p_Bnb, blk_B[:, None, None], axis=1)[:, 0]
  u_B = u_B - (pick(cdf_Bn) - pick(mass_Bn))
  i_B = jnp.sum(jnp.cumsum(p_Bb, -1) < u_B[:, None], -1)
  # Rounding can leave u just past the block's own sum: stay on its last token of positive mass.
  last_B = block - 1 - jnp.argmax(p_Bb[:, ::-1] > 0, axis=-1)
  return blk_B * block + jnp.minimum(i_B, last_B)


def choose(logits_BV: jax.Array, u_B: jax.Array, cfg: SamplerConfig) -> tuple[jax.Array, jax.Array]:
  """Picks one token per row from a uniform draw u_B in [0, 1) each (unused when greedy); returns
  (tokens_B, logp_B), logp from the temperature-scaled logits before any truncation."""
  z_BV = scaled_logits(logits_BV.astype(jnp.float32), cfg)
  logp_BV = jax.nn.log_softmax(z_BV, axis=-1)
  if cfg.greedy:
    tok_B = jnp.argmax(z_BV, axis=-1)
  else:
    logq_BV = logp_BV  # The distribution sampled from: renormalised after any truncation.
    if cfg.top_k or cfg.top_p < 1.0:
      logq_BV = jax.nn.log_softmax(truncate(z_BV, cfg.top_k, cfg.top_p), axis=-1)
    tok_B = sample_inverse_cdf(logq_BV, u_B)
  tok_B = tok_B.astype(jnp.int32)
  return tok_B, jnp.take_along_axis(logp_BV, tok_B[:, None], axis=-1)[:, 0]


def choose_rows(logits_BV: jax.Array, u_B: jax.Array, temperature_B: jax.Array, top_p_B: jax.Array,
                top_k: int = 0, raw: bool = False) -> tuple[jax.Array, jax.Array]:
  """`choose` with each row's own temperature (0 = greedy) and top-p, as a server's requests ask:
  row b gets exactly what `choose` gives with SamplerConfig(temperature_B[b], top_p_B[b], top_k).
  The nucleus sort runs only when some row truncates. `raw`: the log-probs returned are the model's
  own (the logits' log-softmax, vLLM's default `raw_logprobs`), not those of the distribution drawn from."""
  greedy_B1 = (temperature_B == 0.0)[:, None]
  z_BV = logits_BV.astype(jnp.float32)
  z_BV = jnp.where(greedy_B1, z_BV, z_BV / jnp.where(greedy_B1, 1.0, temperature_B[:, None]))
  logp_BV = jax.nn.log_softmax(z_BV, axis=-1)

  def truncated(z_BV):
    neg_inf = jnp.array(-jnp.inf, z_BV.dtype)
    if top_k and top_k < z_BV.shape[-1]:
      z_BV = jnp.where(z_BV < jax.lax.top_k(z_BV, top_k)[0][:, -1:], neg_inf, z_BV)
    sorted_BV = jnp.sort(z_BV, axis=-1)[:, ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    keep_BV = (jnp.cumsum(probs_BV, axis=-1) - probs_BV) < top_p_B[:, None]
    threshold_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    z_BV = jnp.where((z_BV < threshold_B1) & (top_p_B[:, None] < 1.0), neg_inf, z_BV)
    return jax.nn.log_softmax(z_BV, axis=-1)

  truncates = jnp.any(top_p_B < 1.0) | (top_k > 0)
  logq_BV = jax.lax.cond(truncates, truncated, lambda _: logp_BV, z_BV)
  tok_B = jnp.where(greedy_B1[:, 0], jnp.argmax(z_BV, axis=-1), sample_inverse_cdf(logq_BV, u_B)).astype(jnp.int32)
  if raw:
    logp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
  return tok_B, jnp.take_along_axis(logp_BV, tok_B[:, None], axis=-1)[:, 0]


def prefill(model_cfg: model_lib.ModelConfig, params, prompt_BP, prompt_mask_BP, cache_size: int, images_BMD=None):
  """Runs the prompt (with its image vectors, if any) through the model; returns (next-token logits, a
  cache whose slots [0, P) are filled)."""
  P = prompt_BP.shape[1]
  # Left padding: every row's last prompt token sits at P-1; only it needs unembedding.
  logits_B1V, (k_LBKPH, v_LBKPH) = model_lib.forward(
      model_cfg, params, prompt_BP, model_lib.positions(prompt_mask_BP),
      model_lib.attention_mask(model_cfg, prompt_BP, prompt_mask_BP), logits_from=P - 1, emit_kv=True,
      images_BMD=images_BMD)
  return logits_B1V[:, -1], kvc.from_prompt(k_LBKPH, v_LBKPH, prompt_mask_BP, cache_size)


def decode(model_cfg: model_lib.ModelConfig, cfg: SamplerConfig, dparams, state: SamplingState,
           prompt_len_B: jax.Array, budget: jax.Array, stop_at_B: jax.Array) -> SamplingState:
  """The decode loop: choose a token, feed it back through the cache, until every row stops.
  Row b's token number stop_at_B[b] is forced to EOS (a benchmark's length hook; C + 1 = never)."""
  P = state.cache.size - cfg.max_new_tokens
  eos = jnp.asarray(cfg.eos_ids or (-1,), jnp.int32)

  def cond(s: SamplingState):
    within_budget = s.step < budget
    some_row_running = ~jnp.all(s.done_B)
    return within_budget & some_row_running

  def body(s: SamplingState) -> SamplingState:
    rng, key = jax.random.split(s.rng)
    tok_B, logp_B = choose(s.logits_BV, jax.random.uniform(key, (s.logits_BV.shape[0],)), cfg)
    running_B = ~s.done_B
    tok_B = jnp.where(s.step == stop_at_B - 1, eos[0], tok_B)
    tok_B = jnp.where(running_B, tok_B, cfg.pad_id)
    logp_B = jnp.where(running_B, logp_B, 0.0)
    tokens_BC = jax.lax.dynamic_update_slice(s.tokens_BC, tok_B[:, None], (0, s.step))
    logp_BC = jax.lax.dynamic_update_slice(s.logp_BC, logp_B[:, None], (0, s.step))
    done_B = s.done_B | jnp.isin(tok_B, eos)

    slot = P + s.step
    cache = kvc.write_mask(s.cache, jnp.ones_like(tok_B, bool)[:, None], slot)
    logits_BV, cache = decode_lib.decode_step(model_cfg, dparams, tok_B, prompt_len_B + s.step, cache, slot)
    return SamplingState(step=s.step + 1, tokens_BC=tokens_BC, logp_BC=logp_BC, done_B=done_B,
                         length_B=s.length_B + running_B.astype(jnp.int32), logits_BV=logits_BV,
                         cache=cache, rng=rng)

  return jax.lax.while_loop(cond, body, state)


@functools.partial(jax.jit, static_argnums=(0, 1, 7))
def generate_jit(model_cfg, cfg: SamplerConfig, params, prompt_QP, prompt_mask_QP, rng, budget, G: int,
              stop_at_B, images_QMD=None) -> Samples:
  Q, P = prompt_QP.shape
  B, C = Q * G, cfg.max_new_tokens
  # Each prompt is prefilled once; its G samples share the result (rows qG..qG+G-1).
  logits_QV, cache = prefill(model_cfg, params, prompt_QP, prompt_mask_QP, P + C, images_QMD)
  logits_BV, cache = jax.tree.map(lambda x_Q: jnp.repeat(x_Q, G, axis=0), (logits_QV, cache))
  state = SamplingState(
      step=jnp.zeros((), jnp.int32), tokens_BC=jnp.full((B, C), cfg.pad_id, jnp.int32),
      logp_BC=jnp.zeros((B, C), jnp.float32), done_B=jnp.zeros((B,), bool),
      length_B=jnp.zeros((B,), jnp.int32), logits_BV=logits_BV, cache=cache, rng=rng)
  prompt_len_B = jnp.repeat(jnp.sum(prompt_mask_QP, axis=-1, dtype=jnp.int32), G)
  dparams = decode_lib.decode_params(model_cfg, params)
  state = decode(model_cfg, cfg, dparams, state, prompt_len_B, jnp.minimum(budget, C), stop_at_B)
  mask_BC = jnp.arange(C)[None, :] < state.length_B[:, None]
  return Samples(tokens_BC=state.tokens_BC, logp_BC=state.logp_BC, mask_BC=mask_BC,
                 length_B=state.length_B, truncated_B=~state.done_B)


def generate(model_cfg: model_lib.ModelConfig, cfg: SamplerConfig, params, prompt_QP, prompt_mask_QP,
             rng: jax.Array, max_new_tokens: int | None = None, num_samples: int = 1, stop_at_B=None,
             images_QMD=None) -> Samples:
  """Samples `num_samples` (G) completions per left-padded prompt row: Q prompts -> B = Q*G rows,
  prompt q's samples at rows qG..qG+G-1; the whole batch decodes until its longest row ends.
  `max_new_tokens` <= C needs no recompile. `stop_at_B` forces row b's token number stop_at_B[b]
  to be its first EOS (benchmarks' response-length hook). `images_QMD`: each prompt's image vectors (a
  vision-language model: `vision.image_features`), in the order of its image placeholders."""
  budget = jnp.asarray(cfg.max_new_tokens if max_new_tokens is None else max_new_tokens, jnp.int32)
  B = len(prompt_QP) * num_samples
  if stop_at_B is None:
    stop_at_B = jnp.full((B,), cfg.max_new_tokens + 1, jnp.int32)
  return generate_jit(model_cfg, cfg, params, jnp.asarray(prompt_QP, jnp.int32),
                   jnp.asarray(prompt_mask_QP, bool), rng, budget, num_samples, jnp.asarray(stop_at_B, jnp.int32),
                   images_QMD)
