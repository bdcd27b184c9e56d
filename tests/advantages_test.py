"""Group advantages (Eq. 9, unbiased std + 1e-6) and the dynamic-sampling keep mask (§2.2)."""
import numpy as np
import pytest

from dapo_jax import advantages
from dapo_jax.rollout import dynamic_sampling
from dapo_jax.rollout import rollout as rollout_lib


def test_sanity_formula_g16_k1():
  r = -np.ones((1, 16))
  r[0, 3] = 1.0
  adv = advantages.group_advantages(r)
  # verl's compute_grpo_outcome_advantage: +3.75 / -0.25 before the epsilon.
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
  np.testing.assert_array_equal(dynamic_sampling.keep_groups(acc), [False, False, True, True])
  np.testing.assert_array_equal(dynamic_sampling.keep_groups(np.array([[True], [False]])), [True, True])


def test_filter_metrics_follow_verl():
  """Two groups of 2: same correctness, scores that differ, and an overlong penalty on one sample."""
  acc = np.array([[True, True], [False, True]])
  score = np.array([[1.0, 0.5], [-1.0, 1.0]])      # e.g. a partial-credit scorer
  penalty = np.array([[0.0, 0.0], [0.0, -2.0]])
  reward = score + penalty                          # [[1, .5], [-1, -1]]: what advantages use
  kw = dict(acc_QG=acc, score_QG=score, reward_QG=reward)
  keep = {m: dynamic_sampling.keep_groups(rollout_lib.filter_values(m, **kw)).tolist()
          for m in rollout_lib.FILTER_METRICS}
  assert keep == {"acc": [False, True], "score": [True, True], "seq_reward": [True, False],
                  "seq_final_reward": [True, False]}
  with pytest.raises(ValueError, match="dapo.filter_metric='reward'"):
    rollout_lib.filter_values("reward", **kw)


def test_keep_groups_of_equal_floats():
  """Equal non-representable floats are one value, whatever np.std's rounding says."""
  v = np.full((1, 3), 0.1)
  assert v.std(axis=1)[0] > 0   # The rounding that a std > 0 test would trip over.
  assert not dynamic_sampling.keep_groups(v)[0]
  assert dynamic_sampling.keep_groups(np.array([[0.1, 0.1, 0.1 + 1e-12]]))[0]


def test_opo_gpg_and_reinforce_pp_baseline_by_hand():
  r = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
  n = np.array([[2, 6, 4], [1, 1, 1]])
  # OPO: the baseline is the length-weighted mean, 2/12 in group 0.
  np.testing.assert_allclose(advantages.sequence_advantages("opo", r, lengths_QG=n)[0], [5 / 6, -1 / 6, -1 / 6],
                             rtol=1e-6)
  # GPG: α = 6 responses / 1 non-zero reward.
  np.testing.assert_allclose(advantages.sequence_advantages("gpg", r)[0], 6 * (r[0] - 1 / 3), rtol=1e-6)
  # REINFORCE++-baseline: R - mean, whitened over the 15 tokens (each response once per token).
  x = np.repeat((r - r.mean(1, keepdims=True)).reshape(-1), n.reshape(-1))
  want = (r - r.mean(1, keepdims=True) - x.mean()) / np.sqrt(x.var(ddof=1) + 1e-8)
  np.testing.assert_allclose(advantages.sequence_advantages("reinforce_pp_baseline", r, lengths_QG=n), want, rtol=1e-5)
  with pytest.raises(ValueError, match="lengths_QG"):
    advantages.sequence_advantages("opo", r)


def test_distill_advantages_and_the_teacher_vocabulary():
  logp = np.array([[-1.0, -2.0, -0.5], [-3.0, -0.1, -9.0]])
  teacher = np.array([[-0.5, -2.5, -0.5], [-1.0, -0.2, -1.0]])
  mask = np.array([[1, 1, 1], [1, 1, 0]], bool)
  np.testing.assert_allclose(np.asarray(advantages.distill_advantages(logp, teacher, mask)),
                             [[0.5, -0.5, 0.0], [2.0, -0.1, 0.0]], atol=1e-6)
  advantages.check_teacher_vocab(384, 384, student="runs/a", teacher="runs/b")
  with pytest.raises(ValueError, match="'runs/big' has a vocabulary of 151936 tokens, the policy 'runs/a' 384"):
    advantages.check_teacher_vocab(384, 151936, student="runs/a", teacher="runs/big")


def test_maxrl_weighs_a_success_by_the_inverse_success_rate():
  """MaxRL by hand: K right of G gives a right answer (G - K) / K and a wrong one -1 (the authors'
  (r - mean) / (mean + 1e-6) on 0/1 rewards); a group without a success, or all right, gives 0."""
  acc = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], bool)
  got = advantages.sequence_advantages("maxrl", np.where(acc, 1.0, -1.0), acc_QG=acc)
  want = np.array([[3, -1, -1, -1], [1, 1, -1, -1], [1 / 3, 1 / 3, 1 / 3, -1], [0] * 4, [0] * 4], np.float64)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  loop = [[(a - np.mean(row)) / (np.mean(row) + 1e-6) for a in row.astype(float)] for row in acc]
  np.testing.assert_allclose(got, loop, rtol=1e-6)
  # The score (±1, an overlong penalty) does not enter: MaxRL reads success. A failed environment's row
  # leaves its group: the others are what they would be without it.
  shaped = advantages.sequence_advantages("maxrl", np.where(acc, 0.7, -1.3), acc_QG=acc)
  np.testing.assert_array_equal(shaped, got)
  valid = np.ones_like(acc)
  valid[0, 1] = False
  masked = advantages.sequence_advantages("maxrl", np.zeros(acc.shape), acc_QG=acc, valid_QG=valid)
  np.testing.assert_allclose(masked[0], [2, 0, -1, -1], rtol=1e-5)
  with pytest.raises(ValueError, match="acc_QG"):
    advantages.sequence_advantages("maxrl", np.zeros(acc.shape))
