"""The update of SmolLM2-135M's arithmetic recipe on its own first rollout batch, padded (the recipe's
layout) and packed (`train.packing=True`, block pairs), interleaved A B A B: the positions each layout
computes and the update's median time. Run from the repository root (the recipe's GGUF install):

  python docs/scripts/update_layouts.py
"""
import dataclasses
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.getcwd())
RUNS = 4


def main():
  import numpy as np

  from configs import smollm2_135m_arith as recipe
  from dapo_jax import builders, loop, packing, sharding, train_step
  cfg = recipe.get_config()
  with cfg.unlocked():
    cfg.train.update(eval_every=0, ckpt_every=0, num_steps=1)
  batches, update = [], loop.DAPO.update
  loop.DAPO.update = lambda self, batch, *a, **k: batches.append(batch) or update(self, batch, *a, **k)
  workdir = tempfile.mkdtemp()
  try:
    with builders.dapo(cfg, workdir, sharding.make_mesh(cfg.mesh)) as d:
      d.step(1)
      batch, padded_cfg = batches[0], d.cfg
      G, trainer = d.trainer.group_size, d.trainer
      prefixed = train_step.shared_prefix_layout(batch, G, d.shared_prefix)
      B, C = batch.loss_mask_BC.shape
      M = trainer.microbatches_for(prefixed)  # Each micro-batch runs the common beginning once.
      rows = {"padded": M * prefixed.prefix_len + B // G * prefixed.suffix_len + B * C,
              "packed": sum(int((p.packed.segments_MT > 0).sum())
                            for p in packing.packed_microbatches(batch, **d.pack_args()))}
      times = {"padded": [], "packed": []}
      for run in range(RUNS + 1):  # The first run of each compiles.
        for name in times:
          d.cfg = dataclasses.replace(padded_cfg, packing=name == "packed")
          t0 = time.perf_counter()
          d.update(batch, have_logprobs=True)
          if run:
            times[name].append(time.perf_counter() - t0)
      real = int(np.asarray(batch.loss_mask_BC).sum())
      print(f"{B} rows, {real} completion tokens; positions computed: padded {rows['padded']} ({M} "
            f"micro-batches), packed "
            f"{rows['packed']}")
      for name, t in times.items():
        print(f"{name}: median update {np.median(t):.2f} s ({', '.join(f'{x:.2f}' for x in t)})")
  finally:
    loop.DAPO.update = update
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
  main()
