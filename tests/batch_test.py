"""The train batch of a rollout step on hand-made groups: dynamic sampling's refill, cap and
carry-over (`dynamic_sampling.fill_batch`), and the padded, masked batch (`advantages.to_train_batch`),
whose carried rows keep their sampling policy's log-probs as π_old."""
import dataclasses
import json

import numpy as np
import pytest

from dapo_jax import advantages, train_step
from dapo_jax.datatypes import Groups
from dapo_jax.rollout import dynamic_sampling


def make_groups(acc_rows, *, first_id=0, C=4, P=3, lengths=None, truncated=None):
  """One group per row of `acc_rows` (G booleans each); prompt q's tokens are all `first_id + q`."""
  acc = np.asarray(acc_rows, bool)
  Q, G = acc.shape
  ids = np.arange(first_id, first_id + Q)
  lengths = np.full((Q, G), 2) if lengths is None else np.asarray(lengths)
  mask = np.arange(C)[None, None] < lengths[..., None]
  return Groups(prompt_QP=np.repeat(ids[:, None], P, 1).astype(np.int32), prompt_mask_QP=np.ones((Q, P), bool),
                tokens_QGC=np.where(mask, 100 + ids[:, None, None], 0).astype(np.int32), mask_QGC=mask,
                length_QG=lengths, truncated_QG=np.zeros((Q, G), bool) if truncated is None else np.asarray(truncated),
                score_QG=np.where(acc, 1.0, -1.0), acc_QG=acc, filter_QG=acc.astype(np.float64),
                logp_QGC=np.where(mask, -0.5 - ids[:, None, None], 0.0).astype(np.float32),
                carried_Q=np.zeros(Q, bool))


def generator(batches):
  calls = []

  def generate(i):
    calls.append(i)
    return batches[i]
  return generate, calls


MIXED, RIGHT, WRONG = [True, False], [True, True], [False, False]


def test_refill_keeps_mixed_groups_in_arrival_order_and_carries_the_surplus():
  b0 = make_groups([MIXED, RIGHT, MIXED, WRONG], first_id=0)      # keeps prompts 0, 2
  b1 = make_groups([WRONG, MIXED, MIXED, MIXED], first_id=10)     # keeps 11, 12, 13
  gen, calls = generator([b0, b1])
  batch, carry, stats = dynamic_sampling.fill_batch(None, gen, 3, filter_groups=True, max_gen_batches=5,
                                              on_cap="raise", carry_over=True)
  assert calls == [0, 1]
  assert batch.prompt_QP[:, 0].tolist() == [0, 2, 11]
  assert carry.prompt_QP[:, 0].tolist() == [12, 13]
  assert (stats.gen_batches, stats.generated, stats.kept) == (2, 8, 5)
  assert (stats.all_correct, stats.all_wrong) == (1, 2)
  assert stats.acc_sum == pytest.approx(0.5 + 1 + 0.5 + 0 + 0 + 0.5 * 3)
  assert not stats.cap_reached
  # Without carry-over the surplus is dropped (the reference).
  gen, _ = generator([b0, b1])
  _, carry, _ = dynamic_sampling.fill_batch(None, gen, 3, filter_groups=True, max_gen_batches=5, on_cap="raise",
                                      carry_over=False)
  assert carry is None


def test_carried_groups_come_first_and_can_fill_a_step_alone():
  carry = make_groups([MIXED, MIXED], first_id=50)
  gen, calls = generator([make_groups([MIXED, MIXED], first_id=0)])
  batch, rest, stats = dynamic_sampling.fill_batch(carry, gen, 2, filter_groups=True, max_gen_batches=3,
                                             on_cap="raise", carry_over=True)
  assert calls == [] and stats.gen_batches == 0 and rest is None
  assert batch.prompt_QP[:, 0].tolist() == [50, 51]
  gen, calls = generator([make_groups([MIXED, MIXED], first_id=0)])
  batch, rest, _ = dynamic_sampling.fill_batch(carry.take(slice(0, 1)), gen, 2, filter_groups=True, max_gen_batches=3,
                                         on_cap="raise", carry_over=True)
  assert calls == [0] and batch.prompt_QP[:, 0].tolist() == [50, 0] and rest.prompt_QP[:, 0].tolist() == [1]


