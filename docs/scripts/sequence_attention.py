"""Gathered keys against a ring (`model.sequence_attention`) on 8 forced host devices (fsdp 2, sequence 4):
one packed row of T tokens per fsdp shard through the update, interleaved A B A B; each variant's median
update time and XLA's temporaries per device. Run from the repository root:

  python docs/scripts/sequence_attention.py [T]   # T = 8192 by default
"""
import os
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.getcwd())
RUNS = 3


def main():
  import dataclasses

  import jax
  import numpy as np

  from dapo_jax import objectives, optim, packing, sharding, testing, train_step
  from dapo_jax.datatypes import RLBatch
  T = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
  cfg = testing.tiny_model_config(vocab_size=256, embed_dim=128, mlp_dim=384, num_heads=4, num_kv_heads=2,
                                  head_dim=32)
  cfg = dataclasses.replace(cfg, attn_chunk=512, remat="dots")
  mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "sequence": 4, "tensor": 1})
  rows, C = 2, T - 64
  rng = np.random.default_rng(0)
  host = RLBatch(tokens_BT=rng.integers(4, 250, (rows, T)).astype(np.int32), mask_BT=np.ones((rows, T), bool),
                 loss_mask_BC=np.ones((rows, C), bool), old_logp_BC=np.full((rows, C), -5.0, np.float32),
                 adv_B=np.array([1.0, -1.0], np.float32), ref_logp_BC=np.zeros((rows, C), np.float32))
  batch = packing.packed_microbatches(host, max_tokens=T, shards=2, block=0)[0]
  trainers, states, times = {}, {}, {}
  for how in ("gather", "ring"):
    mc = dataclasses.replace(cfg, sequence_attention=how)
    trainers[how] = train_step.Trainer(mc, optim.OptimConfig(lr=1e-4, warmup_steps=0), mesh,
                                       objectives.policy_gradient(mc, objectives.PGConfig()), num_microbatches=0)
    states[how] = trainers[how].init(jax.random.key(0))
    temp = trainers[how].compiled_step_memory(batch).temp_size_in_bytes
    print(f"{how}: temporaries per device {temp / 2**30:.3f} GB")
    times[how] = []
  for _ in range(RUNS + 1):  # The first run of each compiles.
    for how, trainer in trainers.items():
      placed = trainer.put_batch(batch)
      t0 = time.perf_counter()
      states[how], metrics = trainer.step(states[how], placed)
      jax.block_until_ready(metrics)
      times[how].append(time.perf_counter() - t0)
      loss = float(metrics["pg_loss"])
    print(f"  loss {loss:.6f}")
  for how, ts in times.items():
    print(f"{how}: T={T}, median update {np.median(ts[1:]):.3f} s over {RUNS} runs")


if __name__ == "__main__":
  main()
