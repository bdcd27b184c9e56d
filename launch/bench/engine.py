"""`bench engine`: the continuous engine with a dense and a paged KV cache, side by side at one cache
byte budget, on a long-tailed workload (`e2e.LengthHook`): samples in flight, tokens/s, rollout time
and the pages used. The dense engine's `--slots` rows of prompt + completion positions set the
budget; the paged engine holds as many bytes of pages (or `--kv_pages`) and `--paged_slots` rows,
admitted while free pages last and pre-empted when they run out, and reads them by each of
`rollout.paged_attention`'s ways: "gather" (`paged`) and "ragged" (`paged_ragged`)."""
from absl import flags

from . import e2e, shared

_PAGED_SLOTS = flags.DEFINE_integer("paged_slots", 0, "engine: decode slots of the paged engine (0 = 4x --slots); "
                                    "its page pool holds the bytes of the dense engine's --slots rows.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "engine: tokens per page of the paged KV cache.")
_KV_PAGES = flags.DEFINE_integer("kv_pages", 0, "engine: pages of the paged engine's pool (0 = the bytes of the "
                                 "dense engine's --slots rows); fewer pre-empt samples when it runs dry.")
_LAYOUTS = flags.DEFINE_list("layouts", ["dense", "paged", "paged_ragged"], "engine: the engines to run, of dense, "
                             "paged (gathered reads) and paged_ragged (pages read in place).")


def bench(cfg, peak):
  """--num_prompts x --group samples of up to --new_tokens tokens after prompts of --prompt_len/4 to
  --prompt_len tokens, their lengths log-normal with mean --mean_length (default --new_tokens / 8)."""
  import time

  import jax
  import numpy as np

  from dapo_jax.rollout import engine, sampling
  mc, params = shared.load_model(cfg)
  Q, G, P, C = shared.NUM_PROMPTS.value, shared.GROUP.value, shared.PROMPT_LEN.value, shared.NEW_TOKENS.value
  S, p = shared.SLOTS.value or 16, _PAGE_SIZE.value
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, mc.vocab_size, size=(Q, P)).astype(np.int32)
  mask = np.arange(P)[None, :] >= P - rng.integers(max(P // 4, 1), P + 1, size=Q)[:, None]
  stop_at_B = e2e.LengthHook(e2e.MEAN_LENGTH.value or max(C // 8, 1), C)(Q * G)
  # No EOS: each sample ends at its drawn length (forced), so both layouts decode the very same tokens.
  sc = sampling.SamplerConfig(max_new_tokens=C, temperature=1.0, top_p=1.0, eos_ids=())
  paged = dict(slots=_PAGED_SLOTS.value or 4 * S, kv_layout="paged", page_size=p,
               kv_pages=_KV_PAGES.value or S * (P + C) // p)
  layouts = {"dense": dict(slots=S), "paged": paged, "paged_ragged": dict(paged, paged_attention="ragged")}
  out = {"bench": "engine", "samples": Q * G, "prompt_len": P, "new_tokens": C,
         "mean_length": float(stop_at_B.mean()), "max_length": int(stop_at_B.max()),
         "cache_bytes": S * (P + C) * 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * np.dtype(mc.dtype).itemsize}
  layouts = {name: layouts[name] for name in _LAYOUTS.value}
  for name, kw in layouts.items():
    e = engine.Engine(mc, sc, prompt_len=P, **kw)
    e.generate(params, tokens, mask, G, jax.random.key(0), stop_at_B)  # Warm-up: compiles every shape.
    times = []
    for r in range(shared.RUNS.value):
      t0 = time.perf_counter()
      samples, stats = e.generate(params, tokens, mask, G, jax.random.key(r + 1), stop_at_B)
      times.append(time.perf_counter() - t0)
    t = float(np.median(times))
    out[name] = {"slots": e.S, "rollout_s": t, "runs_s": times, "tokens_per_s": stats["generated_tokens"] / t,
                 # Tokens per decode step: the samples decoding together, on average.
                 "samples_in_flight": stats["generated_tokens"] / stats["decode_steps"],
                 "decode_steps": stats["decode_steps"], "rounds": stats["rounds"],
                 "slot_utilisation": stats["slot_utilisation"],
                 **{k: stats[k] for k in ("kv_pages", "kv_pages_peak", "prompt_pages", "prompt_pages_shared",
                                          "preempted", "recomputed_tokens") if k in stats}}
  for name in set(layouts) - {"dense"} if "dense" in layouts else ():
    out[f"{name}_speedup"] = out["dense"]["rollout_s"] / out[name]["rollout_s"]
  return out
