"""Peak RSS and live array bytes of SmolLM2-135M DAPO, full or LoRA, over 3 rollout steps (no
evaluation, no checkpoint), RSS sampled every 0.2 s. Run from the repository root:

  python docs/scripts/memory_phases.py ""     # full fine-tune
  python docs/scripts/memory_phases.py lora   # configs/smollm2_135m_arith.py:lora
  TRIM=0 python docs/scripts/memory_phases.py lora   # without returning freed memory between phases
  RUN=1 python docs/scripts/memory_phases.py lora    # the whole loop for 2 steps: evaluations at 0
                                                     # and 2, a checkpoint at 2
"""
import os
import shutil
import sys
import threading
import time

sys.path.insert(0, os.getcwd())
arg = sys.argv[1]  # "" or "lora"
def rss():
  for l in open('/proc/self/status'):
    if l.startswith('VmRSS'): return int(l.split()[1]) / 2**20
def hwm():
  for l in open('/proc/self/status'):
    if l.startswith('VmHWM'): return int(l.split()[1]) / 2**20
def live():
  import jax
  return sum(a.nbytes for a in jax.live_arrays()) / 2**30
peak = [0.0, 0.0]  # [since the last phase end, whole run]
def sampler():
  while True:
    peak[0] = max(peak[0], rss()); time.sleep(0.2)
def report(tag):
  print(f"{tag:40s} rss {rss():.2f} GB  hwm {hwm():.2f}  live {live():.2f} GB", flush=True)
def main():
  threading.Thread(target=sampler, daemon=True).start()
  from configs import smollm2_135m_arith as C
  from dapo_jax import builders, sharding
  report('imports')
  cfg = C.get_config('lora' if arg == 'lora' else None)
  whole_run = os.environ.get('RUN') == '1'
  with cfg.unlocked():
    cfg.train.update(eval_every=2 if whole_run else 0, ckpt_every=2 if whole_run else 0,
                     num_steps=2 if whole_run else 3)
  wd = f'/tmp/memory_phases_{arg or "full"}'
  shutil.rmtree(wd, ignore_errors=True)
  with builders.dapo(cfg, wd, sharding.make_mesh(cfg.mesh)) as d:
    report('built (params, trainer, rollout)')
    from dapo_jax import host_memory
    trim = os.environ.get('TRIM') != '0'  # TRIM=0: undo the loop's host_memory.release calls.
    release = host_memory.release
    def phase_end(*args, **kwargs):  # The loop calls release after each rollout, update and evaluation.
      caller = sys._getframe(1)  # loop.DAPO.step (after the rollout, after the update) or .evaluate
      print(f"  phase peak {peak[0]:.2f} GB hwm {hwm():.2f} (since the previous phase; ended at {caller.f_code.co_name}:"
            f"{caller.f_lineno})", flush=True)
      peak[1] = max(peak[1], peak[0]); peak[0] = rss()
      return release(*args, **kwargs) if trim else False
    host_memory.release = phase_end
    peak[1] = peak[0]; peak[0] = rss()
    if whole_run:
      d.run()
      report('run (evaluations, checkpoint)')
    for s in range(1, 1 if whole_run else 4):
      m = d.step(s)[0]
      report(f'step {s} {m["timing_s/step"]:.1f}s gen {m["timing_s/gen"]:.1f} upd {m["timing_s/update_actor"]:.1f}')
  print('sampled peak rss', round(max(peak), 2), 'hwm', round(hwm(), 2))

if __name__ == '__main__':
  main()
