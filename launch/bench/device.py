"""`bench device`: what a GPU or TPU run reports: decode throughput against the memory-bandwidth
roofline (and the bf16 KV cache's log-prob shift), the bf16 update's MFU and the DAPO step of two
small models."""
import dataclasses
import os

from absl import flags

from . import e2e, shared, train

_SMOLLM2_DIR = flags.DEFINE_string("smollm2_dir", "/tmp/smollm2", "device: SmolLM2-135M HF dir (launch.prepare "
                                   "smollm2); decode and train run on it, and its DAPO step ('' = skip).")
_MEDIUM_DIR = flags.DEFINE_string("medium_dir", "/tmp/peers/medium-qwen2", "device: the peers' 30.8M model "
                                  "(docs/scripts/peers/make_tiny_model.py) for its DAPO step ('' = skip).")
_DEVICE_PROMPTS = flags.DEFINE_string("device_prompts", "/tmp/peers/data/prompts_32tok.jsonl",
                                      "device: prompts of the DAPO steps (jsonl with a 'prompt').")
_DECODE_BATCH = flags.DEFINE_integer("decode_batch", 64, "device: rows decoded at once.")
_TRAIN_BATCH = flags.DEFINE_integer("train_batch", 32, "device: rows of the bf16 update (x --seq_len tokens).")


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
  t, _ = shared.timed(lambda: f(x), runs)
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

  from dapo_jax.model import decode, kv_cache
  from dapo_jax.rollout import sampling
  tokens_BP = jnp.asarray(np.random.default_rng(0).integers(0, mc.vocab_size, size=(B, P)).astype(np.int32))
  logits_BV, cache = sampling.prefill(mc, params, tokens_BP, jnp.ones((B, P), bool), cache_size=P + C)
  dt = jnp.dtype(kv_dtype or mc.dtype)
  cache = cache.replace(k=[x.astype(dt) for x in cache.k], v=[x.astype(dt) for x in cache.v])
  dparams = decode.decode_params(mc, params)
  forced = forced_CB is not None
  feed_CB = jnp.asarray(forced_CB) if forced else jnp.zeros((C, B), jnp.int32)

  @jax.jit
  def decode(dparams, cache, logits_BV, feed_CB):
    def body(i, carry):
      cache, logits_BV, tok_CB, logp_CB = carry
      tok_B = feed_CB[i] if forced else jnp.argmax(logits_BV, -1).astype(jnp.int32)
      logp_B = jnp.take_along_axis(jax.nn.log_softmax(logits_BV), tok_B[:, None], 1)[:, 0]
      cache = kv_cache.write_mask(cache, jnp.ones((B, 1), bool), P + i)
      logits_BV, cache = decode.decode_step(mc, dparams, tok_B, jnp.full((B,), P + i), cache, P + i)
      return cache, logits_BV, tok_CB.at[i].set(tok_B), logp_CB.at[i].set(logp_B)
    init = (cache, logits_BV, jnp.zeros((C, B), jnp.int32), jnp.zeros((C, B), jnp.float32))
    _, _, tok_CB, logp_CB = jax.lax.fori_loop(0, C, body, init)
    return tok_CB, logp_CB
  t = shared.timed(lambda: decode(dparams, cache, logits_BV, feed_CB), runs)[0] if runs else float("nan")
  tok_CB, logp_CB = jax.device_get(decode(dparams, cache, logits_BV, feed_CB))
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(dparams))
  kv_bytes = sum(x.nbytes for x in cache.k + cache.v)
  return {"kv_cache_dtype": dt.name, "decode_tokens_per_s": B * C / t, "decode_step_s": t / C,
          "weight_bytes": weight_bytes, "kv_bytes_per_step": kv_bytes,
          "bytes_per_s": (weight_bytes + kv_bytes) / (t / C), "tokens_CB": tok_CB, "logp_CB": logp_CB}


def bench(cfg, peak):
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
         "peak_bf16_flops_per_s": flops_peak or shared.matmul_peak("bfloat16"),
         "peak_bytes_per_s": bw_peak or measured_bandwidth(),
         "peaks": "vendor table" if flops_peak and bw_peak else "measured here (no table entry for this device)"}
  smol = _SMOLLM2_DIR.value if _SMOLLM2_DIR.value and os.path.isdir(_SMOLLM2_DIR.value) else ""
  if smol and not shared.MODEL_DIR.value:
    flags.FLAGS.model_dir = smol  # Decode and train run on SmolLM2 when it is there.
  mc, params = shared.load_model(cfg)
  out["model"] = shared.MODEL_DIR.value or "config (random weights)"
  out["model_params"] = sum(x.size for x in jax.tree.leaves(params))
  B, P, C = _DECODE_BATCH.value, shared.PROMPT_LEN.value, shared.NEW_TOKENS.value
  base = decode_roofline(mc, params, B, P, C, "", shared.RUNS.value)
  bf16 = decode_roofline(mc, params, B, P, C, "bfloat16", shared.RUNS.value)
  forced = decode_roofline(mc, params, B, P, C, "bfloat16", 0, forced_CB=base["tokens_CB"])
  shift = np.abs(forced["logp_CB"] - base["logp_CB"])
  for name, r in (("decode", base), ("decode_bf16_kv", bf16)):
    out[name] = {k: v for k, v in r.items() if k not in ("tokens_CB", "logp_CB")}
    out[name]["roofline_fraction"] = r["bytes_per_s"] / out["peak_bytes_per_s"]
  out["decode"]["shape"] = f"B={B} P={P} C={C}"
  out["bf16_kv_logp_shift"] = {"max": float(shift.max()), "mean": float(shift.mean()),
                               "tokens": int(shift.size)}
  bf16_mc = dataclasses.replace(mc, dtype="bfloat16", matmul_dtype="bfloat16")
  out["train_bf16"] = train.rates(cfg, bf16_mc, params, _TRAIN_BATCH.value, shared.SEQ_LEN.value, shared.RUNS.value,
                                  out["peak_bf16_flops_per_s"])
  out["train_bf16"]["shape"] = f"B={_TRAIN_BATCH.value} T={shared.SEQ_LEN.value}"
  for name, model_dir in (("dapo_step_smollm2", smol), ("dapo_step_30_8m", _MEDIUM_DIR.value)):
    if not (model_dir and os.path.isdir(model_dir) and os.path.exists(_DEVICE_PROMPTS.value)):
      out[name] = {"skipped": f"no model dir {model_dir!r} or prompts {_DEVICE_PROMPTS.value!r}"}
      continue
    r = e2e.dapo_steps(copy.deepcopy(cfg), peak, model_dir, _DEVICE_PROMPTS.value, shared.NUM_PROMPTS.value,
                       shared.GROUP.value, C, max(shared.RUNS.value, 1))
    out[name] = {k: r[k] for k in ("step_s", "rollout_s", "update_s", "runs_step_s", "engine", "slots")}
    out[name]["shape"] = f"{shared.NUM_PROMPTS.value} x {shared.GROUP.value}, {C} new tokens"
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
