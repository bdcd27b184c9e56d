"""Benchmarks: sampler throughput, train-step throughput, and one whole DAPO step, each with
model-FLOPs utilisation against a matmul peak measured in the same run. Prints one JSON line.

  python -m launch.bench sampler --model_dir=DIR --batch=64 --prompt_len=32 --new_tokens=64
  python -m launch.bench train   --model_dir=DIR --batch=64 --seq_len=96
  python -m launch.bench e2e     --model_dir=DIR --prompts=prompts_32tok.jsonl   # 8 prompts x 8 samples
  python -m launch.bench episodes --tool_ms=50    # 3-turn episodes, environment latency vs a turn-synchronous loop
  python -m launch.bench serve --batch=64 --new_tokens=64   # the OpenAI server at 1/8/32 clients vs offline
  python -m launch.bench device   # what a GPU/TPU run reports: decode roofline, bf16 MFU, DAPO steps
  python -m launch.bench async --rollout_devices=4   # a split mesh's phases and the async step they predict
                                  # (on a CPU host, 8 forced host devices unless XLA_FLAGS sets a count)

DIR is any local HF Qwen2/Llama directory, so other tools can time the very same model.
Without --model_dir the config's model is built with random weights.
"""
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

from absl import flags

from . import common

# A split mesh needs several devices: on a CPU host, 8 forced host devices (the flag is read by the CPU
# backend alone, so a GPU or TPU run is unaffected) unless the user's XLA_FLAGS sets a count.
if "async" in sys.argv[1:] and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()

_CONFIG = common.define_config()
_MODEL_DIR = flags.DEFINE_string("model_dir", None, "HF model directory (default: the config's model).")
_BATCH = flags.DEFINE_integer("batch", 64, "Rows (sampler, train).")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32, "Prompt tokens (sampler).")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Generated tokens per row (sampler, e2e).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 96, "Tokens per row (train).")
_RUNS = flags.DEFINE_integer("runs", 5, "Timed runs after one warm-up.")
_PROMPTS = flags.DEFINE_string("prompts", None, "jsonl of prompts with input_ids (e2e).")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 8, "Prompts per step (e2e).")
_GROUP = flags.DEFINE_integer("group", 8, "Samples per prompt (e2e).")
_DTYPE = flags.DEFINE_string("dtype", "", "Compute dtype ('' = the config's model.dtype).")
_MEAN_LENGTH = flags.DEFINE_integer("mean_length", 0, "e2e: each response's length is drawn from a long-tailed "
                                    "(log-normal, sigma 1) distribution with this mean, capped at --new_tokens, "
                                    "and forced to end there with EOS (fixed seed); 0 = the sampler decides.")
_ENGINE = flags.DEFINE_enum("engine", None, ["continuous", "static"], "e2e: 'continuous' (the engine and "
                            "length-bucketed updates) or 'static' (one sampler call per generation batch, every "
                            "row padded to --new_tokens); default: the config's.")
_SLOTS = flags.DEFINE_integer("slots", None, "e2e: decode slots of the continuous engine (default: the config's).")
_WIDTHS = flags.DEFINE_enum("widths", "thirds", ["thirds", "pow2", "off"], "e2e, continuous engine: the decode "
                            "widths busy rows are compacted into once the queue is empty (engine.decode_widths: "
                            "powers of two and three times powers of two, powers of two only, or never compact).")
_ROUND_FRACTION = flags.DEFINE_float("round_fraction", 0.0, "e2e, continuous engine: a decode round returns to "
                                     "refill slots once this fraction of the busy slots ended (0 = the first).")
_TOOL_MS = flags.DEFINE_float("tool_ms", 50.0, "episodes: mean environment latency (log-normal, sigma 1), ms.")
_COMPACT = flags.DEFINE_bool("compact", False, "serve: the pool's width follows the load.")
_ROUND_STEPS = flags.DEFINE_integer("round_steps", 4, "serve: tokens per decode round at most.")
_MATMUL_DTYPE = flags.DEFINE_string("matmul_dtype", "", "Weight-matmul operand dtype ('' = the config's "
                                    "model.matmul_dtype, or else the compute dtype).")

_SMOLLM2_DIR = flags.DEFINE_string("smollm2_dir", "/tmp/smollm2", "device: SmolLM2-135M HF dir (launch.prepare "
                                   "smollm2); decode and train run on it, and its DAPO step ('' = skip).")
