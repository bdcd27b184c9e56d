"""`bench async`: a split mesh's rollout and train phases, measured in synchronous steps, and the
asynchronous step time they predict for each staleness."""
import os
import shutil
import statistics
import tempfile
import time

from absl import flags

from . import shared

_ROLLOUT_DEVICES = flags.DEFINE_integer("rollout_devices", 0, "async: devices that decode (default: half).")
_WARM_START = flags.DEFINE_string("warm_start", "", "async: a workdir whose sft_model (and tokenizer) the run "
                                  "starts from instead of running SFT.")


def bench(cfg, peak):
  """Phase times of synchronous rollout steps on a split mesh (`mesh.rollout_devices`: the first R
  devices decode, the rest train) and the step time `pipelining.schedule_seconds` predicts from
  them for `rollout.max_staleness` = 0, 1, 2, 4 when the two sides never slow each other (what
  disjoint chips give; on forced CPU devices the sides share the cores, so only the phases are
  measured). Rollout = the whole `collect` (policy copy, prefill, decode, scoring, dynamic
  sampling); train = the rest of the step (advantages, π_old, update, metrics)."""
  import jax

  from dapo_jax import builders, pipelining
  R = _ROLLOUT_DEVICES.value or jax.device_count() // 2
  if not 0 < R < jax.device_count():
    raise SystemExit(f"--rollout_devices={R}: expected 1..{jax.device_count() - 1} of {jax.device_count()} devices "
                     "(more devices on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  runs = shared.RUNS.value
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
  with builders.dapo(cfg, tmp) as dapo:
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
