"""`rollout.kv_cache_dtype`: the engine's keys and values stored in bfloat16 under an fp32 model.

The sampler's log-probs on its own samples are compared with the fp32 training forward on the same
rows (what the update's importance ratio divides by). The fp32 cache agrees to rounding; the bf16
cache moves log-probs by the rounding of keys and values (8 mantissa bits): on this tiny model (2
layers, D = 32, peaked distributions) the measured max |Δ logp| over 20 samples of up to 12 tokens
is 1.4e-4 (asserted below 1e-3), its mean 1.6e-5. Deeper, wider models accumulate more;
`launch.bench device` reports the shift on its workload.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax import objectives, testing
from dapo_jax.datatypes import RLBatch
from dapo_jax.rollout import engine, sampling

CFG = testing.tiny_model_config(vocab_size=64)
PARAMS = testing.sharp_params(CFG, seed=2)


def _logp_shift(kv_cache_dtype: str) -> np.ndarray:
  """|sampler logp - fp32 teacher-forced logp| over the real completion tokens of 5 x 4 samples."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(4, 64, size=(5, 7)).astype(np.int32)
  mask = np.ones((5, 7), bool)
  mask[1, :3] = False  # Left padding.
  G, C = 4, 12
  sc = sampling.SamplerConfig(max_new_tokens=C, temperature=1.0, eos_ids=(5,), pad_id=0)
  e = engine.Engine(CFG, sc, slots=8, prompt_len=7, kv_cache_dtype=kv_cache_dtype)
  assert e.empty_state().cache.k[0].dtype == jnp.dtype(kv_cache_dtype or CFG.dtype)
  out, _ = e.generate(PARAMS, tokens, mask, G, jax.random.key(1))
  batch = RLBatch(tokens_BT=np.concatenate([np.repeat(tokens, G, 0), out.tokens_BC], 1),
                  mask_BT=np.concatenate([np.repeat(mask, G, 0), out.mask_BC], 1), loss_mask_BC=out.mask_BC,
                  old_logp_BC=out.logp_BC, adv_B=np.zeros(len(out.length_B), np.float32), ref_logp_BC=out.logp_BC)
  logp = np.asarray(objectives.completion_logprobs(CFG, 1.0)(PARAMS, batch))
  return np.abs(logp - out.logp_BC)[out.mask_BC]


@pytest.mark.parametrize("dtype,bound", [("", 2e-5), ("float32", 2e-5), ("bfloat16", 1e-3)])
def test_sampler_logp_against_the_fp32_forward(dtype, bound):
  shift = _logp_shift(dtype)
  print(f"kv_cache_dtype={dtype or 'model'}: max |dlogp| {shift.max():.2e}, mean {shift.mean():.2e}")
  assert shift.max() < bound
  if dtype == "bfloat16":  # The cache really is narrower: the shift is bf16 rounding, not zero.
    assert shift.max() > 1e-5
