"""`bench serve`: the OpenAI-compatible policy server under concurrent clients against the engine's
offline throughput on the same model, samples and slots."""
import json
import statistics
import time

from absl import flags

from . import shared

_COMPACT = flags.DEFINE_bool("compact", False, "serve: the pool's width follows the load.")
_ROUND_STEPS = flags.DEFINE_integer("round_steps", 4, "serve: tokens per decode round at most.")


def bench(cfg, peak):
  """The policy server under 1, 8 and 32 concurrent clients (each sends its requests one after
  another: a completions request of `prompt_len` random prompt tokens, `new_tokens` answer tokens,
  no stop token, so every path generates the same tokens) against the engine's offline throughput
  on the same model, samples and slots, interleaved: offline, 1, 8, 32, offline, ... Time to first
  token from streamed requests at each concurrency."""
  import concurrent.futures as cf

  import httpx
  import jax
  import numpy as np

  from dapo_jax.rollout import engine, sampling
  from dapo_jax.serve import server as server_lib
  del peak
  mc, params, tok = shared.load_policy(cfg)
  P, C, S = shared.PROMPT_LEN.value, shared.NEW_TOKENS.value, shared.SLOTS.value or 32
  clients, per_client = (1, 8, 32), max(shared.BATCH.value // 32, 1)
  rng = np.random.default_rng(0)
  prompts = rng.integers(4, len(tok), size=(32 * per_client, P)).astype(np.int32)
  offline_engine = engine.Engine(mc, sampling.SamplerConfig(max_new_tokens=C, temperature=1.0), slots=S,
                                 prompt_len=P)
  server = server_lib.PolicyServer(mc, params, tok, eos_ids=(), slots=S, max_prompt_len=P, max_new_tokens=C,
                                   round_steps=_ROUND_STEPS.value, compact=_COMPACT.value).start()
  http = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))

  def offline(n):
    t0 = time.perf_counter()
    samples, _ = offline_engine.generate(params, prompts[:n], np.ones((n, P), bool), 1, jax.random.key(0))
    return int(np.asarray(samples.length_B).sum()), time.perf_counter() - t0

  def request(i, stream=False):
    body = {"prompt": prompts[i].tolist(), "max_tokens": C, "temperature": 1.0, "seed": i, "stream": stream}
    t0 = time.perf_counter()
    if not stream:
      r = http.post(server.url + "/v1/completions", json=body).json()
      return r["usage"]["completion_tokens"], time.perf_counter() - t0
    with http.stream("POST", server.url + "/v1/completions", json=body) as r:
      for line in r.iter_lines():
        if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
          return 0, time.perf_counter() - t0
    return 0, float("nan")

  def served(c, stream=False):
    n = c * per_client
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(c) as pool:
      out = list(pool.map(lambda i: request(i, stream), range(n)))
    return sum(t for t, _ in out), time.perf_counter() - t0, [s for _, s in out]

  for c in clients:  # Warm-up: compiles the widths and prefill shapes each load meets.
    served(c)
    served(c, stream=True)
  offline(32 * per_client)
  runs = {"offline": [], **{f"clients_{c}": [] for c in clients}}
  ttft = {f"clients_{c}": [] for c in clients}
  for _ in range(shared.RUNS.value):
    tokens, t = offline(32 * per_client)
    runs["offline"].append({"tokens_per_s": tokens / t, "s": t})
    for c in clients:
      tokens, t, _ = served(c)
      runs[f"clients_{c}"].append({"tokens_per_s": tokens / t, "requests_per_s": c * per_client / t, "s": t})
      ttft[f"clients_{c}"] += served(c, stream=True)[2]
  http.close()
  server.close()
  med = lambda k, f: statistics.median(r[f] for r in runs[k])
  offline_tps = med("offline", "tokens_per_s")
  return {"bench": "serve", "prompt_len": P, "new_tokens": C, "slots": S, "requests_per_client": per_client,
          "offline_tokens_per_s": offline_tps,
          **{k: {"tokens_per_s": med(k, "tokens_per_s"), "requests_per_s": med(k, "requests_per_s"),
                 "vs_offline": med(k, "tokens_per_s") / offline_tps,
                 "ttft_s_median": statistics.median(ttft[k]), "ttft_s_p90": float(np.percentile(ttft[k], 90))}
             for k in ttft},
          "runs": runs}