_MEDIUM_DIR = flags.DEFINE_string("medium_dir", "/tmp/peers/medium-qwen2", "device: the peers' 30.8M model "
                                  "(docs/scripts/peers/make_tiny_model.py) for its DAPO step ('' = skip).")
_DEVICE_PROMPTS = flags.DEFINE_string("device_prompts", "/tmp/peers/data/prompts_32tok.jsonl",
                                      "device: prompts of the DAPO steps (jsonl with a 'prompt').")
_DECODE_BATCH = flags.DEFINE_integer("decode_batch", 64, "device: rows decoded at once.")
_ROLLOUT_DEVICES = flags.DEFINE_integer("rollout_devices", 0, "async: devices that decode (default: half).")
_WARM_START = flags.DEFINE_string("warm_start", "", "async: a workdir whose sft_model (and tokenizer) the run "
                                  "starts from instead of running SFT.")
_TRAIN_BATCH = flags.DEFINE_integer("train_batch", 32, "device: rows of the bf16 update (x --seq_len tokens).")


def numerics(cfg) -> dict:
  """The model's dtype and matmul_dtype: the flags where given, else the config's."""
  return dict(dtype=_DTYPE.value or cfg.model.dtype, matmul_dtype=_MATMUL_DTYPE.value or cfg.model.matmul_dtype)


def timed(fn, runs):
  import jax
  jax.block_until_ready(fn())  # Warm-up (compiles).
  times = []
  for _ in range(runs):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times), times


def matmul_peak(dtype="float32", n=2048, runs=5) -> float:
  """FLOP/s of one large matmul with `dtype` operands and fp32 accumulation, as the model's weight
  matmuls run: the ceiling for this machine and XLA build."""
  import jax
  import jax.numpy as jnp
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
  f = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
  t, _ = timed(lambda: f(a), runs)
  return 2 * n ** 3 / t


def load_model(cfg):
  import jax

  from dapo_jax import build
  from dapo_jax.hf import convert as hf
  from dapo_jax.model import transformer as model
  if _MODEL_DIR.value:
    mc, params = hf.load(_MODEL_DIR.value, **{**build.runtime_overrides(cfg), **numerics(cfg)})
  else:
    mc = dataclasses.replace(build.model_config(cfg, cfg.model.vocab_size or 1024), **numerics(cfg))
    params = model.init_params(mc, jax.random.key(0))
  return mc, params


def adapted(cfg, mc, params):
  """`params` as a run with `model.lora` holds them: the (int8) base and fresh adapters."""
  import jax

  from dapo_jax import build
  from dapo_jax.model import lora
  lcfg = build.lora_config(cfg)
  return params if lcfg is None else lora.adapt(mc, lcfg, params, jax.random.key(1))


def matmul_params(mc) -> int:
  """`metrics.matmul_params`: the FLOPs the runs' own perf/mfu counts (MoE: the active experts)."""
  from dapo_jax import metrics
  return metrics.matmul_params(mc)


def attention_flops(mc, queries: int, keys: float) -> float:
  """QK^T and AV for `queries` query tokens against `keys` keys each, forward."""
  return 4 * mc.num_layers * queries * keys * mc.num_heads * mc.head_dim


def bench_sampler(cfg, peak):
  import jax
  import numpy as np

  from dapo_jax import sharding
  from dapo_jax.rollout import sampling
  mc, params = load_model(cfg)
  params = adapted(cfg, mc, params)  # LoRA: each call decodes its int8 base unmerged or merges a float one.
  B, P, C = _BATCH.value, _PROMPT_LEN.value, _NEW_TOKENS.value
  # Data-parallel over every local device, as the training loop's rollouts are; params resident.
  mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
  if B % mesh.size:
    raise ValueError(f"--batch={B} must be divisible by the {mesh.size} local devices it is split over")
  params = jax.device_put(params, sharding.replicated(mesh))
  tokens = np.random.default_rng(0).integers(0, mc.vocab_size, size=(B, P)).astype(np.int32)
  tokens, mask = sharding.put((tokens, np.ones((B, P), bool)), sharding.named(mesh, "BT"))
  # No EOS: every row generates exactly C tokens, as the peers' min_new_tokens does.
  sc = sampling.SamplerConfig(max_new_tokens=C, temperature=1.0, top_p=1.0, eos_ids=())
  keys = iter(jax.random.split(jax.random.key(0), _RUNS.value + 1))
  t, times = timed(lambda: sampling.generate(mc, sc, params, tokens, mask, next(keys)).tokens_BC, _RUNS.value)
  flops = 2 * matmul_params(mc) * B * (P + C) + attention_flops(mc, B * P, P + C) + attention_flops(mc, B * C, P + C)
  return {"bench": "sampler", "new_tokens_per_s": B * C / t, "median_s": t, "runs_s": times,
          "model_flops_per_s": flops / t, "mfu": flops / t / peak}


