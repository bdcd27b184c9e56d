"""One process of the multi-host test: `python multihost_worker.py WORKDIR OUT [RANK NPROC PORT]`.

Runs two steps with generation batches, two streamed, and two streamed one step off (step 1 sampled
by the params before update 0), each in WORKDIR/<mode> with results in OUT_<mode>.npz: one process
start and one compile of the update for all."""
import os
import sys


def main():
  workdir, out = sys.argv[1], sys.argv[2]
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if len(sys.argv) > 3:
    rank, nproc, port = map(int, sys.argv[3:6])
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=rank)

  from configs import dapo_qwen2_5_32b

  assert jax.device_count() == 2, jax.devices()
  for mode in ("generation_batches", "streaming", "one_step_off"):
    cfg = dapo_qwen2_5_32b.get_config("runlocal")
    cfg.reward.fn = "dapo_jax.testing:length_reward"
    cfg.train.update(num_steps=2, ckpt_every=2, eval_every=0)
    cfg.mesh.update(data=-1, fsdp=1, tensor=1)
    cfg.dapo.streaming = mode != "generation_batches"  # Every host runs the same streamed step.
    cfg.rollout.max_staleness = int(mode == "one_step_off")
    run(cfg, os.path.join(workdir, mode), f"{out}_{mode}.npz")
  print("done", jax.process_index())


def run(cfg, workdir, out):
  import jax
  import numpy as np

  from dapo_jax import builders, metrics, sharding

  with builders.dapo(cfg, workdir) as dapo:
    dapo.run()
    params = sharding.fetch(dapo.state.params)
  if jax.process_index() == 0:
    flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    recs = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    keys = sorted(k for k in recs[1] if not k.startswith(("timing_s/", "perf/")) and isinstance(recs[1][k], (int, float))
                  and k not in ("rollout/max_in_flight", "rollout/slot_utilisation", "time"))
    np.savez(out, losses=np.array([recs[s]["actor/pg_loss"] for s in (1, 2)]),
             metric_names=np.array(keys), metrics=np.array([[recs[s].get(k, np.nan) for k in keys] for s in (1, 2)],
                                                           np.float64), **flat)


if __name__ == "__main__":  # Reward-pool workers are spawned and re-import this file.
  main()
