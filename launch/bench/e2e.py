"""`bench e2e`: seconds per DAPO step (rollout, reward, update) on the peers' workload, each step's
phases, and what the machine was doing meanwhile (`probes`); `dapo_steps` is `bench device`'s too."""
import json
import os
import statistics
import tempfile

from absl import flags

from . import probes, shared

_PROMPTS = flags.DEFINE_string("prompts", None, "jsonl of prompts with input_ids (e2e).")
MEAN_LENGTH = flags.DEFINE_integer("mean_length", 0, "e2e, engine: each response's length is drawn from a long-tailed "
                                    "(log-normal, sigma 1) distribution with this mean, capped at --new_tokens, "
                                    "and forced to end there with EOS (fixed seed); 0 = the sampler decides.")
_ENGINE = flags.DEFINE_enum("engine", None, ["continuous", "static"], "e2e: 'continuous' (the engine and "
                            "length-bucketed updates) or 'static' (one sampler call per generation batch, every "
                            "row padded to --new_tokens); default: the config's.")
_WIDTHS = flags.DEFINE_enum("widths", "thirds", ["thirds", "pow2", "off"], "e2e, continuous engine: the decode "
                            "widths busy rows are compacted into once the queue is empty (engine.decode_widths: "
                            "powers of two and three times powers of two, powers of two only, or never compact).")
_ROUND_FRACTION = flags.DEFINE_float("round_fraction", 0.0, "e2e, continuous engine: a decode round returns to "
                                     "refill slots once this fraction of the busy slots ended (0 = the first).")


def bench(cfg, peak):
  """Seconds per DAPO rollout step on the peers' workload (8 x 8, 32-token prompts, 64 new tokens)."""
  if not (shared.MODEL_DIR.value and _PROMPTS.value):
    raise ValueError("e2e needs --model_dir and --prompts (see docs/scripts/peers/make_tiny_model.py)")
  return dapo_steps(cfg, peak, shared.MODEL_DIR.value, _PROMPTS.value, shared.NUM_PROMPTS.value, shared.GROUP.value,
                    shared.NEW_TOKENS.value, shared.RUNS.value)