def rl_batch(mc, B, T, C, seed=0):
  import numpy as np

  from dapo_jax.datatypes import RLBatch
  rng = np.random.default_rng(seed)
  return RLBatch(tokens_BT=rng.integers(0, mc.vocab_size, size=(B, T)).astype(np.int32),
                 mask_BT=np.ones((B, T), bool), loss_mask_BC=np.ones((B, C), bool),
                 old_logp_BC=np.full((B, C), -5.0, np.float32), adv_B=rng.normal(size=B).astype(np.float32),
                 ref_logp_BC=np.zeros((B, C), np.float32))


def bench_train(cfg, peak):
  mc, params = load_model(cfg)
  return train_rates(cfg, mc, params, _BATCH.value, _SEQ_LEN.value, _RUNS.value, peak)


def train_rates(cfg, mc, params, B: int, T: int, runs: int, peak: float) -> dict:
  """Forward and update (forward + backward + AdamW) of B rows of T tokens: tokens/s and MFU."""
  from dapo_jax import objectives, optim, sharding, train_step
  C = T - 1  # Score every position after the first, like a causal-LM loss over the whole row.
  mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
  trainer = train_step.Trainer(mc, optim.OptimConfig(lr=1e-6, warmup_steps=0), mesh,
                               objectives.policy_gradient(mc, objectives.PGConfig()),
                               num_microbatches=cfg.train.num_microbatches,
                               microbatch_tokens=cfg.train.microbatch_tokens)
  logprobs = trainer.forward(objectives.completion_logprobs(mc, 1.0))
  state = trainer.init(params=params)
  batch = trainer.put_batch(rl_batch(mc, B, T, C))
  t_fwd, _ = timed(lambda: logprobs(state.params, batch), runs)
  holder = {"state": state}

  def step():
    holder["state"], m = trainer.step(holder["state"], batch)
    return m["loss"]
  t_step, times = timed(step, runs)
  tokens = B * T
  fwd = 2 * matmul_params(mc) * tokens + attention_flops(mc, tokens, T / 2)
  return {"bench": "train", "microbatches": trainer.microbatches_for(batch),
          "forward_tokens_per_s": tokens / t_fwd, "update_tokens_per_s": tokens / t_step,
          "update_median_s": t_step, "runs_s": times, "forward_mfu": fwd / t_fwd / peak,
          "update_mfu": 3 * fwd / t_step / peak}


def bench_e2e(cfg, peak):
  """Seconds per DAPO rollout step on the peers' workload (8 x 8, 32-token prompts, 64 new tokens)."""
  if not (_MODEL_DIR.value and _PROMPTS.value):
    raise ValueError("e2e needs --model_dir and --prompts (see docs/scripts/peers/make_tiny_model.py)")
  return dapo_steps(cfg, peak, _MODEL_DIR.value, _PROMPTS.value, _NUM_PROMPTS.value, _GROUP.value,
                    _NEW_TOKENS.value, _RUNS.value)


@contextlib.contextmanager
def compile_seconds():
  """A list whose last entry accumulates the seconds JAX spends tracing, lowering and compiling
  (the caller appends a new entry per step): what makes one step of a steady run slower than another."""
  import jax
  spent = [0.0]
  events = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
            "/jax/core/compile/backend_compile_duration")

  def listen(event, duration, **_):
    if event in events:
      spent[-1] += duration
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield spent
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


def core_speed(n: int = 200_000) -> float:
  """Seconds of a fixed single-threaded Python loop: how fast a core runs right now, apart from JAX
  (its thread pools, programs and memory): a slower reading is a slower machine."""
  t0 = time.perf_counter()
  total = 0
  for i in range(n):
    total += i * i
  return time.perf_counter() - t0


_MEMORY_PROBE = []  # Two 128 MB buffers, made once: far larger than any cache.


