"""Peak host memory of one policy-gradient update (loss and gradients) with a Gemma-3-sized
vocabulary, with and without `model.logits_chunk`. Each setting runs in a fresh process.

  python docs/scripts/logits_chunk_memory.py            # a 64-wide, 2-layer model, V = 262,144
  python -m launch.prepare gemma3_270m --out=/tmp/gemma3
  python docs/scripts/logits_chunk_memory.py /tmp/gemma3  # Gemma 3 270M itself
Prints one JSON line per setting.
"""
import subprocess
import sys

CHILD = r'''
import dataclasses, json, resource, sys, time
import jax, numpy as np
from dapo_jax import objectives, testing
from dapo_jax.datatypes import RLBatch
from dapo_jax.model import transformer as model_lib
model_dir, chunk = sys.argv[1], int(sys.argv[2])
if model_dir:  # A real model (fp32), 64 prompt tokens.
  from dapo_jax.hf import convert as hf
  cfg, params = hf.load(model_dir)
  B, P, C = 16, 64, 64
else:
  cfg = testing.tiny_model_config(vocab_size=262_144, embed_dim=64, mlp_dim=128)
  params = model_lib.init_params(cfg, jax.random.key(0))
  B, P, C = 16, 16, 64
cfg, V = dataclasses.replace(cfg, logits_chunk=chunk), cfg.vocab_size
rng = np.random.default_rng(0)
b = RLBatch(tokens_BT=rng.integers(0, V, size=(B, P + C)).astype(np.int32), mask_BT=np.ones((B, P + C), bool),
            loss_mask_BC=np.ones((B, C), bool), old_logp_BC=np.full((B, C), -12.0, np.float32),
            adv_B=rng.normal(size=B).astype(np.float32), ref_logp_BC=np.zeros((B, C), np.float32))
obj = objectives.policy_gradient(cfg, objectives.PGConfig())
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
(loss, _), g = jax.jit(jax.value_and_grad(lambda p: obj.loss(p, b, obj.counts(b)), has_aux=True))(params)
jax.block_until_ready(g)
gnorm = float(np.sqrt(sum(float(np.sum(np.square(np.asarray(x, np.float64)))) for x in jax.tree.leaves(g))))
print(json.dumps({"logits_chunk": chunk, "loss": float(loss), "grad_norm": gnorm,
                  "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
                  "rss_before_update_gb": round(before / 2**20, 2), "logits_BCV_gb": B * C * V * 4 / 2**30,
                  "compile_and_step_s": round(time.perf_counter() - t, 1)}))
'''

if __name__ == "__main__":
  model_dir = sys.argv[1] if len(sys.argv) > 1 else ""
  for chunk in (0, 16 if model_dir else 8):
    out = subprocess.run([sys.executable, "-c", CHILD, model_dir, str(chunk)], capture_output=True, text=True)
    print(out.stdout.strip() or out.stderr[-2000:], flush=True)