def test_cap_raises_or_trains_on_what_was_kept():
  batches = [make_groups([RIGHT, MIXED], first_id=10 * i) for i in range(3)]
  gen, calls = generator(batches)
  with pytest.raises(dynamic_sampling.DynamicSamplingCapError, match="2 generation batches .* kept only 2 of 4"):
    dynamic_sampling.fill_batch(None, gen, 4, filter_groups=True, max_gen_batches=2, on_cap="raise", carry_over=True)
  gen, calls = generator(batches)
  batch, carry, stats = dynamic_sampling.fill_batch(None, gen, 4, filter_groups=True, max_gen_batches=2,
                                              on_cap="train", carry_over=True)
  assert calls == [0, 1] and stats.cap_reached and len(batch) == 2 and carry is None
  assert batch.prompt_QP[:, 0].tolist() == [1, 11]
  # Nothing kept at all: no batch.
  gen, _ = generator([make_groups([RIGHT, WRONG])] * 2)
  batch, carry, stats = dynamic_sampling.fill_batch(None, gen, 2, filter_groups=True, max_gen_batches=2,
                                              on_cap="train", carry_over=True)
  assert batch is None and carry is None and stats.kept == 0


def test_without_dynamic_sampling_every_group_is_kept_and_there_is_no_cap():
  gen, calls = generator([make_groups([RIGHT, WRONG, MIXED])])
  batch, carry, stats = dynamic_sampling.fill_batch(None, gen, 3, filter_groups=False, max_gen_batches=1,
                                              on_cap="raise", carry_over=True)
  assert calls == [0] and len(batch) == 3 and carry is None and stats.kept == 3


def test_filter_on_score_differs_from_filter_on_accuracy():
  g = make_groups([RIGHT, MIXED])
  g.filter_QG = np.array([[1.0, 0.5], [1.0, 1.0]])  # e.g. equal correctness but unequal scores
  gen, _ = generator([g])
  batch, _, _ = dynamic_sampling.fill_batch(None, gen, 1, filter_groups=True, max_gen_batches=1, on_cap="raise",
                                      carry_over=False)
  assert batch.prompt_QP[:, 0].tolist() == [0]


def test_to_train_batch_layout_advantages_and_padding():
  g = make_groups([[True, False, False, False], [True, True, False, False]], C=4, P=3,
                  lengths=[[1, 2, 3, 4], [4, 3, 2, 1]])
  batch, adv = advantages.to_train_batch(g, 3, 2, norm_adv_by_std=True, overlong_filter=False)
  assert batch.tokens_BT.shape == (12, 2 + 4) and batch.tokens_BT.dtype == np.int32
  # Row qG+g: the last 2 prompt positions of prompt q, then completion g of prompt q.
  np.testing.assert_array_equal(batch.tokens_BT[5], [1, 1, 101, 101, 101, 0])
  np.testing.assert_array_equal(batch.mask_BT[5], [1, 1, 1, 1, 1, 0])
  # Advantages by hand: scores [1, -1, -1, -1] have mean -0.5 and unbiased std 1.
  np.testing.assert_allclose(adv[0], np.array([1.5, -0.5, -0.5, -0.5]) / (1 + 1e-6), rtol=1e-6)
  s = np.std([1, 1, -1, -1], ddof=1)
  np.testing.assert_allclose(adv[1], np.array([1, 1, -1, -1]) / (s + 1e-6), rtol=1e-6)
  np.testing.assert_allclose(batch.adv_B[:8], adv.reshape(-1), rtol=1e-6)
  assert adv.shape == (2, 4)  # Only the real groups.
  # The third group is a repeat of a real one with an all-zero loss mask (static shapes).
  np.testing.assert_array_equal(batch.tokens_BT[8:], batch.tokens_BT[:4])
  assert not batch.loss_mask_BC[8:].any()
  np.testing.assert_array_equal(batch.loss_mask_BC[:8], g.mask_QGC.reshape(8, 4))


def test_overlong_filter_masks_truncated_samples_out_of_the_loss():
  g = make_groups([MIXED, MIXED], C=4, lengths=[[4, 2], [1, 4]], truncated=[[True, False], [False, True]])
  kept, _ = advantages.to_train_batch(g, 2, 3, norm_adv_by_std=True, overlong_filter=False)
  filtered, _ = advantages.to_train_batch(g, 2, 3, norm_adv_by_std=True, overlong_filter=True)
  assert kept.loss_mask_BC[0].sum() == 4 and kept.loss_mask_BC[3].sum() == 4
  assert not filtered.loss_mask_BC[0].any() and not filtered.loss_mask_BC[3].any()
  np.testing.assert_array_equal(filtered.loss_mask_BC[[1, 2]], kept.loss_mask_BC[[1, 2]])
  # The attention mask still covers the truncated rows: only the loss ignores them.
  np.testing.assert_array_equal(filtered.mask_BT, kept.mask_BT)


