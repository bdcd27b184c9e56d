"""The paged KV cache (`rollout.kv_layout="paged"`): its gathered read against the dense cache, the
paged engine against the dense one bit for bit (on one device and split over batch shards), prompt
pages shared by a group and returned at its end, admission by free pages, pre-emption when the pool
runs dry, and the settings that refuse what it does not run yet."""
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import common
from dapo_jax import builders, sharding, testing
from dapo_jax.model import layers
from dapo_jax.model import paged_cache as paged
from dapo_jax.rollout import engine, sampling
from dapo_jax.rollout import slots as slots_lib

CFG = testing.tiny_model_config(vocab_size=64)
PARAMS = testing.sharp_params(CFG, seed=2)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
P = 21  # Not a multiple of most page sizes: a prompt's last page is also its samples' first.


def prompts(lengths=(21, 3, 9, 16, 17), prefix=0, seed=0):
  """Left-padded prompts of these lengths; with `prefix`, those that long begin with the same tokens."""
  rng = np.random.default_rng(seed)
  start = rng.integers(4, 64, size=prefix)
  tokens = np.zeros((len(lengths), P), np.int32)
  for q, n in enumerate(lengths):
    tokens[q, P - n:] = rng.integers(4, 64, size=n)
    if n >= prefix:
      tokens[q, P - n:P - n + prefix] = start
  return tokens, np.arange(P)[None, :] >= P - np.array(lengths)[:, None]


