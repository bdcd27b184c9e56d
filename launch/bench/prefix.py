"""`bench prefix`: the policy server on a paged KV cache with and without its prefix cache, under
clients whose prompts begin with one long system prompt (`rollout.prefix_cache`)."""
import json
import statistics
import time

from absl import flags

from . import shared

_SYSTEM_LEN = flags.DEFINE_integer("system_len", 512, "prefix: the system prompt's tokens, shared by every request.")
_CLIENTS = flags.DEFINE_integer("clients", 32, "prefix: concurrent clients, one request each per run.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "prefix: untimed runs first (arrivals vary: so do the shapes compiled).")


def bench(cfg, peak):
  """`--clients` streamed completions requests at once, each a `--system_len`-token system prompt
  followed by 1 to `--prompt_len` tokens of its own, `--new_tokens` answer tokens, on two servers of
  the same model and paged pool, one keeping a prefix cache: time to first token (median and p90 per
  run, then the median of runs, runs interleaved: off, on, off, on ...) and the prompt tokens each
  engine computed. Each run's prompts are new (a new system prompt too), so the cache starts cold."""
  import concurrent.futures as cf

  import httpx
  import numpy as np

  from dapo_jax.serve import server as server_lib
  del peak
  mc, params, tok = shared.load_policy(cfg)
  N, own, C, n = _SYSTEM_LEN.value, shared.PROMPT_LEN.value, shared.NEW_TOKENS.value, _CLIENTS.value
  S = shared.SLOTS.value or 16
  rng = np.random.default_rng(0)
  servers = {name: server_lib.PolicyServer(
      mc, params, tok, eos_ids=(), slots=S, max_prompt_len=N + own, max_new_tokens=C,
      engine_options=dict(kv_layout="paged", page_size=16, paged_attention="ragged", prefix_cache=on)).start()
      for name, on in (("off", False), ("on", True))}
  http = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=2 * n, max_keepalive_connections=2 * n))

  def ttft(url, prompt):
    body = {"prompt": prompt, "max_tokens": C, "temperature": 1.0, "seed": 0, "stream": True}
    t0 = time.perf_counter()
    with http.stream("POST", url + "/v1/completions", json=body) as r:
      for line in r.iter_lines():
        if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
          first = time.perf_counter() - t0
      return first

  def run(name):
    system = rng.integers(4, len(tok), size=N).tolist()
    prompts = [system + rng.integers(4, len(tok), size=int(k)).tolist() for k in rng.integers(1, own + 1, size=n)]
    session = servers[name].scheduler.session
    before = session.prefilled_tokens
    with cf.ThreadPoolExecutor(n) as pool:
      times = list(pool.map(lambda p: ttft(servers[name].url, p), prompts))
    return times, session.prefilled_tokens - before, sum(len(p) for p in prompts)

  for _ in range(_WARMUP.value):  # Compiles the prefill, page-write and decode shapes this load meets.
    for name in servers:
      run(name)
  out = {name: [] for name in servers}
  for _ in range(shared.RUNS.value):
    for name in servers:
      times, computed, sent = run(name)
      out[name].append({"ttft_s_median": statistics.median(times), "ttft_s_p90": float(np.percentile(times, 90)),
                        "prefilled_tokens": computed, "prompt_tokens": sent})
  http.close()
  for s in servers.values():
    s.close()
  med = lambda name, key: statistics.median(r[key] for r in out[name])
  return {"bench": "prefix", "system_len": N, "own_tokens_max": own, "clients": n, "new_tokens": C, "slots": S,
          **{f"prefix_cache_{name}": {k: med(name, k) for k in out[name][0]} for name in servers},
          "ttft_speedup": med("off", "ttft_s_median") / med("on", "ttft_s_median"), "runs": out}