def test_carried_groups_keep_their_sampling_log_probs_as_pi_old():
  """The surplus is marked carried; next step its rows' π_old is the sampler's log-probs (flagged in
  `behaviour_B`), while fresh rows' π_old is left to the update (zeros, as without carry-over)."""
  b0 = make_groups([MIXED, MIXED, MIXED], first_id=0)
  gen, _ = generator([b0])
  batch, carry, _ = dynamic_sampling.fill_batch(None, gen, 1, filter_groups=True, max_gen_batches=1, on_cap="raise",
                                          carry_over=True)
  assert not batch.carried_Q.any() and carry.carried_Q.tolist() == [True, True]
  gen, _ = generator([make_groups([MIXED, MIXED], first_id=10)])
  batch, _, _ = dynamic_sampling.fill_batch(carry.take(slice(0, 1)), gen, 2, filter_groups=True, max_gen_batches=1,
                                      on_cap="raise", carry_over=True)
  assert batch.prompt_QP[:, 0].tolist() == [1, 10] and batch.carried_Q.tolist() == [True, False]
  train, _ = advantages.to_train_batch(batch, 3, 3, norm_adv_by_std=True, overlong_filter=False)
  # Rows 0-1: prompt 1, carried (sampled log-probs -1.5 on its 2 tokens); 2-3: fresh; 4-5: padding
  # repeating the carried group (no loss tokens).
  assert train.behaviour_B.tolist() == [True, True, False, False, True, True]
  np.testing.assert_array_equal(train.old_logp_BC[:2], [[-1.5, -1.5, 0, 0]] * 2)
  assert not train.old_logp_BC[2:4].any()
  parts = train_step.bucketed_microbatches(train, 3, 2, (2, 4))
  assert sorted(p.behaviour_B.tolist() for p in parts) == [[False, False], [True, True], [True, True]]


def test_without_carried_groups_the_batch_has_no_behaviour_rows():
  g = make_groups([MIXED, MIXED])
  g.logp_QGC = np.full_like(g.logp_QGC, -30.0)  # The sampler's log-probs are not read for fresh rows.
  gen, _ = generator([g])
  batch, carry, _ = dynamic_sampling.fill_batch(None, gen, 1, filter_groups=True, max_gen_batches=1, on_cap="raise",
                                          carry_over=False)
  train, _ = advantages.to_train_batch(batch, 1, 3, norm_adv_by_std=True, overlong_filter=False)
  assert carry is None and train.behaviour_B is None and not train.old_logp_BC.any()


def test_groups_json_round_trip_and_older_checkpoints():
  g = make_groups([MIXED, RIGHT])
  g.carried_Q = np.array([True, False])
  g.logp_QGC = g.logp_QGC - np.float32(1 / 3)  # Not a short decimal: float32 must survive exactly.
  back = Groups.from_json(json.loads(json.dumps(g.to_json())))
  for f in dataclasses.fields(Groups):
    a, b = getattr(g, f.name), getattr(back, f.name)
    assert a.dtype == b.dtype, f.name
    np.testing.assert_array_equal(a, b, err_msg=f.name)
  # Saved before the behaviour log-probs were kept: not carried, so π_old is recomputed as then.
  old = g.to_json()
  for k in ("logp_QGC", "carried_Q"):
    del old[k], old["dtypes"][k]
  back = Groups.from_json(old)
  assert not back.carried_Q.any() and back.logp_QGC.shape == g.logp_QGC.shape and not back.logp_QGC.any()
  np.testing.assert_array_equal(back.tokens_QGC, g.tokens_QGC)


def test_maxrl_batches_read_correctness_not_the_score():
  g = make_groups([[True, False, False, False], [True, True, False, False]])
  g = dataclasses.replace(g, score_QG=g.score_QG - 0.25)  # A shaped score: MaxRL does not read it.
  batch, adv_QG = advantages.to_train_batch(g, 2, 3, norm_adv_by_std=True, overlong_filter=False, estimator="maxrl")
  np.testing.assert_allclose(batch.adv_B, [3, -1, -1, -1, 1, 1, -1, -1], rtol=1e-5)
  np.testing.assert_array_equal(adv_QG.reshape(-1), batch.adv_B)