def dapo_steps(cfg, peak, model_dir: str, prompts: str, Q: int, G: int, C: int, runs: int) -> dict:
  """`runs` DAPO rollout steps after a warm-up on Q x G samples of C new tokens from `prompts`
  (jsonl with a "prompt" text; 32-token prompts), the model of `model_dir`: median timings."""
  import numpy as np

  from dapo_jax import builders, sharding
  from dapo_jax.rollout import engine
  tmp = tempfile.mkdtemp(prefix="dapo_bench_")
  rows = [json.loads(line) for line in open(prompts)]
  with open(os.path.join(tmp, "prompts.jsonl"), "w") as f:
    for r in rows:
      f.write(json.dumps({"prompt": r["prompt"], "reward_model": {"ground_truth": "7"}}) + "\n")
  with cfg.unlocked():
    cfg.model.update(init="hf", hf_dir=model_dir, **shared.numerics(cfg))
    cfg.tokenizer.path = model_dir
    cfg.data.update(task="file", train_files=(os.path.join(tmp, "prompts.jsonl"),), eval_files=("",),
                    chat_template=False, max_prompt_len=32, prompt_buckets=())
    cfg.rollout.update(group_size=G, max_new_tokens=C, temperature=1.0, top_p=1.0, top_k=0)
    cfg.dapo.update(prompts_per_step=Q, gen_prompts=Q, dynamic_sampling=False, overlong_buffer=0,
                    eps_low=0.2, eps_high=0.28, loss_agg="token_mean", kl_coef=0.0)
    cfg.reward.fn = "dapo_jax.testing:has_seven"
    cfg.optim.update(lr=1e-6, warmup_steps=0)
    cfg.train.update(minibatches=1, ppo_epochs=1, ckpt_every=0, eval_every=0)
    if _ENGINE.value == "static":  # Today's path: static sampler calls, every row padded to C.
      cfg.rollout.engine, cfg.train.length_buckets = "static", 0
    elif _ENGINE.value == "continuous":
      cfg.rollout.engine = "continuous"
    if shared.SLOTS.value is not None:
      cfg.rollout.slots = shared.SLOTS.value
    cfg.dapo.streaming = False  # Whole generation batches: both paths run the very same samples.
  with builders.dapo(cfg, tmp, sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})) as dapo:
    if MEAN_LENGTH.value:
      dapo.rollout.length_hook = LengthHook(MEAN_LENGTH.value, C)
    slots = cfg.rollout.slots or Q * G
    dapo.rollout.engine_options = {"round_fraction": _ROUND_FRACTION.value, "widths": {
        "thirds": None, "pow2": engine.decode_widths(slots, thirds=False), "off": (slots,)}[_WIDTHS.value]}
    dapo.step(0)  # Warm-up: compiles, starts the reward pool.
    steps, engine_stats, load = [], [], []
    with probes.compile_seconds() as compiled, probes.gc_seconds() as collected:
      for i in range(runs):
        probe, memory = probes.core_speed(), probes.memory_speed()
        before = probes.cpu_seconds()
        steps.append(dapo.step(i + 1)[0])
        after = probes.cpu_seconds()
        load.append({k: round(after[k] - before[k], 3) for k in after})
        load[-1]["probe"] = round((probe + probes.core_speed()) / 2, 5)
        load[-1]["memory"] = round((memory + probes.memory_speed()) / 2, 5)
        engine_stats.append(dapo.rollout.last_stats)
        compiled.append(0.0)  # The next step's.
        collected.append(0.0)
  med = lambda k: statistics.median(m[k] for m in steps)
  mc = dapo.rollout.model_cfg
  B, P = Q * G, 32
  tokens = B * (P + C)
  fwd = 2 * shared.matmul_params(mc) * tokens + shared.attention_flops(mc, tokens, (P + C) / 2)
  flops = fwd + 3 * fwd  # generation (~one forward over every token) + update (forward + backward)
  return {"bench": "e2e", "step_s": med("timing_s/step"), "rollout_s": med("timing_s/gen"),
          "reward_s": med("timing_s/reward"), "old_log_prob_s": med("timing_s/old_log_prob"),
          "update_s": med("timing_s/update_actor"), "runs_step_s": [m["timing_s/step"] for m in steps],
          "runs_compile_s": [round(x, 3) for x in compiled[:runs]],  # tracing, lowering, compiling in each step
          "runs_gc_s": [round(x, 3) for x in collected[:runs]],  # Python's garbage collections in each step
          "runs_gen_tokens": [int(round(m["perf/throughput"] * m["timing_s/step"])) for m in steps],
          # Core-seconds in each step: this process's, other processes' (the machine's busy time less
          # ours: the reward pool's workers and anything else running) and the hypervisor's steal.
          "runs_cpu_s": {"own": [x.get("own") for x in load], "own_system": [x.get("own_system") for x in load],
                         "page_faults": [x.get("page_faults") for x in load],
                         "others": [round(x["busy"] - x["own"], 3) if x else None for x in load],
                         "steal": [x.get("steal") for x in load]},
          "runs_core_probe_s": [x["probe"] for x in load],  # `core_speed` around each step
          "runs_memory_probe_s": [x["memory"] for x in load],  # `memory_speed` around each step
          "runs_phase_s": {k.split("/")[1]: [round(m.get(k, 0.0), 4) for m in steps]  # where a step's spread comes from
                           for k in sorted(steps[0]) if k.startswith("timing_s/") and k != "timing_s/step"},
          "mfu": flops / med("timing_s/step") / peak, "generated_tokens_per_step": int(np.median(
              [m["perf/throughput"] * m["timing_s/step"] for m in steps])),
          "slot_utilisation": statistics.median(s["slot_utilisation"] for s in engine_stats),
          "rounds": statistics.median(s.get("rounds", 1) for s in engine_stats), "engine": cfg.rollout.engine,
          "slots": dapo.rollout.engines and next(iter(dapo.rollout.engines.values())).S or None,
          "length_buckets": list(dapo.cfg.length_buckets), "mean_length": MEAN_LENGTH.value,
          **({"widths": _WIDTHS.value, "round_fraction": _ROUND_FRACTION.value}
             if cfg.rollout.engine == "continuous" else {})}


class LengthHook:
  """The long-tail workload: response lengths drawn per generation call from a log-normal
  distribution (sigma 1) with mean `mean`, capped at `cap`; the n-th call draws the same lengths
  whichever engine runs it, so both paths generate the very same samples."""

  def __init__(self, mean: int, cap: int, seed: int = 0):
    import numpy as np
    self.mu, self.cap, self.seed, self.calls = np.log(mean) - 0.5, cap, seed, 0

  def __call__(self, rows: int):
    import numpy as np
    rng = np.random.default_rng((self.seed, self.calls))
    self.calls += 1
    return np.clip(np.round(rng.lognormal(self.mu, 1.0, size=rows)), 1, self.cap).astype(np.int32)