def memory_speed() -> float:
  """Seconds of one single-threaded copy of 128 MB: how fast this machine's memory answers right now,
  which `core_speed` (a loop that lives in a core's L1 cache) cannot see. Slower here and not there:
  memory bandwidth or the last-level cache shared with other work (another tenant of the host)."""
  import numpy as np
  if not _MEMORY_PROBE:
    _MEMORY_PROBE.extend(np.ones(2, np.float32).repeat(1 << 25).reshape(2, -1))
  src, dst = _MEMORY_PROBE
  t0 = time.perf_counter()
  np.copyto(dst, src)
  return time.perf_counter() - t0


def cpu_seconds() -> dict:
  """Core-seconds since boot from /proc: this process's (every thread), the whole machine's busy
  time, and the time the hypervisor gave the virtual cores to others (steal); {} where there is no
  /proc. Differences between two readings say whether a slow step ran on a machine busy with other
  work, or one whose cores were taken away."""
  try:
    hz = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
      user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    with open("/proc/self/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
    minflt, utime, stime = int(fields[7]), int(fields[11]), int(fields[12])
  except (OSError, ValueError):
    return {}
  return {"own": (utime + stime) / hz, "own_system": stime / hz, "page_faults": minflt,
          "busy": (user + nice + system + irq + softirq) / hz, "steal": steal / hz}


@contextlib.contextmanager
def gc_seconds():
  """As `compile_seconds`, for the pauses of Python's garbage collector (in any thread: a collection
  holds the interpreter lock, so every thread waits)."""
  import gc
  spent, started = [0.0], {}

  def listen(phase, info):
    if phase == "start":
      started["t"] = time.perf_counter()
    elif "t" in started:
      spent[-1] += time.perf_counter() - started.pop("t")
  gc.callbacks.append(listen)
  try:
    yield spent
  finally:
    gc.callbacks.remove(listen)


def dapo_steps(cfg, peak, model_dir: str, prompts: str, Q: int, G: int, C: int, runs: int) -> dict:
  """`runs` DAPO rollout steps after a warm-up on Q x G samples of C new tokens from `prompts`
  (jsonl with a "prompt" text; 32-token prompts), the model of `model_dir`: median timings."""
  import numpy as np

  from dapo_jax import build, sharding
  from dapo_jax.rollout import engine
  tmp = tempfile.mkdtemp(prefix="dapo_bench_")
  rows = [json.loads(line) for line in open(prompts)]
  with open(os.path.join(tmp, "prompts.jsonl"), "w") as f:
    for r in rows:
      f.write(json.dumps({"prompt": r["prompt"], "reward_model": {"ground_truth": "7"}}) + "\n")
  with cfg.unlocked():
    cfg.model.update(init="hf", hf_dir=model_dir, **numerics(cfg))
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
    if _SLOTS.value is not None:
      cfg.rollout.slots = _SLOTS.value
    cfg.dapo.streaming = False  # Whole generation batches: both paths run the very same samples.
  with build.dapo(cfg, tmp, sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})) as dapo:
    if _MEAN_LENGTH.value:
      dapo.rollout.length_hook = LengthHook(_MEAN_LENGTH.value, C)
    slots = cfg.rollout.slots or Q * G
    dapo.rollout.engine_options = {"round_fraction": _ROUND_FRACTION.value, "widths": {
        "thirds": None, "pow2": engine.decode_widths(slots, thirds=False), "off": (slots,)}[_WIDTHS.value]}
    dapo.step(0)  # Warm-up: compiles, starts the reward pool.
    steps, engine_stats, load = [], [], []
    with compile_seconds() as compiled, gc_seconds() as collected:
      for i in range(runs):
        probe, memory = core_speed(), memory_speed()
        before = cpu_seconds()
        steps.append(dapo.step(i + 1)[0])
        after = cpu_seconds()
        load.append({k: round(after[k] - before[k], 3) for k in after})
        load[-1]["probe"] = round((probe + core_speed()) / 2, 5)
        load[-1]["memory"] = round((memory + memory_speed()) / 2, 5)
        engine_stats.append(dapo.rollout.last_stats)
        compiled.append(0.0)  # The next step's.
        collected.append(0.0)
  med = lambda k: statistics.median(m[k] for m in steps)
  mc = dapo.rollout.model_cfg
  B, P = Q * G, 32
  tokens = B * (P + C)
  fwd = 2 * matmul_params(mc) * tokens + attention_flops(mc, tokens, (P + C) / 2)
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
          "length_buckets": list(dapo.cfg.length_buckets), "mean_length": _MEAN_LENGTH.value,
          **({"widths": _WIDTHS.value, "round_fraction": _ROUND_FRACTION.value}
             if cfg.rollout.engine == "continuous" else {})}


