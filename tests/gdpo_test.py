"""GDPO end to end: a reward's components kept per sample, normalised one by one in their groups,
through checkpointed groups, the config's checks and a run (verl parity: verl_reference_test)."""
import os

import numpy as np
import pytest

from configs import default
from dapo_jax import advantages, builders, dumps, metrics, rewards
from dapo_jax.datatypes import Groups
from dapo_jax.errors import ConfigError
from dapo_jax.rollout import rollout as rollout_lib


def test_a_results_numeric_entries_are_kept_and_combined():
  out = rewards.clients.checked({"score": 1, "acc": True, "format": True, "len": 3, "note": "x", "bad": float("nan")})
  assert out == {"score": 1.0, "acc": True, "pred": "", "format": 1.0, "len": 3.0}
  two = rewards.combine([[{"score": 1.0, "acc": True, "pred": "a", "f": 1.0}],
                         [{"score": 2.0, "acc": False, "pred": "b", "f": 5.0, "g": 7.0}]], [1.0, 0.5])
  assert two == [{"score": 2.0, "acc": True, "pred": "a", "f": 1.0, "g": 7.0}]  # The earlier part's "f".
  with pytest.raises(rewards.clients.RewardValueError, match="at most 16"):
    rewards.clients.checked({"score": 1.0, **{f"k{i}": i for i in range(17)}})


def test_reward_parts_by_name_with_failures_and_a_missing_entry():
  results = [{"score": 1.0, "acc": True, "pred": "7", "format": 1.0},
             dict(rewards.FAILURE),
             {"score": -1.0, "acc": False, "pred": "", "format": 0.0}]
  penalty = np.array([0.0, -0.5, -0.25])
  got = rollout_lib.reward_parts(("score", "acc", "format", "overlong_reward"), results, penalty)
  np.testing.assert_array_equal(got, [[1, 1, 1, 0], [-1, 0, 0, -0.5], [-1, 0, 0, -0.25]])
  assert rollout_lib.reward_parts((), results, penalty).shape == (3, 0)
  has = r"it has \['acc', 'format', 'score'\]"
  with pytest.raises(ConfigError, match=r"sample 2's reward result has no 'style'; " + has):
    rollout_lib.reward_parts(("style",), [dict(results[0], style=1.0), results[1], results[2]], penalty)


def test_rows_that_do_not_count_leave_the_statistics():
  rng = np.random.default_rng(0)
  parts_QGK = rng.normal(size=(3, 5, 2))
  lengths_QG = rng.integers(1, 9, size=(3, 5))
  valid_QG = np.ones((3, 5), bool)
  valid_QG[:, -1] = False
  got = advantages.gdpo_advantages(parts_QGK, (1.0, 2.0), lengths_QG, valid_QG=valid_QG)
  want = advantages.gdpo_advantages(parts_QGK[:, :-1], (1.0, 2.0), lengths_QG[:, :-1])
  np.testing.assert_allclose(got[:, :-1], want, rtol=1e-6)
  assert not got[:, -1].any()
  # By hand: whitened over tokens, a response weighing its length.
  a = sum(w * advantages.group_advantages(parts_QGK[..., k]).astype(np.float64) for k, w in enumerate((1.0, 2.0)))
  tokens = np.repeat(a.reshape(-1), lengths_QG.reshape(-1))
  np.testing.assert_allclose(advantages.gdpo_advantages(parts_QGK, (1.0, 2.0), lengths_QG),
                             (a - tokens.mean()) / np.sqrt(tokens.var(ddof=1) + 1e-8), rtol=1e-5)


def test_groups_keep_their_parts_through_json_and_old_files_have_none():
  Q, G, C, P = 2, 3, 4, 2
  g = Groups(prompt_QP=np.ones((Q, P), np.int32), prompt_mask_QP=np.ones((Q, P), bool),
             tokens_QGC=np.ones((Q, G, C), np.int32), mask_QGC=np.ones((Q, G, C), bool),
             length_QG=np.full((Q, G), C), truncated_QG=np.zeros((Q, G), bool), score_QG=np.zeros((Q, G)),
             acc_QG=np.zeros((Q, G), bool), filter_QG=np.zeros((Q, G)), logp_QGC=np.zeros((Q, G, C), np.float32),
             carried_Q=np.zeros(Q, bool), parts_QGK=np.arange(Q * G * 2, dtype=np.float32).reshape(Q, G, 2))
  back = Groups.from_json(g.to_json())
  np.testing.assert_array_equal(back.parts_QGK, g.parts_QGK)
  old = {k: v for k, v in g.to_json().items() if k != "parts_QGK"}
  assert Groups.from_json(old).parts_QGK.shape == (Q, G, 0)
  assert Groups.concat([g, g.take(np.arange(1))]).parts_QGK.shape == (3, G, 2)


@pytest.mark.parametrize("override,match", [
    (dict(gdpo_reward_keys=("even",)), "unless dapo.adv_estimator='gdpo'"),
    (dict(adv_estimator="gdpo", gdpo_reward_keys=("even", "short"), gdpo_reward_weights=(1.0,)), "one weight per"),
    (dict(adv_estimator="gdpo", gdpo_reward_weights=(float("inf"),)), "finite numbers"),
])
def test_bad_gdpo_settings_are_refused_naming_the_field(override, match):
  cfg = default.get_config("runlocal")
  cfg.dapo.update(**override)
  with pytest.raises(ConfigError, match=match):
    builders.as_config(cfg)


def test_a_run_trains_on_the_components(tmp_path):
  cfg = default.get_config("runlocal")
  cfg.model.init = "random"
  cfg.reward.update(fn="dapo_jax.testing:parts_reward", workers=1)
  cfg.dapo.update(adv_estimator="gdpo", gdpo_reward_keys=("even", "short", "overlong_reward"),
                  gdpo_reward_weights=(1.0, 0.5, 1.0))
  cfg.train.update(num_steps=2, dump_rollouts_every=1)
  workdir = str(tmp_path / "run")
  builders.run(cfg, workdir)
  logged = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  assert all(np.isfinite(logged[s]["actor/pg_loss"]) for s in (1, 2))
  # Each sample's components, as the reward and the overlong penalty gave them.
  rows = dumps.read(dumps.path(workdir, 1))
  for r in rows:
    assert r["parts"]["even"] == float(len(r["response"]) % 2 == 0) and r["parts"]["short"] == float(
        len(r["response"]) <= 8), r
    assert r["parts"]["overlong_reward"] == pytest.approx(r["score"] - (1.0 if r["acc"] else -1.0), abs=1e-6)
