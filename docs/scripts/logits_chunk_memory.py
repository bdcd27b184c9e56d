"""Peak host memory of one policy-gradient update (loss and gradients) with a Gemma-3-sized
vocabulary, with and without `model.logits_chunk`. Each setting runs in a fresh process.

  python docs/scripts/logits_chunk_memory.py            # prints one JSON line per setting
"""
import json
import resource
import subprocess
import sys

CHILD = r'''
import dataclasses, json, resource, sys
import jax, numpy as np
from dapo_jax import objectives, testing
from dapo_jax.datatypes import RLBatch
from dapo_jax.model import transformer as model_lib
chunk = int(sys.argv[1])
V, B, P, C = 262_144, 16, 16, 64
cfg = dataclasses.replace(testing.tiny_model_config(vocab_size=V, embed_dim=64, mlp_dim=128), logits_chunk=chunk)
params = model_lib.init_params(cfg, jax.random.key(0))
rng = np.random.default_rng(0)
b = RLBatch(tokens_BT=rng.integers(0, V, size=(B, P + C)).astype(np.int32), mask_BT=np.ones((B, P + C), bool),
            loss_mask_BC=np.ones((B, C), bool), old_logp_BC=np.full((B, C), -12.0, np.float32),
            adv_B=rng.normal(size=B).astype(np.float32), ref_logp_BC=np.zeros((B, C), np.float32))
obj = objectives.policy_gradient(cfg, objectives.PGConfig())
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
(loss, _), g = jax.jit(jax.value_and_grad(lambda p: obj.loss(p, b, obj.counts(b)), has_aux=True))(params)
jax.block_until_ready(g)
print(json.dumps({"logits_chunk": chunk, "loss": float(loss), "peak_rss_gb": resource.getrusage(
    resource.RUSAGE_SELF).ru_maxrss / 2**20, "rss_before_update_gb": before / 2**20,
    "logits_BCV_gb": B * C * V * 4 / 2**30}))
'''

if __name__ == "__main__":
  for chunk in (0, 8):
    out = subprocess.run([sys.executable, "-c", CHILD, str(chunk)], capture_output=True, text=True)
    print(out.stdout.strip() or out.stderr[-2000:])
