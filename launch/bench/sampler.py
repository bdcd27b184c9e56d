"""`bench sampler`: decode throughput and MFU of the sampler on random prompts, data-parallel over
every local device."""
from . import shared


def bench(cfg, peak):
  import jax
  import numpy as np

  from dapo_jax import sharding
  from dapo_jax.rollout import sampling
  mc, params = shared.load_model(cfg)
  # LoRA: each call decodes its int8 base unmerged or merges a float one.
  params = shared.adapted(cfg, mc, params)
  B, P, C = shared.BATCH.value, shared.PROMPT_LEN.value, shared.NEW_TOKENS.value
  # Data-parallel over every local device, as the training loop's rollouts are; params resident.
  mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
  if B % mesh.size:
    raise ValueError(f"--batch={B} must be divisible by the {mesh.size} local devices it is split over")
  params = jax.device_put(params, sharding.replicated(mesh))
  tokens = np.random.default_rng(0).integers(0, mc.vocab_size, size=(B, P)).astype(np.int32)
  tokens, mask = sharding.put((tokens, np.ones((B, P), bool)), sharding.named(mesh, "BT"))
  # No EOS: every row generates exactly C tokens, as the peers' min_new_tokens does.
  sc = sampling.SamplerConfig(max_new_tokens=C, temperature=1.0, top_p=1.0, eos_ids=())
  runs = shared.RUNS.value
  keys = iter(jax.random.split(jax.random.key(0), runs + 1))
  t, times = shared.timed(lambda: sampling.generate(mc, sc, params, tokens, mask, next(keys)).tokens_BC, runs)
  flops = (2 * shared.matmul_params(mc) * B * (P + C) + shared.attention_flops(mc, B * P, P + C)
           + shared.attention_flops(mc, B * C, P + C))
  return {"bench": "sampler", "new_tokens_per_s": B * C / t, "median_s": t, "runs_s": times,
          "model_flops_per_s": flops / t, "mfu": flops / t / peak}
