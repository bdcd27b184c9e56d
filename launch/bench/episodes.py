"""`bench episodes`: multi-turn episodes whose environment answers after a latency, the engine
(slots keep decoding while environments work) against a turn-synchronous loop."""
import dataclasses
import statistics
import tempfile
import time

from absl import flags

from . import shared

_TOOL_MS = flags.DEFINE_float("tool_ms", 50.0, "episodes: mean environment latency (log-normal, sigma 1), ms.")


class LatencyEnv:
  """The episode workload's environment: `turns` policy turns; each step sleeps a latency drawn from
  a log-normal distribution (sigma 1) with mean `mean_ms`, as tools and sandboxes answer."""
  turns, mean_ms = 3, 50.0

  def __init__(self):
    import numpy as np
    self.rng, self.n = np.random.default_rng(), 0

  def reset(self, example):
    return [{"role": "user", "content": "go"}]

  def step(self, text):
    import numpy as np
    self.n += 1
    time.sleep(min(self.rng.lognormal(np.log(self.mean_ms / 1000) - 0.5, 1.0), 5.0))
    if self.n < self.turns:
      return [{"role": "user", "content": f"observation {self.n}"}], None, {}
    return None, {"score": 1.0, "acc": True, "pred": ""}, {}

  def close(self):
    pass


def bench(cfg, peak):
  """Episodes with environment latency: the engine (slots keep decoding while environments work)
  against the turn-synchronous loop (every busy slot's turn ends, then all its environment calls,
  the batch idle), interleaved A B A B on the same random model and workload."""
  import jax
  import numpy as np

  from dapo_jax import testing
  from dapo_jax.data import tokenizer as tokenizer_lib
  from dapo_jax.model import transformer as model_lib
  from dapo_jax.rollout import engine, episodes, sampling
  del peak
  tmp = tempfile.mkdtemp(prefix="dapo_bench_")
  tok = testing.build_tokenizer(tmp)
  mc = model_lib.ModelConfig(**{**dataclasses.asdict(testing.tiny_model_config(512)), "embed_dim": 128,
                                "mlp_dim": 384, "num_layers": 4, "head_dim": 32})
  params = model_lib.init_params(mc, jax.random.key(0))
  LatencyEnv.mean_ms = _TOOL_MS.value
  Q, G, C = shared.NUM_PROMPTS.value, shared.GROUP.value, shared.NEW_TOKENS.value
  eos = tuple(range(3, 3 + 512 // 16))  # One token in 16 ends a turn: turns of ~16 tokens.
  sc = sampling.SamplerConfig(max_new_tokens=C, temperature=1.0, eos_ids=eos)
  text = tokenizer_lib.render(tok, LatencyEnv().reset(None))
  prompt_QP, mask_QP = tokenizer_lib.encode_left_padded(tok, [text] * Q, 16)
  eng = engine.Engine(mc, sc, slots=shared.SLOTS.value or Q * G, prompt_len=16, turn_tokens=C // 3)
  out = {"overlapped": [], "barrier": []}
  for run in range(shared.RUNS.value + 1):
    for mode in out:
      driver = episodes.EpisodeDriver(tok, LatencyEnv, episodes.EpisodeConfig(
          max_turns=LatencyEnv.turns, workers=Q * G, barrier=mode == "barrier"), eos_ids=eos)
      for q in range(Q):
        driver.register(q, None)
      t0 = time.perf_counter()
      _, stats = eng.generate(params, prompt_QP, mask_QP, G, jax.random.key(run), episodes=driver)
      driver.close()
      if run:  # The first run compiles.
        out[mode].append({"s": time.perf_counter() - t0, "util": stats["slot_utilisation"],
                          "turns": float(np.mean(stats["turns"]))})
  med = lambda mode, k: statistics.median(r[k] for r in out[mode])
  return {"bench": "episodes", "episodes": Q * G, "tool_ms_mean": _TOOL_MS.value, "turns": LatencyEnv.turns,
          "overlapped_s": med("overlapped", "s"), "barrier_s": med("barrier", "s"),
          "speedup": med("barrier", "s") / med("overlapped", "s"),
          "slot_utilisation": {m: med(m, "util") for m in out}, "mean_turns": {m: med(m, "turns") for m in out},
          "runs_s": {m: [r["s"] for r in out[m]] for m in out}}
