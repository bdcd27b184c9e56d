"""Adaptive entropy control (TRL's use_adaptive_entropy, Skywork-OR1): the controller by hand, an
update's loss against the static bonus at the coefficient it applied, the accumulating path alike,
and a run resumed after its checkpoint moving the coefficient as the run that did not stop."""
import dataclasses
import os

import jax
import numpy as np
import pytest

from configs import default
from dapo_jax import builders, metrics, objectives
from tests.train_step_test import CFG, LINEAR_OPT, make_batch, make_trainer


def test_the_controller_by_hand():
  c = objectives.EntropyControl(target=1.0, delta=0.1, coef_min=0.0, coef_max=0.25, initial=0.05)
  s = c.init()
  assert float(c.applied(s)) == 0.0  # No measurement yet: no bonus.
  coefs, applied = [], []
  for entropy in (0.5, 0.9, 1.0, 3.0, 0.2, 0.2):
    s = c.update(s, np.float32(entropy))
    coefs.append(float(s["entropy_coef"]))
    applied.append(float(c.applied(s)))
  np.testing.assert_allclose(coefs, [0.15, 0.25, 0.25, 0.15, 0.25, 0.25], rtol=1e-6)  # Capped at coef_max.
  np.testing.assert_allclose(applied, [0.15, 0.25, 0.25, 0.0, 0.25, 0.25], rtol=1e-6)  # None after 3.0 > target.
  s = c.update(c.update(c.update(s, np.float32(5.0)), np.float32(5.0)), np.float32(5.0))
  assert float(s["entropy_coef"]) == 0.0  # Floored at coef_min.


@pytest.mark.parametrize("accumulate", [False, True])
def test_each_update_applies_the_controllers_coefficient_and_moves_it(accumulate):
  """Target above any entropy: the coefficient grows by delta per update (TRL's test), and each
  update's loss is the static bonus's loss at the coefficient it applied."""
  pg = objectives.PGConfig(use_adaptive_entropy=True, entropy_coeff=0.01, entropy_target=50.0,
                           entropy_coef_delta=0.02)
  trainer = make_trainer(CFG, LINEAR_OPT, pg=pg)
  state = trainer.init(jax.random.key(0))
  batch = make_batch()
  seen = []
  for _ in range(3):
    params = jax.device_get(state.params)  # the step donates the state
    if accumulate:
      half = jax.tree.map(lambda x: x[:4], batch), jax.tree.map(lambda x: x[4:], batch)
      state, m = trainer.accumulate_step(state, [trainer.put_batch(b) for b in half])
    else:
      state, m = trainer.step(state, trainer.put_batch(batch))
    m = jax.device_get(m)
    seen.append((float(m["entropy_coef_applied"]), float(m["entropy_coef"])))
    # The same update's loss with the bonus fixed at the applied coefficient.
    static = objectives.policy_gradient(CFG, dataclasses.replace(pg, use_adaptive_entropy=False,
                                                                 entropy_coeff=float(m["entropy_coef_applied"])))
    want = static.loss(params, batch, static.counts(batch))[0]
    np.testing.assert_allclose(m["loss"], want, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(seen, [(0.0, 0.03), (0.03, 0.05), (0.05, 0.07)], rtol=1e-5)


def run_cfg(steps):
  cfg = default.get_config("runlocal")
  cfg.model.init = "random"
  cfg.reward.update(fn="dapo_jax.testing:length_reward", workers=1)
  cfg.dapo.update(use_adaptive_entropy=True, entropy_coeff=0.001, entropy_target=5.8, entropy_coef_delta=0.001)
  cfg.train.update(num_steps=steps, eval_every=0, log_samples_every=0, ckpt_every=1)
  cfg.data.num_eval = 0
  return cfg


def test_a_resumed_run_carries_the_controller(tmp_path):
  straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
  builders.run(run_cfg(3), straight)
  builders.run(run_cfg(2), split)
  builders.run(run_cfg(3), split)  # resumes after step 2
  a = metrics.read_jsonl(os.path.join(straight, "metrics.jsonl"))
  b = metrics.read_jsonl(os.path.join(split, "metrics.jsonl"))
  got = [b[s]["actor/entropy_coef"] for s in (1, 2, 3)]
  np.testing.assert_allclose(got, [a[s]["actor/entropy_coef"] for s in (1, 2, 3)], rtol=1e-6)
  assert np.all(np.diff(got) > 0), got  # entropy (~5.76) below the target: the coefficient grew every update