def dense_rows(pool_KNpH, table_BM, mask_BT):
  """By hand: each row's dense view, marked position t holding its token number (marked positions before t)."""
  B, T = mask_BT.shape
  p = pool_KNpH.shape[2]
  out = np.zeros((B, pool_KNpH.shape[0], T, pool_KNpH.shape[3]), pool_KNpH.dtype)
  for b in range(B):
    c = 0
    for t in range(T):
      if mask_BT[b, t]:
        out[b, :, t] = pool_KNpH[:, table_BM[b, c // p], c % p]
        c += 1
  return out


def test_paged_read_and_write_are_the_dense_caches():
  """Rows whose pages lie anywhere in the pool (shared, or the null page) read as the dense rows they
  stand for (a marked position holds the row's token of its number, whatever the padding before or
  holes between), and the attention over them is the dense cache's; a write lands at its row's token
  number, and a row not live writes nothing."""
  B, K, H, p, M, N = 3, 2, 4, 4, 5, 20
  T = M * p + 3  # Dense rows longer than their tokens: a left-padded prompt.
  rng = np.random.default_rng(0)
  k_KNpH, v_KNpH = rng.normal(size=(2, K, N, p, H)).astype(np.float32)
  k_KNpH[:, paged.NULL_PAGE], v_KNpH[:, paged.NULL_PAGE] = 0, 0
  table_BM = np.stack([rng.permutation(np.arange(1, N))[:M] for _ in range(B)]).astype(np.int32)
  table_BM[2, 2] = table_BM[0, 2]    # A page two rows share.
  mask_BT = np.zeros((B, T), bool)
  mask_BT[0, 3:] = True              # Left padding.
  mask_BT[1, 7:12] = True            # A prompt's prefix, a hole, its suffix and completion.
  mask_BT[1, 15:T - 2] = True
  mask_BT[2, 1:T - 4] = True
  k_BKHT, v_BKTH = paged.read(jnp.asarray(k_KNpH), jnp.asarray(v_KNpH), jnp.asarray(table_BM), jnp.asarray(mask_BT))
  want_k, want_v = dense_rows(k_KNpH, table_BM, mask_BT), dense_rows(v_KNpH, table_BM, mask_BT)
  np.testing.assert_array_equal(np.where(mask_BT[:, None, :, None], k_BKHT.swapaxes(2, 3), 0), want_k)
  np.testing.assert_array_equal(np.where(mask_BT[:, None, :, None], v_BKTH, 0), want_v)
  q_BKR1H = jnp.asarray(rng.normal(size=(B, K, 2, 1, H)).astype(np.float32))
  mask_B1T = jnp.asarray(mask_BT)[:, None]
  np.testing.assert_array_equal(layers.attention(q_BKR1H, k_BKHT, v_BKTH, mask_B1T, k_layout="BKHS"),
                                layers.attention(q_BKR1H, jnp.asarray(want_k).swapaxes(2, 3), jnp.asarray(want_v),
                                                 mask_B1T, k_layout="BKHS"))
  new_k, new_v = rng.normal(size=(2, B, K, H)).astype(np.float32)
  token_B, live_B = np.array([6, 13, 2]), np.array([True, True, False])
  k2, v2 = paged.update(jnp.asarray(k_KNpH), jnp.asarray(v_KNpH), jnp.asarray(table_BM), new_k, new_v,
                        jnp.asarray(token_B), jnp.asarray(live_B))
  for b in range(2):
    page, offset = table_BM[b, token_B[b] // p], token_B[b] % p
    np.testing.assert_array_equal(np.asarray(k2)[:, page, offset], new_k[b])
    np.testing.assert_array_equal(np.asarray(v2)[:, page, offset], new_v[b])
  changed = (np.asarray(k2) != k_KNpH).any(axis=(0, 2, 3))
  assert sorted(np.flatnonzero(changed)) == sorted([table_BM[0, 6 // p], table_BM[1, 13 // p]])


@pytest.mark.parametrize("G,chunk_pages,softcap", [(1, 1, 0.0), (1, 3, 5.0), (2, 2, 0.0), (2, 64, 5.0)])
def test_the_ragged_read_attends_as_the_gathered_rows_do(G, chunk_pages, softcap):
  """`paged.attend` (each row's pages that hold a marked token, a chunk of them at a time, an online
  softmax) against `layers.attention` over `read`'s dense rows: rows of one page, of many, a sliding
  window's mask (its first token past a page's start), across G shards of the pool; a row not live reads nothing (zeros)
  whatever its table names."""
  rng = np.random.default_rng(3)
  B, K, R, H, p, N, T = 6, 2, 3, 8, 4, 40, 37
  M = paged.pages_per_row(T, p)
  k_KNpH, v_KNpH = jnp.asarray(rng.normal(size=(2, K, N, p, H)).astype(np.float32))
  table_BM = jnp.asarray(rng.integers(1, N // G, size=(B, M)).astype(np.int32))  # Ids within each shard's pool.
  mask_BT = np.zeros((B, T), bool)
  for b, (lo, hi) in enumerate([(3, 20), (10, 11), (0, 37), (5, 9), (13, 30), (2, 36)]):
    mask_BT[b, lo:hi] = True
  last_B1 = np.max(np.where(mask_BT, np.arange(T), 0), axis=1, keepdims=True)
  attend_BT = mask_BT & (np.arange(T)[None, :] > last_B1 - 7)  # A sliding window's: each row's last 7 positions.
  live_B = np.array([True, True, True, False, True, True])
  q_BKRH = jnp.asarray(rng.normal(size=(B, K, R, H)).astype(np.float32))
  k_BKHT, v_BKTH = paged.read(k_KNpH, v_KNpH, table_BM, jnp.asarray(mask_BT), G)
  want = layers.attention(q_BKRH[:, :, :, None], k_BKHT, v_BKTH, jnp.asarray(attend_BT)[:, None], k_layout="BKHS",
                          softcap=softcap)[:, :, :, 0]
  tokens_BC = paged.token_mask(jnp.asarray(mask_BT), M * p, jnp.asarray(attend_BT))
  got = paged.attend(q_BKRH, k_KNpH, v_KNpH, table_BM, tokens_BC, jnp.asarray(live_B), chunk_pages, G,
                     softcap=softcap)
  np.testing.assert_allclose(got[live_B], want[live_B], rtol=0, atol=1e-6)
  np.testing.assert_array_equal(got[~live_B], 0.0)


@pytest.mark.parametrize("G,softcap", [(1, 0.0), (2, 5.0)])
def test_the_pallas_kernel_attends_as_the_gathered_rows_do(G, softcap):
  """JAX's Pallas paged-attention kernel (here the GPU one, interpreted on the CPU) on the pool as it
  is: each row's tokens [0, length), pages anywhere in its shard's pool, against `layers.attention`
  over `read`'s dense rows (left-padded, so the dense view and the pages number the tokens apart)."""
  rng = np.random.default_rng(4)
  B, K, R, H, p, N, T = 4, 2, 2, 8, 4, 24, 30
  M = paged.pages_per_row(T, p)
  k_KNpH, v_KNpH = jnp.asarray(rng.normal(size=(2, K, N, p, H)).astype(np.float32))
  table_BM = jnp.asarray(rng.integers(1, N // G, size=(B, M)).astype(np.int32))
  length_B = np.array([1, 7, 22, 16])
  mask_BT = np.arange(T)[None, :] >= T - length_B[:, None]
  q_BKRH = jnp.asarray(rng.normal(size=(B, K, R, H)).astype(np.float32))
  k_BKHT, v_BKTH = paged.read(k_KNpH, v_KNpH, table_BM, jnp.asarray(mask_BT), G)
  want = layers.attention(q_BKRH[:, :, :, None], k_BKHT, v_BKTH, jnp.asarray(mask_BT)[:, None], k_layout="BKHS",
                          softcap=softcap)[:, :, :, 0]
  got = paged.kernel_attend(q_BKRH, k_KNpH, v_KNpH, table_BM, jnp.asarray(length_B, jnp.int32), G, softcap=softcap)
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


def generate(tokens, mask, G, stop_at_B, slots=4, C=40, key=0, **kw):
  sc = sampling.SamplerConfig(max_new_tokens=C, temperature=1.0, eos_ids=(5, 9))
  return engine.Engine(CFG, sc, slots=slots, prompt_len=P, **kw).generate(PARAMS, tokens, mask, G,
                                                                          jax.random.key(key), stop_at_B)


@pytest.mark.parametrize("page_size,shared_prefix,compact,read", [
    (4, 0, 64, "gather"), (7, 0, 64, "gather"), (4, 8, 64, "gather"), (4, 0, 1, "gather"),
    (4, 0, 64, "ragged"), (7, 8, 1, "ragged"), (4, 8, 64, "kernel")],
    ids=["partial_last_page", "whole_pages", "shared_prefix", "compacting", "ragged", "ragged_shared_compacting",
         "kernel_shared_prefix"])
def test_the_paged_engine_draws_the_dense_engines_samples_bit_for_bit(page_size, shared_prefix, compact, read,
                                                                      monkeypatch):
  """Prompts of 3 to 21 tokens, 3 samples each through 4 slots (refilled as samples end), ending at
  different steps (EOS drawn or forced, or the budget), crossing pages: the paged engine's tokens and
  fp32 log-probs are the dense engine's, and every page is free again at the end. With a shared
  prefix the prompts' common start is prefilled once, laid out [prefix | left-padded suffix];
  compacting, the tail's samples move into smaller widths with their pages.
  Bit for bit where both engines decode each token at the same width. Compacting, a paged round runs
  its page's tokens before the rows move (the dense one moves them as soon as they fit), and each width
  is its own program: the log-probs agree to rounding. So do the ragged read's, whose softmax is summed
  page by page."""
  tokens, mask = prompts((21, 9, 10, 16, 17) if shared_prefix else (21, 3, 9, 16, 17), prefix=shared_prefix)
  shared_prefills = []
  prefill_shared = slots_lib.prefill_shared
  monkeypatch.setattr(slots_lib, "prefill_shared", lambda *a: shared_prefills.append(1) or prefill_shared(*a))
  G = 3
  stop_at_B = np.random.default_rng(1).integers(2, 40, size=len(tokens) * G)
  stop_at_B[[3, 7, 10]] = 41  # Never forced: these run to the budget unless they draw EOS.
  dense, dense_stats = generate(tokens, mask, G, stop_at_B, shared_prefix=shared_prefix, min_compact_steps=compact)
  out, stats = generate(tokens, mask, G, stop_at_B, shared_prefix=shared_prefix, kv_layout="paged",
                        page_size=page_size, min_compact_steps=compact, paged_attention=read)
  assert dense.length_B.min() < 5 and dense.length_B.max() == 40 and dense.truncated_B.any()
  np.testing.assert_array_equal(out.tokens_BC, dense.tokens_BC)
  if read == "gather" and compact > 1:
    np.testing.assert_array_equal(out.logp_BC, dense.logp_BC)
  else:
    np.testing.assert_allclose(out.logp_BC, dense.logp_BC, rtol=0, atol=2e-6)
  np.testing.assert_array_equal(out.length_B, dense.length_B)
  assert stats["samples"] == dense_stats["samples"] == 15 and stats["kv_pages_used"] == 0
  assert stats["prompt_pages_shared"] > 0 and bool(shared_prefills) == bool(shared_prefix)
  assert stats["resizes"] == dense_stats["resizes"] and (stats["resizes"] > 0) == (compact == 1)


def test_a_sliding_window_model_reads_its_pages_as_the_dense_engine_does():
  """A Gemma 3-shaped model (a local layer of a 5-token window beside a global one, soft-capped logits)
  with shared prompt prefixes: every read draws the dense engine's tokens (the kernel's windowed layer
  reads ragged) and its log-probs to rounding (XLA:CPU sums this family's gathered rows in another
  order than the dense rows: 1e-6 apart)."""
  cfg = testing.tiny_model_config(vocab_size=64, arch="gemma3", qk_norm=True, qkv_bias=False, local_layers=(0,),
                                  sliding_window=5, final_softcap=30.0)
  params = testing.sharp_params(cfg, seed=5)
  tokens, mask = prompts(prefix=8)
  sc = sampling.SamplerConfig(max_new_tokens=24, temperature=1.0, eos_ids=(5, 9))
  run = lambda **kw: engine.Engine(cfg, sc, slots=4, prompt_len=P, shared_prefix=8, **kw).generate(
      params, tokens, mask, 2, jax.random.key(3))[0]
  dense = run()
  for read in engine.PAGED_READS:
    out = run(kv_layout="paged", page_size=4, paged_attention=read)
    np.testing.assert_array_equal(out.tokens_BC, dense.tokens_BC)
    np.testing.assert_allclose(out.logp_BC, dense.logp_BC, rtol=0, atol=2e-6)


@pytest.mark.parametrize("read", ["gather", "ragged"])
def test_the_paged_engine_splits_its_slots_and_pool_over_batch_shards(read):
  """On a (data=1, fsdp=4) rollout mesh each shard's 2 slots take pages of its own pool only (page ids
  within it): the dense engine's tokens and fp32 log-probs on the same mesh bit for bit, every shard's
  pages used and all free again at the end; a compiled round reads and writes its own device's pages
  (no collective moves the pool). The ragged read lists each shard's pages on its own device: the same
  tokens, the log-probs to rounding, and no page moves either."""
  mesh = sharding.make_mesh({"data": 1, "fsdp": 4, "tensor": 1}, jax.devices()[:4])
  tokens, mask = prompts()
  G = 3
  stop_at_B = np.random.default_rng(1).integers(2, 40, size=len(tokens) * G)
  dense, _ = generate(tokens, mask, G, stop_at_B, slots=8, mesh=mesh)
  out, stats = generate(tokens, mask, G, stop_at_B, slots=8, mesh=mesh, kv_layout="paged", page_size=4,
                        paged_attention=read)
  np.testing.assert_array_equal(out.tokens_BC, dense.tokens_BC)
  if read == "gather":
    np.testing.assert_array_equal(out.logp_BC, dense.logp_BC)
  else:
    np.testing.assert_allclose(out.logp_BC, dense.logp_BC, rtol=0, atol=2e-6)
  M = -(-(P + 40) // 4)
  assert stats["kv_shards"] == 4 and stats["kv_pages"] == 2 * (P + 40) // 4 and stats["kv_pages_used"] == 0
  assert all(0 < peak <= 2 * M for peak in stats["kv_pages_peak_shards"]), stats
  # The compiled round's collectives carry a few numbers per slot (flags, scatter indices), never a page.
  sc = sampling.SamplerConfig(max_new_tokens=40, temperature=1.0, eos_ids=(5, 9))
  session = engine.Engine(CFG, sc, slots=8, prompt_len=P, mesh=mesh, kv_layout="paged", page_size=4,
                          paged_attention=read).session(PARAMS, jax.random.key(0))
  hlo = slots_lib.decode_round.lower(CFG, sc, session.dparams, session.state, jnp.int32(1), jnp.int32(4)).compile()
  moved = [math.prod(int(d) for d in dims.split(",") if d) for line in hlo.as_text().splitlines()
           for found in [re.search(r"= (.*?) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)",
                                   line)] if found
           for dims in re.findall(r"\[([0-9,]*)\]", found.group(1))]
  assert moved and max(moved) <= 2 * 8, moved


def test_a_group_holds_one_copy_of_its_prompts_pages():
  """All 15 samples start at once (and a group of 16 after): each prompt's whole pages (its first n // 4 pages of 4 tokens) are
  written once and taken by its 2 other samples; each sample's own pages follow its length."""
  tokens, mask = prompts()
  G, C, p = 3, 40, 4
  stop_at_B = np.random.default_rng(1).integers(2, C + 2, size=len(tokens) * G)
  out, stats = generate(tokens, mask, G, stop_at_B, slots=16, kv_layout="paged", page_size=p)
  n_Q = mask.sum(1)  # (21, 3, 9, 16, 17) tokens
  whole = n_Q // p   # Its pages below the samples' first own page.
  assert stats["prompt_pages"] == sum(whole) == 5 + 0 + 2 + 4 + 4
  assert stats["prompt_pages_shared"] == (G - 1) * sum(whole)
  assert stats["kv_pages_used"] == 0
  # Each sample's own pages: at the start those of its first round, and at most those of its budget.
  n_B = np.repeat(n_Q, G)
  own_pages = lambda drawn_B: ((n_B + np.minimum(drawn_B, C) - 1) // p - n_B // p + 1).sum()
  first_round = np.minimum(stop_at_B, engine.ROUND_PAGES * p)
  assert sum(whole) + own_pages(first_round) <= stats["kv_pages_peak"] <= sum(whole) + own_pages(stop_at_B)
  # A group of 16 (the recipe's G) of one 21-token prompt: its 5 whole pages written once, taken 15 more times.
  _, stats = generate(tokens[:1], mask[:1], 16, None, slots=16, kv_layout="paged", page_size=p)
  assert (stats["prompt_pages"], stats["prompt_pages_shared"]) == (5, 15 * 5), stats


def test_admission_waits_for_free_pages():
  """8 slots but pages for about two samples: samples start as pages free up (the same tokens as the
  dense engine's)."""
  tokens, mask = prompts()
  G, C, p = 2, 40, 4
  stop_at_B = np.random.default_rng(3).integers(2, 16, size=len(tokens) * G)  # Short: fits, one after another.
  dense, _ = generate(tokens, mask, G, stop_at_B, slots=8)
  M = -(-(P + C) // p)
  out, stats = generate(tokens, mask, G, stop_at_B, slots=8, kv_layout="paged", page_size=p, kv_pages=2 * M + 1)
  np.testing.assert_array_equal(out.tokens_BC, dense.tokens_BC)
  np.testing.assert_allclose(out.logp_BC, dense.logp_BC, atol=1e-6)
  assert stats["kv_pages_peak"] <= 2 * M and stats["kv_pages_used"] == 0


def test_a_dry_pool_pre_empts_the_latest_samples_which_start_over_and_draw_the_same_tokens():
  """8 slots want to run samples to their 40-token budget, the pool holds about two whole samples: as
  they grow, the latest started are pre-empted (pages freed, queued again) and recomputed from their
  prompt later: the dense engine's tokens, and its log-probs within XLA:CPU's last bit (a recomputed
  sample's prompt is prefilled again beside other prompts, in a batch of another shape, as samples
  admitted late are in `test_admission_waits_for_free_pages`); every page free at the end."""
  tokens, mask = prompts()
  G, C, p = 2, 40, 4
  stop_at_B = np.random.default_rng(3).integers(20, C + 2, size=len(tokens) * G)  # Long: most outgrow a round.
  dense, _ = generate(tokens, mask, G, stop_at_B, slots=8)
  M = -(-(P + C) // p)
  out, stats = generate(tokens, mask, G, stop_at_B, slots=8, kv_layout="paged", page_size=p, kv_pages=2 * M + 1)
  np.testing.assert_array_equal(out.tokens_BC, dense.tokens_BC)
  np.testing.assert_allclose(out.logp_BC, dense.logp_BC, atol=1e-6)
  np.testing.assert_array_equal(out.length_B, dense.length_B)
  assert stats["preempted"] > 0 and stats["recomputed_tokens"] > 0, stats
  assert stats["kv_pages_peak"] <= 2 * M and stats["kv_pages_used"] == 0


def base():
  c = common.base()
  common.runlocal(c)
  c.rollout.kv_layout = "paged"
  return c


def test_settings_pass_the_layout_through_and_refuse_what_it_does_not_run():
  c = base()
  builders.validate(c, num_devices=1)
  rc = builders.rollout_config(c)
  assert (rc.kv_layout, rc.page_size, rc.kv_pages) == ("paged", 16, 0)
  for field, value, message in [
      ("rollout.kv_layout", "blocked", "rollout.kv_layout='blocked': expected 'dense' or 'paged'"),
      ("rollout.page_size", 0, "rollout.page_size=0: expected >= 1 (tokens per page)"),
      ("rollout.kv_pages", 3, "rollout.kv_pages=3: expected 0 (the dense layout's bytes) or >= 4"),
      ("rollout.kv_memory_mb", -1.0, "rollout.kv_memory_mb=-1.0: expected >= 0"),
      ("rollout.paged_attention", "pallas", "rollout.paged_attention='pallas': expected 'gather', "
       "'ragged' or 'kernel'"),
      ("rollout.engine", "static", "rollout.kv_layout='paged': expected 'dense' with rollout.engine='static'")]:
    c = base()
    group, key = field.split(".")
    c[group][key] = value
    with pytest.raises(builders.ConfigError) as e:
      builders.validate(c, num_devices=1)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
  c = base()
  c.rollout.kv_pages, c.rollout.kv_memory_mb = 100, 1.0
  with pytest.raises(builders.ConfigError, match=r"^rollout.kv_memory_mb=1.0: expected 0 with rollout.kv_pages set"):
    builders.validate(c, num_devices=1)
  builders.validate(base(), num_devices=8)  # The pool splits over the batch shards.
  c = base()
  c.rollout.env, c.rollout.prefix_cache = "dapo_jax.envs.games:GuessNumber", True  # Episodes run on pages.
  builders.validate(c, num_devices=1)
  c.rollout.kv_layout = "dense"
  with pytest.raises(builders.ConfigError, match=r"^rollout.prefix_cache=True: expected False with "
                                                 r"rollout.kv_layout='dense'"):
    builders.validate(c, num_devices=1)


def test_a_memory_budget_sizes_the_pool():
  """`kv_memory_mb` MiB of keys and values: 2 (keys, values) x layers x KV heads x head dim x page x 4
  bytes (fp32) a page, by hand; a budget below one sample's pages is refused naming it."""
  sc = sampling.SamplerConfig(max_new_tokens=40)
  page_bytes = 2 * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim * 4 * 4
  e = engine.Engine(CFG, sc, slots=4, prompt_len=P, kv_layout="paged", page_size=4, kv_memory_mb=0.25)
  assert e.kv_pages == 2**18 // page_bytes
  half = engine.Engine(CFG, sc, slots=4, prompt_len=P, kv_layout="paged", page_size=4, kv_memory_mb=0.25,
                       kv_cache_dtype="bfloat16")
  assert half.kv_pages == 2 * e.kv_pages
  tiny = 10 * page_bytes / 2**20
  with pytest.raises(builders.ConfigError, match=rf"^rollout.kv_memory_mb={tiny} holds 10 pages: expected more "
                                                 r"than the 16 pages of one sample of 21 \+ 40 tokens"):
    engine.Engine(CFG, sc, slots=4, prompt_len=P, kv_layout="paged", page_size=4, kv_memory_mb=tiny)


def test_train_resolves_a_paged_config_and_refuses_an_unsupported_one_in_one_line():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, XLA_FLAGS=testing.FAST_COMPILE_XLA_FLAGS)  # 1 device.
  train = lambda *args: subprocess.run([sys.executable, "-m", "launch.train", "--config=configs/default.py:runlocal",
                                        "--config.rollout.kv_layout=paged", "--dry_run", *args], cwd=ROOT, env=env,
                                       capture_output=True, text=True, timeout=300)
  shown = train()
  assert shown.returncode == 0 and "  kv_layout: paged\n" in shown.stdout, shown.stderr[-2000:]
  refused = train("--config.rollout.engine=static")
  assert refused.returncode == 1 and refused.stderr == ("error: rollout.kv_layout='paged': expected 'dense' with "
                                                        "rollout.engine='static' (pages are the continuous engine's)\n")


def test_a_prefix_cache_prefills_a_shared_prompt_start_once():
  """Requests that begin with the same 12 tokens (3 pages of 4), added one after another to one session
  as a server adds them: the first prefills its whole prompt and the cache keeps its whole pages; each
  later one takes those 3 pages and prefills only its rest (counted); the answers are the dense engine's
  (tokens, and log-probs to rounding: the rest attends to the cached keys and values)."""
  rng = np.random.default_rng(7)
  system = rng.integers(4, 64, size=12)
  prompts_ = [np.concatenate([system, rng.integers(4, 64, size=n)]) for n in (5, 1, 9, 3, 6)]
  sc = sampling.SamplerConfig(max_new_tokens=12, temperature=1.0, eos_ids=(5, 9))

  def serve(**kw):
    session = engine.Engine(CFG, sc, slots=4, prompt_len=P, **kw).session(PARAMS, jax.random.key(1))
    out = {}
    for q, tokens in enumerate(prompts_):
      session.add([q], tokens[None], np.ones((1, len(tokens)), bool), 2)
      while session.busy:
        for f in session.step():
          out[(f.prompt_id, f.sample)] = f
    return out, session.stats()

  dense, _ = serve()
  cached, stats = serve(kv_layout="paged", page_size=4, prefix_cache=True)
  for key, f in dense.items():
    np.testing.assert_array_equal(cached[key].tokens_C[:f.length], f.tokens_C[:f.length])
    np.testing.assert_allclose(cached[key].logp_C[:f.length], f.logp_C[:f.length], rtol=0, atol=1e-5)
  lengths = [len(t) for t in prompts_]
  assert stats["prefilled_tokens"] == lengths[0] + sum(n - 12 for n in lengths[1:])
  assert stats["prefix_cache_hits"] == 3 * (len(prompts_) - 1)
  assert stats["prompt_pages"] == sum(n // 4 for n in lengths) - 3 * (len(prompts_) - 1)
  assert stats["kv_pages_used"] == 0  # What the cache alone holds is available.
  # A pool of about one sample's pages: cached pages are let go (least recently used first) for room.
  small, stats = serve(kv_layout="paged", page_size=4, prefix_cache=True, kv_pages=10)
  assert stats["prefix_cache_evicted"] > 0 and stats["prefix_cache_hits"] > 0, stats
  for key, f in dense.items():
    np.testing.assert_array_equal(small[key].tokens_C[:f.length], f.tokens_C[:f.length])
  with pytest.raises(builders.ConfigError, match=r"^rollout.prefix_cache=True needs rollout.kv_layout='paged'"):
    engine.Engine(CFG, sc, slots=4, prompt_len=P, prefix_cache=True)
