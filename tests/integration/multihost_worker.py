"""One process of the multi-host test: `python multihost_worker.py WORKDIR OUT [RANK NPROC PORT]`.

Runs two steps with generation batches, two streamed, and two streamed one step off (step 1 sampled
by the params before update 0); then a vision-language model (each process's prompts' pictures), an
MoE with rollout routing replay (the sampler's records) and difficulty pools over two mixed files of
three prompts (each process's outcomes, by file), with generation batches; each in
WORKDIR/<mode> with results in OUT_<mode>.npz: one process start for all."""
import os
import sys


def main():
  workdir, out = sys.argv[1], sys.argv[2]
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if len(sys.argv) > 3:
    rank, nproc, port = map(int, sys.argv[3:6])
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=rank)

  assert jax.device_count() == 2, jax.devices()
  for mode in MODES:
    run(config(mode, workdir), os.path.join(workdir, mode), f"{out}_{mode}.npz")
  print("done", jax.process_index())


MODES = ("generation_batches", "streaming", "one_step_off", "vision_language", "routing_replay", "curriculum")


def config(mode: str, workdir: str):
  import json

  from configs import dapo_qwen2_5_32b, vlm_count_shapes

  if mode == "vision_language":
    cfg = vlm_count_shapes.get_config("runlocal")
    cfg.model.init = "random"
  else:
    cfg = dapo_qwen2_5_32b.get_config("runlocal")
  if mode == "routing_replay":
    cfg.model.update(arch="qwen3_moe", qk_norm=True, num_experts=4, experts_per_token=2, expert_mlp_dim=32,
                     norm_topk_prob=True, router_replay="R3")
  if mode == "curriculum":  # Six prompts in two files: a step draws each more than once, so the pools act.
    os.makedirs(workdir, exist_ok=True)
    files = (os.path.join(workdir, "a.jsonl"), os.path.join(workdir, "b.jsonl"))
    for k, path in enumerate(files):
      with open(f"{path}.{os.getpid()}", "w") as f:  # Every process writes it; each whole, by its rename.
        for i in range(3 * k, 3 * k + 3):
          f.write(json.dumps({"data_source": "math_dapo", "prompt": [{"role": "user", "content": f"What is {i}+1?"}],
                              "reward_model": {"ground_truth": str(i + 1), "style": "rule"}}) + "\n")
      os.replace(f"{path}.{os.getpid()}", path)
    cfg.data.update(task="file", train_files=files, train_weights=(1.0, 1.0), eval_files=files[:1], num_eval=2,
                    curriculum=True, revisit_after=1)
    cfg.rollout.group_size = 2  # Groups of two often agree: their prompts go aside.
  cfg.reward.fn = "dapo_jax.testing:length_reward"
  cfg.train.update(num_steps=2, ckpt_every=2, eval_every=0)
  cfg.mesh.update(data=-1, fsdp=1, tensor=1)
  cfg.dapo.streaming = mode in ("streaming", "one_step_off")  # Every host runs the same streamed step.
  cfg.rollout.max_staleness = int(mode == "one_step_off")
  return cfg


def run(cfg, workdir, out):
  import jax
  import numpy as np

  from dapo_jax import builders, metrics, sharding

  with builders.dapo(cfg, workdir) as dapo:
    dapo.run()
    params = sharding.fetch(dapo.state.params)
    vision_prompts = dapo.rollout.vision_prompts  # this process's prompts whose pictures the tower read
  if jax.process_index() == 0:
    flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    recs = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    keys = sorted(k for k in recs[1] if not k.startswith(("timing_s/", "perf/")) and isinstance(recs[1][k], (int, float))
                  and k not in ("rollout/max_in_flight", "rollout/slot_utilisation", "time"))
    np.savez(out, losses=np.array([recs[s]["actor/pg_loss"] for s in (1, 2)]), vision_prompts=vision_prompts,
             metric_names=np.array(keys), metrics=np.array([[recs[s].get(k, np.nan) for k in keys] for s in (1, 2)],
                                                           np.float64), **flat)


if __name__ == "__main__":  # Reward-pool workers are spawned and re-import this file.
  main()
