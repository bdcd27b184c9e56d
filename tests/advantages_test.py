"""Group advantages (Eq. 9, unbiased std + 1e-6) and the dynamic-sampling keep mask (§2.2)."""
import numpy as np
import pytest

from dapo_jax import advantages


def test_sanity_formula_g16_k1():
  r = -np.ones((1, 16))
  r[0, 3] = 1.0
  adv = advantages.group_advantages(r)
  # DAPO_SPEC §1.4: +3.75 / -0.25 before the epsilon.
  assert adv[0, 3] == pytest.approx(3.75, abs=1e-5)
  assert np.delete(adv[0], 3) == pytest.approx(-0.25, abs=1e-6)


def test_against_loop_reference():
  rng = np.random.default_rng(0)
  r = rng.normal(size=(5, 7))
  adv = advantages.group_advantages(r)
  for q in range(5):
    m = sum(r[q]) / 7
    s = (sum((x - m) ** 2 for x in r[q]) / 6) ** 0.5
    np.testing.assert_allclose(adv[q], [(x - m) / (s + 1e-6) for x in r[q]], rtol=1e-5)
  np.testing.assert_allclose(advantages.group_advantages(r, norm_by_std=False),
                             r - r.mean(1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_equal_rewards_give_zero_and_single_sample_groups():
  assert (advantages.group_advantages(np.ones((2, 4))) == 0).all()
  # A group of one: mean 0, std 1 (then the epsilon), as the reference does.
  np.testing.assert_allclose(advantages.group_advantages(np.array([[0.5], [-1.0]])),
                             np.array([[0.5], [-1.0]]) / (1 + 1e-6), rtol=1e-7)


def test_keep_groups_uses_correctness():
  acc = np.array([[1, 1, 1], [0, 0, 0], [1, 0, 0], [0, 1, 1]], bool)
  np.testing.assert_array_equal(advantages.keep_groups(acc), [False, False, True, True])
  np.testing.assert_array_equal(advantages.keep_groups(np.array([[True], [False]])), [True, True])