def bench_async(cfg, peak):
  """Phase times of synchronous rollout steps on a split mesh (`mesh.rollout_devices`: the first R
  devices decode, the rest train) and the step time `pipelining.schedule_seconds` predicts from
  them for `rollout.max_staleness` = 0, 1, 2, 4 when the two sides never slow each other (what
  disjoint chips give; on forced CPU devices the sides share the cores, so only the phases are
  measured). Rollout = the whole `collect` (policy copy, prefill, decode, scoring, dynamic
  sampling); train = the rest of the step (advantages, π_old, update, metrics)."""
  import shutil

  import jax

  from dapo_jax import build, pipelining
  R = _ROLLOUT_DEVICES.value or jax.device_count() // 2
  if not 0 < R < jax.device_count():
    raise SystemExit(f"--rollout_devices={R}: expected 1..{jax.device_count() - 1} of {jax.device_count()} devices "
                     "(more devices on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  runs = _RUNS.value
  tmp = tempfile.mkdtemp(prefix="dapo_bench_async_")
  if _WARM_START.value:  # A finished run's SFT warm start (and tokenizer): no SFT here.
    for name in ("sft_model", "tokenizer"):
      src = os.path.join(_WARM_START.value, name)
      if os.path.isdir(src):
        shutil.copytree(src, os.path.join(tmp, name))
  with cfg.unlocked():
    cfg.mesh.rollout_devices = R
    cfg.rollout.max_staleness = 0
    cfg.train.update(num_steps=runs + 1, eval_every=0, ckpt_every=0, log_samples_every=0, dump_rollouts_every=0)
  rollout_s, train_s, steps = [], [], []
  with build.dapo(cfg, tmp) as dapo:
    collect = dapo.collect

    def timed_collect(*args, **kwargs):
      t0 = time.perf_counter()
      out = collect(*args, **kwargs)
      rollout_s.append(time.perf_counter() - t0)
      return out

    dapo.collect = timed_collect
    for step in range(runs + 1):  # Step 0 compiles.
      m, _ = dapo.step(step)
      steps.append(m)
      train_s.append(m["timing_s/step"] - rollout_s[-1])
  r, t = rollout_s[1:], train_s[1:]
  predicted = {S: pipelining.schedule_seconds(r, t, S) / runs for S in (0, 1, 2, 4)}
  return {"bench": "async", "rollout_devices": R, "train_devices": jax.device_count() - R, "steps": runs,
          "runs_rollout_s": [round(x, 4) for x in r], "runs_train_s": [round(x, 4) for x in t],
          "rollout_median_s": statistics.median(r), "train_median_s": statistics.median(t),
          "gen_median_s": statistics.median(m["timing_s/gen"] for m in steps[1:]),
          "update_median_s": statistics.median(m["timing_s/update_actor"] + m["timing_s/old_log_prob"]
                                               for m in steps[1:]),
          "measured_sync_step_s": statistics.mean(m["timing_s/step"] for m in steps[1:]),
          "predicted_step_s": {str(S): round(v, 4) for S, v in predicted.items()},
          "predicted_speedup": {str(S): round(predicted[0] / v, 3) for S, v in predicted.items()},
          "assumptions": ["the rollout and train devices never slow each other (disjoint chips)",
                          "the two threads' host work fits beside each other (no GIL or core contention)",
                          "each step's phases take what they took synchronously (the same samples, "
                          "dynamic-sampling waves and update)",
                          "the policy copy to the rollout side stays inside the rollout phase"]}


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


def bench_episodes(cfg, peak):
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
  Q, G, C = _NUM_PROMPTS.value, _GROUP.value, _NEW_TOKENS.value
  eos = tuple(range(3, 3 + 512 // 16))  # One token in 16 ends a turn: turns of ~16 tokens.
  sc = sampling.SamplerConfig(max_new_tokens=C, temperature=1.0, eos_ids=eos)
  text = tokenizer_lib.render(tok, LatencyEnv().reset(None))
  prompt_QP, mask_QP = tokenizer_lib.encode_left_padded(tok, [text] * Q, 16)
  eng = engine.Engine(mc, sc, slots=_SLOTS.value or Q * G, prompt_len=16, turn_tokens=C // 3)
  out = {"overlapped": [], "barrier": []}
  for run in range(_RUNS.value + 1):
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


def bench_serve(cfg, peak):
  """The policy server under 1, 8 and 32 concurrent clients (each sends its requests one after
  another: a completions request of `prompt_len` random prompt tokens, `new_tokens` answer tokens,
  no stop token, so every path generates the same tokens) against the engine's offline throughput
  on the same model, samples and slots, interleaved: offline, 1, 8, 32, offline, ... Time to first
  token from streamed requests at each concurrency."""
  import concurrent.futures as cf

  import httpx
  import jax
  import numpy as np

  from dapo_jax import build, testing
  from dapo_jax.data import tokenizer as tokenizer_lib
  from dapo_jax.model import transformer as model_lib
  from dapo_jax.rollout import engine, sampling
  from dapo_jax.serve import server as server_lib
  del peak
  if _MODEL_DIR.value:
    mc, params = load_model(cfg)
    tok = tokenizer_lib.load(_MODEL_DIR.value)
  else:
    tok = testing.build_tokenizer(tempfile.mkdtemp(prefix="dapo_bench_"))
    mc = dataclasses.replace(build.model_config(cfg, len(tok)), **numerics(cfg))
    params = model_lib.init_params(mc, jax.random.key(0))
  P, C, S = _PROMPT_LEN.value, _NEW_TOKENS.value, _SLOTS.value or 32
  clients, per_client = (1, 8, 32), max(_BATCH.value // 32, 1)
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
  for _ in range(_RUNS.value):
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


# Peak memory bandwidth per device, bytes/s (vendor figures: HBM of the SXM / OAM parts, TPU chips);
# peak dense bf16 FLOP/s are `metrics.PEAK_FLOPS`. A CPU has neither: its peaks are measured in the
# run (a 2048^3 bf16 matmul, a 256 MiB reduction).
PEAK_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12, "H800": 3.35e12, "H20": 4.0e12, "B200": 8.0e12,
                    "A100": 2.04e12, "A800": 2.04e12, "L40S": 0.864e12, "L4": 0.3e12, "TPU v4": 1.2e12,
                    "TPU v5 lite": 0.819e12, "TPU v5e": 0.819e12, "TPU v5p": 2.765e12, "TPU v5": 2.765e12,
                    "TPU v6 lite": 1.64e12, "TPU v6e": 1.64e12, "TPU7x": 7.37e12}


def _by_kind(table: dict, kind: str):
  names = [k for k in table if k.lower() in kind.lower()]
  return table[max(names, key=len)] if names else None


def measured_bandwidth(runs: int = 5) -> float:
  """Bytes/s of one reduction over 256 MiB: reads only, as a decode step's traffic nearly is (an
  elementwise pass would also time the page faults of a fresh 256 MiB output)."""
  import jax
  import jax.numpy as jnp
  x = jnp.ones((1 << 26,), jnp.float32)
  f = jax.jit(jnp.sum)
  t, _ = timed(lambda: f(x), runs)
  return x.nbytes / t


def decode_roofline(mc, params, B: int, P: int, C: int, kv_dtype: str, runs: int, forced_CB=None) -> dict:
  """C greedy decode steps of B rows after a P-token prompt (one device), the cache in `kv_dtype`.

  A step reads every decode weight once and the whole cache (keys and values of P + C slots, masked):
  those bytes over the step's time against the device's peak bandwidth is the roofline fraction.
  With `forced_CB` the steps feed those tokens instead (teacher forcing through the cache); returns
  the tokens fed and each step's log-prob of the next one, for the KV dtype's log-prob shift.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np

  from dapo_jax.model import kv_cache
  from dapo_jax.model import transformer as model
  from dapo_jax.rollout import sampling
  tokens_BP = jnp.asarray(np.random.default_rng(0).integers(0, mc.vocab_size, size=(B, P)).astype(np.int32))
  logits_BV, cache = sampling.prefill(mc, params, tokens_BP, jnp.ones((B, P), bool), cache_size=P + C)
  dt = jnp.dtype(kv_dtype or mc.dtype)
  cache = cache.replace(k=[x.astype(dt) for x in cache.k], v=[x.astype(dt) for x in cache.v])
  dparams = model.decode_params(mc, params)
  forced = forced_CB is not None
  feed_CB = jnp.asarray(forced_CB) if forced else jnp.zeros((C, B), jnp.int32)

  @jax.jit
  def decode(dparams, cache, logits_BV, feed_CB):
    def body(i, carry):
      cache, logits_BV, tok_CB, logp_CB = carry
      tok_B = feed_CB[i] if forced else jnp.argmax(logits_BV, -1).astype(jnp.int32)
      logp_B = jnp.take_along_axis(jax.nn.log_softmax(logits_BV), tok_B[:, None], 1)[:, 0]
      cache = kv_cache.write_mask(cache, jnp.ones((B, 1), bool), P + i)
      logits_BV, cache = model.decode_step(mc, dparams, tok_B, jnp.full((B,), P + i), cache, P + i)
      return cache, logits_BV, tok_CB.at[i].set(tok_B), logp_CB.at[i].set(logp_B)
    init = (cache, logits_BV, jnp.zeros((C, B), jnp.int32), jnp.zeros((C, B), jnp.float32))
    _, _, tok_CB, logp_CB = jax.lax.fori_loop(0, C, body, init)
    return tok_CB, logp_CB
  t = timed(lambda: decode(dparams, cache, logits_BV, feed_CB), runs)[0] if runs else float("nan")
  tok_CB, logp_CB = jax.device_get(decode(dparams, cache, logits_BV, feed_CB))
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(dparams))
  kv_bytes = sum(x.nbytes for x in cache.k + cache.v)
  return {"kv_cache_dtype": dt.name, "decode_tokens_per_s": B * C / t, "decode_step_s": t / C,
          "weight_bytes": weight_bytes, "kv_bytes_per_step": kv_bytes,
          "bytes_per_s": (weight_bytes + kv_bytes) / (t / C), "tokens_CB": tok_CB, "logp_CB": logp_CB}


def bench_device(cfg, peak):
  """What a GPU/TPU run must report, on whatever device this is: decode tokens/s and the fraction
  of the memory-bandwidth roofline (fp32 or model-dtype KV cache and bf16 KV cache, with the
  bf16 cache's log-prob shift), the update's MFU in bf16, and the DAPO step of the SmolLM2-135M and
  30.8M workloads (8 x 8 samples, 32-token prompts, --new_tokens; --num_prompts / --group /
  --new_tokens / --runs shrink them, '' for a model dir skips its step)."""
  import copy

  import jax
  import numpy as np

  from dapo_jax import metrics
  dev = jax.devices()[0]
  kind = dev.device_kind
  flops_peak = _by_kind(metrics.PEAK_FLOPS, kind) if dev.platform != "cpu" else None
  bw_peak = _by_kind(PEAK_BYTES_PER_S, kind) if dev.platform != "cpu" else None
  out = {"bench": "device", "platform": dev.platform, "device_kind": kind, "devices": jax.device_count(),
         "peak_bf16_flops_per_s": flops_peak or matmul_peak("bfloat16"),
         "peak_bytes_per_s": bw_peak or measured_bandwidth(),
         "peaks": "vendor table" if flops_peak and bw_peak else "measured here (no table entry for this device)"}
  smol = _SMOLLM2_DIR.value if _SMOLLM2_DIR.value and os.path.isdir(_SMOLLM2_DIR.value) else ""
  if smol and not _MODEL_DIR.value:
    flags.FLAGS.model_dir = smol  # Decode and train run on SmolLM2 when it is there.
  mc, params = load_model(cfg)
  out["model"] = _MODEL_DIR.value or "config (random weights)"
  out["model_params"] = sum(x.size for x in jax.tree.leaves(params))
  B, P, C = _DECODE_BATCH.value, _PROMPT_LEN.value, _NEW_TOKENS.value
  base = decode_roofline(mc, params, B, P, C, "", _RUNS.value)
  bf16 = decode_roofline(mc, params, B, P, C, "bfloat16", _RUNS.value)
  forced = decode_roofline(mc, params, B, P, C, "bfloat16", 0, forced_CB=base["tokens_CB"])
  shift = np.abs(forced["logp_CB"] - base["logp_CB"])
  for name, r in (("decode", base), ("decode_bf16_kv", bf16)):
    out[name] = {k: v for k, v in r.items() if k not in ("tokens_CB", "logp_CB")}
    out[name]["roofline_fraction"] = r["bytes_per_s"] / out["peak_bytes_per_s"]
  out["decode"]["shape"] = f"B={B} P={P} C={C}"
  out["bf16_kv_logp_shift"] = {"max": float(shift.max()), "mean": float(shift.mean()),
                               "tokens": int(shift.size)}
  bf16_mc = dataclasses.replace(mc, dtype="bfloat16", matmul_dtype="bfloat16")
  out["train_bf16"] = train_rates(cfg, bf16_mc, params, _TRAIN_BATCH.value, _SEQ_LEN.value, _RUNS.value,
                                  out["peak_bf16_flops_per_s"])
  out["train_bf16"]["shape"] = f"B={_TRAIN_BATCH.value} T={_SEQ_LEN.value}"
  for name, model_dir in (("dapo_step_smollm2", smol), ("dapo_step_30_8m", _MEDIUM_DIR.value)):
    if not (model_dir and os.path.isdir(model_dir) and os.path.exists(_DEVICE_PROMPTS.value)):
      out[name] = {"skipped": f"no model dir {model_dir!r} or prompts {_DEVICE_PROMPTS.value!r}"}
      continue
    r = dapo_steps(copy.deepcopy(cfg), peak, model_dir, _DEVICE_PROMPTS.value, _NUM_PROMPTS.value,
                   _GROUP.value, C, max(_RUNS.value, 1))
    out[name] = {k: r[k] for k in ("step_s", "rollout_s", "update_s", "runs_step_s", "engine", "slots")}
    out[name]["shape"] = f"{_NUM_PROMPTS.value} x {_GROUP.value}, {C} new tokens"
  _print_device(out)
  return out


def _print_device(out: dict) -> None:
  """The report's fields as a few readable lines (the JSON line follows)."""
  g = lambda x: f"{x:.3g}"  # noqa: E731
  print(f"device     {out['platform']} {out['device_kind']!r} x{out['devices']}; peaks ({out['peaks']}): "
        f"{g(out['peak_bf16_flops_per_s'] / 1e12)} bf16 TFLOP/s, {g(out['peak_bytes_per_s'] / 1e9)} GB/s")
  print(f"model      {out['model']} ({out['model_params'] / 1e6:.1f}M params)")
  for k in ("decode", "decode_bf16_kv"):
    d = out[k]
    print(f"{k:<14} {d['kv_cache_dtype']} KV: {g(d['decode_tokens_per_s'])} tok/s, "
          f"{g(d['decode_step_s'] * 1e3)} ms/step, {g((d['weight_bytes'] + d['kv_bytes_per_step']) / 1e6)} MB/step, "
          f"{100 * d['roofline_fraction']:.1f}% of the bandwidth roofline")
  s = out["bf16_kv_logp_shift"]
  print(f"bf16 KV    max |dlogp| {s['max']:.2e}, mean {s['mean']:.2e} over {s['tokens']} greedy tokens")
  t = out["train_bf16"]
  print(f"train bf16 {t['shape']}: {g(t['update_tokens_per_s'])} tok/s, MFU {100 * t['update_mfu']:.2f}% "
        f"(forward {100 * t['forward_mfu']:.2f}%)")
  for k in ("dapo_step_smollm2", "dapo_step_30_8m"):
    d = out[k]
    line = d.get("skipped") or (f"{d['shape']}: {g(d['step_s'])} s (rollout {g(d['rollout_s'])} s, "
                                f"update {g(d['update_s'])} s)")
    print(f"{k:<17} {line}")


def main(argv):
  if len(argv) != 2 or argv[1] not in ("sampler", "train", "e2e", "episodes", "serve", "device", "async"):
    raise SystemExit("usage: python -m launch.bench sampler|train|e2e|episodes|serve|device|async [flags]")
  import jax
  cfg = _CONFIG.value
  dtypes = numerics(cfg)
  operand_dtype = dtypes["matmul_dtype"] or dtypes["dtype"]
  peak = matmul_peak(operand_dtype)
  result = {"sampler": bench_sampler, "train": bench_train, "e2e": bench_e2e,
            "episodes": bench_episodes, "serve": bench_serve, "device": bench_device,
            "async": bench_async}[argv[1]](cfg, peak)
  result.update(matmul_peak_flops_per_s=peak, matmul_dtype=operand_dtype, backend=jax.default_backend(),
                devices=jax.device_count(), model_dir=_MODEL_DIR.value)
  print(json.dumps(result))


if __name__ == "__main__":
  common.run(main)
