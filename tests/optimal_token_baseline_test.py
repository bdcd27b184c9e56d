"""The optimal token baseline in a run: Σπ² from the policy's own pass (against a softmax of the model's
logits), and a packed run equal to the padded one (verl parity: verl_reference_test)."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from dapo_jax import builders, loss, metrics, objectives, testing
from dapo_jax.datatypes import RLBatch
from dapo_jax.model import transformer as model_lib


def test_sum_pi_squared_by_hand():
  z = jnp.array([[[0.0, 0.0, 0.0, 0.0], [10.0, -10.0, -10.0, -10.0], [1.0, 2.0, 3.0, 4.0]]])
  p = np.exp([1.0, 2.0, 3.0, 4.0]) / np.exp([1.0, 2.0, 3.0, 4.0]).sum()
  np.testing.assert_allclose(loss.sum_pi_squared(z)[0], [0.25, 1.0, (p ** 2).sum()], rtol=1e-5)


@pytest.mark.parametrize("chunk", [0, 4])
def test_the_pass_gives_the_log_probs_and_sum_pi_squared_of_the_models_logits(chunk):
  cfg = testing.tiny_model_config(logits_chunk=chunk)
  params = model_lib.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  B, P, C, T = 4, 3, 6, 1.3
  tokens = rng.integers(1, cfg.vocab_size, size=(B, P + C)).astype(np.int32)
  mask = np.ones((B, P + C), bool)
  batch = RLBatch(tokens_BT=tokens, mask_BT=mask, loss_mask_BC=np.ones((B, C), bool),
                  old_logp_BC=np.zeros((B, C), np.float32), adv_B=np.zeros(B, np.float32),
                  ref_logp_BC=np.zeros((B, C), np.float32))
  both = np.asarray(objectives.completion_logprobs_and_sum_pi_squared(cfg, T)(params, batch))
  logp = np.asarray(objectives.completion_logprobs(cfg, T)(params, batch))
  z = np.asarray(model_lib.logits(cfg, params, tokens, mask), np.float64)[:, P - 1:-1] / T
  pi = np.exp(z - z.max(-1, keepdims=True))
  pi /= pi.sum(-1, keepdims=True)
  np.testing.assert_allclose(both[..., 0], logp, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(both[..., 1], (pi ** 2).sum(-1), rtol=1e-4)
  np.testing.assert_allclose(both[..., 0], np.log(np.take_along_axis(pi, tokens[:, P:, None], -1)[..., 0]),
                             rtol=1e-4, atol=1e-5)


def otb_cfg(**train):
  cfg = default.get_config("runlocal")
  cfg.model.init = "random"
  cfg.reward.update(fn="dapo_jax.testing:length_reward", workers=1)
  cfg.dapo.adv_estimator = "optimal_token_baseline"
  cfg.train.update(eval_every=0, log_samples_every=0, **train)
  cfg.data.num_eval = 0
  return cfg


def test_a_packed_run_is_the_padded_run(tmp_path):
  """Two steps padded and packed: every logged value the same (the Σπ² pass included)."""
  logged = {}
  for packing in (False, True):
    workdir = str(tmp_path / str(packing))
    builders.run(otb_cfg(num_steps=2, packing=packing, num_microbatches=0), workdir)
    logged[packing] = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  for step in (1, 2):
    padded, packed = logged[False][step], logged[True][step]
    assert np.isfinite(padded["actor/pg_loss"]) and "critic/returns/mean" in padded, sorted(padded)
    for k, v in padded.items():
      if not k.startswith(("timing_s/", "perf/", "time")):
        assert packed[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (step, k)


def test_rollout_importance_weights_scale_the_baseline(tmp_path):
  """`dapo.rollout_correction.rollout_is`: the advantage pass weighs each step's path variance by its
  squared IS weight (verl's rollout_is_weights). IcePop with a band that holds every token's ratio
  leaves the step's advantages as they were; a band so narrow that it zeroes most weights moves them."""
  def advantages_of(band):
    cfg = otb_cfg(num_steps=1)
    cfg.rollout.kv_cache_dtype = "bfloat16"  # The sampler's log-probs part from the update's.
    if band:
      cfg.dapo.rollout_correction.update(rollout_is="token", rollout_is_threshold=band)
    workdir = str(tmp_path / (band or "off"))
    builders.run(cfg, workdir)
    step = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))[1]
    return {k: v for k, v in step.items() if k.startswith("critic/advantages/")}
  off, wide, narrow = advantages_of(""), advantages_of("0.001_1000"), advantages_of("0.99999_1.00001")
  assert off and off.keys() == wide.keys() == narrow.keys()
  for k in off:
    assert wide[k] == pytest.approx(off[k], rel=1e-3, abs=1e-4), k
  assert any(abs(narrow[k] - off[k]) > 1e-3 for k in off), (off, narrow)
