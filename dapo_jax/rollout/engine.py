"""Continuous batching: a fixed pool of decode slots, refilled from a queue of samples as they end.

    queue of (prompt q, sample g)          slots (static: `slots` rows x one KV-cache length)
      ──► insert  freed slots take the next samples; their prompts are prefilled into those slots'
                  cache rows, each distinct prompt once however many rounds its samples take
                  to start, beside the next waiting prompts (`kv_cache.write_row`)
      ──► decode  every busy slot advances one token per step at its own position, inside one jitted
                  loop, until enough slots have ended (EOS or budget)
      ──► harvest ended slots hand back their completions and are free again ──► insert ...

The cost follows the tokens generated, not the longest row: a slot whose sample ends early takes the
next one instead of idling to the end of the call. Once no more samples will come (`Session.close`)
and the queue is empty, the busy rows are compacted into the smallest of a few decode widths that
holds them (their cache rows copied), so the last long samples do not drag idle slots along (only
while a row may still decode enough tokens to repay the copy: short tails finish in place). Slot
utilisation is tokens generated / rows computed (each decode step counts the width it ran at).

Each sample's randomness comes from (key, prompt id, sample index) and the number of tokens it has
drawn, never from its slot or the width it runs in, so the same key gives the same samples whatever
the number of slots or the order of admission. Every host runs the same host loop on the same
(gathered) prompts, so all agree on the admission order.

With `kv_layout="paged"` the slots' keys and values live in a pool of fixed-size pages instead of a
row of P + C positions each: a sample holds pages as it grows, the samples of one prompt share its
prompt's pages, and slots are admitted while free pages last (docs/paged_cache.md).

This module holds what sessions share (the compiled programs, the decode widths, the page pool's
size); `session.Session` is the host side of one stream of samples (which slot holds which sample,
when each program runs, which pages it holds); the pool's arrays and its jitted programs are `slots`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dapo_jax import sharding
from dapo_jax.errors import ConfigError
from dapo_jax.model import paged_cache
from dapo_jax.model import transformer as model_lib
from dapo_jax.rollout import sampling
from dapo_jax.rollout import slots as slots_lib
from dapo_jax.rollout.session import Finished, Session, stack  # noqa: F401 (public here too)

KV_LAYOUTS = ("dense", "paged")
PAGED_READS = paged_cache.READS  # How decoding reads a paged cache: gathered, ragged in place, or a Pallas kernel.
CHUNK_PAGES = 128  # "ragged" (and "kernel"'s windowed layers): pages per step of its loop (docs/paged_cache.md).
ROUND_PAGES = 1  # A paged session's decode round draws at most this many pages' tokens (round_steps = 0).
RESERVE_ROUNDS = 2  # Paged admission keeps free the pages its running samples need for this many rounds.


def decode_widths(slots: int, shards: int = 1, thirds: bool = True) -> list[int]:
  """The decode batch sizes busy rows are compacted into once the queue is empty: whole rows per data
  shard, in powers of two and (`thirds`) three times powers of two (1, 2, 3, 4, 6, 8, 12, ... per
  shard), and `slots`. A width holds every busy count above the next smaller one, so at least 2/3
  of its rows decode a live sample (1/2 with powers of two alone), for a handful of compiled shapes."""
  per = slots // shards
  out, p = {per}, 1
  while p < per:
    out |= {p} | ({3 * p // 2} if thirds and p > 1 and 3 * p // 2 < per else set())
    p *= 2
  return sorted(w * shards for w in out)


class Engine:
  """A pool of `slots` decode rows for one model and sampler config; `session(params, key)` runs it."""

  def __init__(self, model_cfg: model_lib.ModelConfig, sampler_cfg: sampling.SamplerConfig, *, slots: int,
               prompt_len: int, prompt_buckets=(), mesh=None, round_fraction: float = 0.0, widths=None,
               min_compact_steps: int = 64, prefill_tokens: int = 2048, turn_tokens: int = 0, round_steps: int = 0,
               kv_cache_dtype: str = "", shared_prefix: int = 0, kv_layout: str = "dense", page_size: int = 16,
               kv_pages: int = 0, kv_memory_mb: float = 0.0, paged_attention: str = "gather",
               prefix_cache: bool = False):
    """`prompt_len` is the longest prompt (left-padded); prompts are prefilled at the smallest of
    `prompt_buckets` that holds them. While samples wait, a decode round returns to the host once
    `round_fraction` of the busy slots have ended (at least one: by default the first), so freed
    slots are refilled promptly; once none wait, it returns when the busy rows fit the next smaller of
    `widths` (default `decode_widths`; `(slots,)` never compacts) and moves them there, as long as a
    busy row may still decode `min_compact_steps` tokens (fewer do not repay the copy of the rows and
    the compile of one more width: short responses finish at the width they have).
    An insert prefills its distinct prompts in chunks of a power of two of them, at most
    `prefill_tokens` prompt tokens (at least one prompt): a prefill's keys and values for every
    layer exist at once beside the cache (64 SmolLM2 prompts of 192 tokens: 0.57 GB in fp32).
    `round_steps` > 0 (a server) returns to the host whenever a sample ends and at least every
    `round_steps` tokens, so new requests join and streams advance while others decode.
    `kv_cache_dtype` stores the cache's keys and values ("" = the model's compute dtype; bfloat16
    halves the bytes each decode step reads: tests/kv_cache_dtype_test.py bounds its log-prob shift).
    `shared_prefix` > 0: the prompts of one prefill that begin with the same `shared_prefix` tokens or
    more (few-shot examples, a system prompt) run that common start through the model once
    (`slots.prefill_shared`), rounded down to a multiple of `shared_prefix` so that few shapes compile;
    not for sliding-window models (a window counts cache indices, and the shared layout moves the
    padding between prefix and suffix).
    `kv_layout="paged"` keeps the cache in a pool of `kv_pages` pages of `page_size` positions per batch
    shard (0 = the dense layout's bytes: the shard's slots x (prompt_len + max_new_tokens) positions; or
    as many as `kv_memory_mb` MiB of keys and values hold),
    one of them the shard's null page (`paged_cache`); a sample holds pages of its slot's shard for the
    tokens it has, its prompt's whole pages shared with the other samples of its prefill there, and a
    decode round draws at most `round_steps` tokens (0 = `ROUND_PAGES` pages' worth), whose pages are
    allocated before it runs. Samples start while a shard's free pages hold their prompt and one round;
    where a shard's pool runs dry mid-decode its latest started samples are pre-empted and start over
    later (`slot_pages`). Decoding reads a slot's pages by `paged_attention`: "gather" (its dense view,
    the dense engine's numbers), "ragged" (in place, only the pages holding tokens, `CHUNK_PAGES` at a
    time: equal to rounding) or "kernel" (JAX's Pallas paged-attention kernel; one batch shard).
    `prefix_cache` keeps a session's whole prompt pages by the hash of their tokens: a prompt that begins
    with cached pages takes them, and its prefill computes only the rest (`pages`). An episode starts only
    where its whole budget's pages are free: it is never pre-empted."""
    if slots < 1:
      raise ValueError(f"rollout.slots={slots}: expected a positive number of decode slots")
    self.model_cfg, self.sampler_cfg, self.S, self.P = model_cfg, sampler_cfg, slots, prompt_len
    self.C = sampler_cfg.max_new_tokens
    self.prompt_buckets = sorted(set(b for b in prompt_buckets if b <= prompt_len) | {prompt_len})
    self.mesh = mesh if mesh is not None else sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1},
                                                                 jax.devices()[:1])
    shards = sharding.batch_shards(self.mesh.shape)
    if slots % shards:
      raise ValueError(f"rollout.slots={slots} does not split over the {shards} data shards of the mesh "
                       f"(data x fsdp x expert of {dict(self.mesh.shape)})")
    if prefill_tokens < 1:
      raise ValueError(f"rollout.prefill_tokens={prefill_tokens}: expected a positive number of prompt tokens")
    self.prefill_tokens = prefill_tokens
    if shared_prefix < 0:
      raise ValueError(f"rollout.shared_prefix={shared_prefix}: expected 0 (off) or a number of tokens")
    self.shared_prefix = 0 if model_cfg.local_layers or model_cfg.sliding_window else shared_prefix
    self.kv_cache_dtype = jnp.dtype(kv_cache_dtype or model_cfg.dtype)
    # Episodes: the sampler's max_new_tokens is the whole episode after the prompt (policy and
    # observation tokens); one policy turn draws at most turn_tokens of them (0 = no per-turn limit).
    self.turn_tokens = min(turn_tokens or self.C, self.C)
    self.round_fraction = round_fraction
    self.round_steps = round_steps
    self.min_compact_steps = min_compact_steps
    self.widths = sorted(set(widths or decode_widths(slots, shards)) | {slots})
    if any(w % shards or w > slots for w in self.widths):
      raise ValueError(f"decode widths {self.widths}: expected multiples of the {shards} data shards up to {slots}")
    self.row_sharding = sharding.named(self.mesh, "B")
    self.eos = tuple(sampler_cfg.eos_ids)
    if kv_layout not in KV_LAYOUTS:
      raise ValueError(f"rollout.kv_layout={kv_layout!r}: expected 'dense' or 'paged'")
    self.paged = kv_layout == "paged"
    self.shards = shards
    if self.paged:
      if page_size < 1:
        raise ValueError(f"rollout.page_size={page_size}: expected a positive number of tokens per page")
      self.page_size = page_size
      self.pages_per_sample = paged_cache.pages_per_row(self.P + self.C, page_size)
      if kv_pages and kv_memory_mb:
        raise ValueError(f"rollout.kv_memory_mb={kv_memory_mb} with rollout.kv_pages={kv_pages}: set one of them")
      if kv_memory_mb:
        kv_pages = int(kv_memory_mb * 2**20 // self.page_bytes(model_cfg, page_size, self.kv_cache_dtype))
      # Pages of each shard's pool: a device's memory.
      self.kv_pages = kv_pages or max(slots // shards * (self.P + self.C) // page_size, self.pages_per_sample + 1)
      if self.kv_pages <= self.pages_per_sample:
        field = (f"rollout.kv_memory_mb={kv_memory_mb} holds {self.kv_pages} pages" if kv_memory_mb else
                 f"rollout.kv_pages={self.kv_pages}")
        raise ConfigError(f"{field}: expected more than the {self.pages_per_sample} pages of one sample of "
                          f"{self.P} + {self.C} tokens (and the null page)")
      self.round_tokens = round_steps or ROUND_PAGES * page_size
      self.reserve_rounds = RESERVE_ROUNDS
      if paged_attention not in PAGED_READS:
        raise ValueError(f"rollout.paged_attention={paged_attention!r}: expected one of {PAGED_READS}")
      if paged_attention == "kernel" and shards > 1:  # A kernel is opaque to XLA's partitioner.
        raise ConfigError(f"rollout.paged_attention='kernel' reads one batch shard's pool; the rollout mesh has "
                          f"{shards}: use 'ragged' (or a rollout mesh of one batch shard)")
      self.paged_read = paged_attention
    if prefix_cache and (not self.paged or model_cfg.local_layers or model_cfg.sliding_window):
      raise ConfigError("rollout.prefix_cache=True needs rollout.kv_layout='paged' and a model without a sliding "
                        "window (the cache is whole prompt pages)")
    self.prefix_cache = prefix_cache

  @staticmethod
  def page_bytes(model_cfg: model_lib.ModelConfig, page_size: int, dtype) -> int:
    """The bytes of one page of the pool: its keys and values in every layer."""
    c = model_cfg
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * page_size * jnp.dtype(dtype).itemsize

  def width_for(self, rows: int) -> int:
    """The smallest decode width that holds `rows` busy rows."""
    return next((w for w in self.widths if w >= rows), self.S)

  def empty_state(self) -> slots_lib.SlotState:
    """Every slot free: the pool's arrays, on the mesh (rows over the data shards)."""
    state = slots_lib.empty(self.model_cfg, self.sampler_cfg, self.S, self.P + self.C, self.kv_cache_dtype,
                            *((self.page_size, self.kv_pages, self.shards, self.paged_read, CHUNK_PAGES)
                              if self.paged else ()))
    if not self.paged:
      return jax.device_put(state, self.row_sharding)
    pool = sharding.named(self.mesh, (None, "batch", None, None))  # [K, N, page, H]: split on pages, as rows are.
    k, v = jax.device_put((state.cache.k, state.cache.v), pool)
    state = jax.device_put(state.replace(cache=state.cache.replace(k=[], v=[])), self.row_sharding)
    return state.replace(cache=state.cache.replace(k=k, v=v))

  # --- the host loop -------------------------------------------------------------------------

  def session(self, params, key, episodes=None) -> "Session":
    return Session(self, params, key, episodes)

  def generate(self, params, prompt_QP: np.ndarray, prompt_mask_QP: np.ndarray, G, key,
               stop_at_B: np.ndarray | None = None, on_samples=None, first_prompt_id: int = 0, episodes=None,
               images_QMD=None) -> tuple[sampling.Samples, dict]:
    """G samples of each prompt as host arrays, prompt-major (rows qG..qG+G-1 for prompt q: the
    layout of `sampling.generate`), and the session's statistics. G may differ per prompt (a list);
    `on_samples(n)` hears of every n samples that end (progress). Prompt q is prompt number
    first_prompt_id + q of `key`'s samples (`slots_lib.sample_key_data`). With `episodes` (a driver whose
    examples are registered under those prompt numbers) every sample is an episode; the stats then
    hold each row's reward (`episode_rewards`). `images_QMD`: each prompt's image vectors (a
    vision-language model; `Session.add`)."""
    counts = [G] * len(prompt_QP) if np.isscalar(G) else list(G)
    s = self.session(params, key, episodes)
    first = np.cumsum([0] + counts)
    for q, n in enumerate(counts):
      s.add([first_prompt_id + q], prompt_QP[q:q + 1], prompt_mask_QP[q:q + 1], n,
            None if stop_at_B is None else stop_at_B[first[q]:first[q + 1]],
            images_QMD=None if images_QMD is None else images_QMD[q:q + 1])
    s.close()
    out = {}
    while s.busy:
      ended = s.step()
      for f in ended:
        out[(f.prompt_id, f.sample)] = f
      if on_samples and ended:
        on_samples(len(ended))
    rows = [out[(first_prompt_id + q, g)] for q, n in enumerate(counts) for g in range(n)]
    stats = s.stats()
    if episodes is not None:  # Each episode's reward, in row order.
      stats["episode_rewards"] = [r.reward for r in rows]
      stats["turns"] = [r.turns for r in rows]
    return stack(rows, self.C), stats
