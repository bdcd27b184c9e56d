"""One-step-off rollouts (`rollout.max_staleness`, `pipelining`): the synchronous path unchanged, the
staleness bound, stale rows trained against their sampler's log-probs, and an exact resume."""
import functools
import json
import os
import shutil

import jax
import numpy as np
import pytest

from dapo_jax import pipelining
from dapo_jax.datatypes import Groups

Q, G, C, P = 2, 2, 3, 2


def groups(version_QG=None, carried_Q=None) -> Groups:
  rng = np.random.default_rng(0)
  return Groups(prompt_QP=np.ones((Q, P), np.int32), prompt_mask_QP=np.ones((Q, P), bool),
                tokens_QGC=rng.integers(0, 9, (Q, G, C)).astype(np.int32), mask_QGC=np.ones((Q, G, C), bool),
                length_QG=np.full((Q, G), C), truncated_QG=np.zeros((Q, G), bool),
                score_QG=np.array([[1.0, -1.0], [1.0, -1.0]]), acc_QG=np.array([[True, False]] * Q),
                filter_QG=np.array([[1.0, 0.0]] * Q), logp_QGC=rng.normal(size=(Q, G, C)).astype(np.float32),
                carried_Q=np.zeros(Q, bool) if carried_Q is None else carried_Q, version_QG=version_QG)


def test_version_survives_take_concat_and_json_and_old_json_is_unstamped():
  g = pipelining.stamp(groups(carried_Q=np.array([True, False])), 5)
  np.testing.assert_array_equal(g.version_QG, [[4, 4], [5, 5]])  # carried rows: one step earlier
  both = Groups.concat([g.take([1]), g.take([0])])
  np.testing.assert_array_equal(both.version_QG, [[5, 5], [4, 4]])
  back = Groups.from_json(json.loads(json.dumps(both.to_json())))
  assert back.version_QG.dtype == np.int32
  np.testing.assert_array_equal(back.version_QG, both.version_QG)
  old = both.to_json()
  del old["version_QG"], old["dtypes"]["version_QG"]
  np.testing.assert_array_equal(Groups.from_json(old).version_QG, -1)
  np.testing.assert_array_equal(pipelining.staleness(both, 6), [[1, 1], [2, 2]])


def test_a_group_carried_over_twice_keeps_the_version_that_sampled_it():
  """`dapo.carry_over` with a surplus larger than Q: step 3 samples 6 kept groups and trains 2; step 4
  and step 5 train the rest without sampling. The loop stamps the carry as it is made, so the groups
  trained at step 5 show staleness 2 (stamped at use, they would claim 1)."""
  from dapo_jax.rollout import dynamic_sampling
  six = Groups.concat([groups()] * 3)  # Mixed rewards: all kept.
  fill = lambda carry: dynamic_sampling.fill_batch(carry, lambda i: six, 2, filter_groups=True, max_gen_batches=3,
                                                   on_cap="train", carry_over=True)
  batch, carry, stats = fill(None)
  pipelining.stamp_collected((batch, stats, {}), carry, 3)
  assert stats.gen_batches == 1 and len(carry) == 4
  for step, staleness in ((4, 1), (5, 2)):
    batch, carry, stats = fill(carry)
    pipelining.stamp_collected((batch, stats, {}), carry, step)
    assert stats.gen_batches == 0 and batch.carried_Q.all()
    np.testing.assert_array_equal(pipelining.staleness(batch, step), staleness)
  assert carry is None


def test_carried_groups_past_the_staleness_bound_are_dropped():
  """The surplus of step 3 (version 3) may be trained at step 4 (one version: carry_over's own lag); at
  step 5 it would be two versions old, past the bound max(rollout.max_staleness, 1), and is dropped."""
  carry = pipelining.stamp(Groups.concat([groups(), groups()]), 3)
  kept, dropped = pipelining.bound_carry(carry, 4, max_lag=1)
  assert kept is carry and dropped == 0
  kept, dropped = pipelining.bound_carry(carry, 5, max_lag=1)
  assert kept is None and dropped == 4
  mixed = Groups.concat([carry.take([0]), pipelining.stamp(groups(), 4).take([1])])
  kept, dropped = pipelining.bound_carry(mixed, 5, max_lag=1)
  assert dropped == 1 and len(kept) == 1 and (kept.version_QG == 4).all()


def test_decoupled_loss_without_its_correction_is_one_line():
  from dapo_jax import builders
  cfg = run_config(1)
  cfg.rollout.use_decoupled_loss = True
  with pytest.raises(builders.ConfigError, match=r"^rollout.use_decoupled_loss=True needs "
                                                       r"dapo.rollout_correction.rollout_is='token' or 'sequence'"):
    builders.validate(cfg, num_devices=1)
  cfg.dapo.rollout_correction.rollout_is = "token"
  builders.validate(cfg, num_devices=1)


def run_config(max_staleness: int, num_steps: int = 4, ckpt_every: int = 0):
  from configs import dapo_qwen2_5_32b
  cfg = dapo_qwen2_5_32b.get_config("runlocal")
  cfg.rollout.max_staleness = max_staleness
  cfg.train.update(num_steps=num_steps, ckpt_every=ckpt_every, log_samples_every=0, dump_rollouts_every=0)
  cfg.reward.update(fn="dapo_jax.testing:length_reward", workers=1)  # mixed groups: every step updates
  return cfg


def logged(workdir) -> dict[int, dict]:
  """metrics.jsonl's rows by step (a later row of a step, e.g. after a resume, replaces the earlier)."""
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      row = json.loads(line)
      out.setdefault(row["step"], {}).update(row)
  return out


def untimed(row: dict) -> dict:
  return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/", "time")) and k != "step"}


def train(cfg, workdir) -> dict[int, dict]:
  from dapo_jax import builders
  with builders.dapo(cfg, workdir) as run:
    run.run()
  return logged(workdir)


@pytest.mark.slow  # three runlocal runs (~1 min on 2 cores)
def test_one_step_off_bound_sync_equality_and_exact_resume(tmp_path):
  sync = train(run_config(0), str(tmp_path / "sync"))
  off = train(run_config(1, ckpt_every=2), str(tmp_path / "off"))
  for step in range(1, 5):
    assert sync[step]["rollout/staleness_max"] == 0 and sync[step]["rollout/staleness_mean"] == 0
  # Step 1 (sampled synchronously) and step 3 (after the step-2 checkpoint: synchronous) are fresh;
  # steps 2 and 4 were sampled during the previous update.
  assert [off[s]["rollout/staleness_max"] for s in (1, 2, 3, 4)] == [0, 1, 0, 1]
  assert off[2]["train/carried_groups"] == 4  # stale groups train against their sampler's log-probs
  assert untimed(off[1]) == untimed(sync[1])  # the same first step: nothing else changed
  assert untimed(off[2]) != untimed(sync[2])
  # Killed after the step-2 checkpoint: the same command resumes and logs the same later steps.
  resumed = str(tmp_path / "resumed")
  shutil.copytree(str(tmp_path / "off"), resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "4"))
  again = train(run_config(1, ckpt_every=2), resumed)
  for step in (3, 4):
    assert untimed(again[step]) == untimed(off[step]), step


@pytest.mark.slow  # three 6-step runlocal runs
def test_two_steps_off_bound_threaded_equals_in_order_and_exact_resume(tmp_path):
  """max_staleness=2: after a synchronous step, the next two rollouts are queued by its params
  (staleness 1, then 2), and no queued rollout crosses a checkpoint. The rollouts are a function of
  the schedule, not of the thread's timing: run in order on the main thread (as several processes
  do) they log the same values, and a resume from the step-3 checkpoint repeats steps 4-6."""
  from dapo_jax import builders
  threaded = train(run_config(2, num_steps=6, ckpt_every=3), str(tmp_path / "threaded"))
  assert [threaded[s]["rollout/staleness_max"] for s in range(1, 7)] == [0, 1, 2, 0, 1, 2]
  assert threaded[3]["rollout/staleness_mean"] == 2
  with builders.dapo(run_config(2, num_steps=6, ckpt_every=3), str(tmp_path / "in_order")) as run:
    run.prefetch = pipelining.Prefetch(in_order=True)
    run.run()
  in_order = logged(str(tmp_path / "in_order"))
  for step in range(1, 7):
    assert untimed(in_order[step]) == untimed(threaded[step]), step
  resumed = str(tmp_path / "resumed")
  shutil.copytree(str(tmp_path / "threaded"), resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "6"))
  again = train(run_config(2, num_steps=6, ckpt_every=3), resumed)
  for step in (4, 5, 6):
    assert untimed(again[step]) == untimed(threaded[step]), step


def test_the_queue_runs_rollouts_in_order_and_a_drain_keeps_the_state_before_the_oldest():
  import threading
  for in_order in (False, True):
    queue, state, release = pipelining.Prefetch(in_order=in_order), {"n": 0}, threading.Event()
    if in_order:
      release.set()

    def rollout(step):
      release.wait()
      state["n"] += 1
      return step, threading.current_thread() is threading.main_thread()

    for step in (3, 4, 5):
      queue.start(step, functools.partial(rollout, step), before=lambda: state["n"])
    assert (queue.step, queue.last_step) == (3, 5)
    release.set()
    assert queue.result() == (3, in_order)
    assert queue.step == 4
    assert queue.drain() == 1  # the state as rollout 4 began: one rollout done
    assert not queue.pending and state["n"] == 3
    queue.start(6, lambda: None)
    with pytest.raises(AssertionError):  # steps queue consecutively
      queue.start(8, lambda: None)
    queue.close()


def test_the_schedule_model_by_hand():
  """Rollouts of 3, 1, 3, 1 s and trainings of 2 s each. Synchronous: 16 s. One step off: rollout 1
  runs beside update 0 (3-5), rollout 2 waits for update 1's params (5-8), so update 2 waits for it
  (8-10) and update 3 ends at 12. Two steps off: rollout 2 is queued at update 0 and runs 4-7, so
  the updates run back to back from 3: 11 s, the floor (first rollout + every training)."""
  r, t = [3.0, 1.0, 3.0, 1.0], [2.0] * 4
  assert [pipelining.schedule_seconds(r, t, S) for S in (0, 1, 2, 4)] == [16.0, 12.0, 11.0, 11.0]
  # Generation-bound: rollouts back to back, the last update after the last rollout.
  assert pipelining.schedule_seconds([3.0] * 4, [1.0] * 4, 1) == 13.0


def test_a_stop_while_the_next_rollouts_are_in_flight_saves_the_state_from_before_them(tmp_path):
  """The stop-signal path: the rollouts queued are dropped, and the checkpoint holds the data
  position, keep rate and carried-over groups from before the oldest (those of a synchronous run's
  step 0), one rollout queued or two."""
  from dapo_jax import builders
  states = {}
  for staleness in (0, 1, 2):
    cfg = run_config(staleness)
    cfg.dapo.carry_over = True  # Kept groups beyond Q wait for the next step.
    workdir = str(tmp_path / str(staleness))
    with builders.dapo(cfg, workdir) as run:
      run.step(0)
      if staleness:
        # The rollouts of steps 1..staleness, started before update 0.
        assert (run.prefetch.step, run.prefetch.last_step) == (1, staleness)
        run.save(1)
        run.ckpt.wait()
      else:
        states[0] = (run.carry.to_json(), run.data_iter.state(), run.keep_rate.state())
    if staleness:
      with builders.dapo(cfg, workdir) as again:
        assert again.restore() == 1
        states[staleness] = (again.carry.to_json(), again.data_iter.state(), again.keep_rate.state())
  assert states[0][0]["prompt_QP"], "step 0 kept more groups than Q: something to carry"
  for staleness in (1, 2):
    assert json.dumps(states[staleness], sort_keys=True, default=str) == json.dumps(states[0], sort_keys=True,
                                                                                    default=str)


@pytest.mark.parametrize("decoupled", [False, True])
def test_two_version_batch_loss_equals_numpy(tmp_path, decoupled):
  """Group 0 sampled by version 0 (params A), group 1 by version 1 (params B), trained at step 1 by
  B with two mini-batches (π_old recomputed by the loop): per-token staleness is 1 / 0; the stale
  group's π_old is A's sampler log-probs (or B's own with the decoupled objective), and the loss,
  clip fraction and KL equal the float64 NumPy reference."""
  import carry_over_test as co  # its tiny model, sampler, trainer and NumPy reference

  from dapo_jax import advantages
  trainer = co.make_trainer(2)
  params_a = jax.device_get(trainer.init(jax.random.key(0)).params)
  rng = np.random.default_rng(0)
  params_b = jax.tree.map(lambda x: (x + 2 * x.std() * rng.standard_normal(x.shape)).astype(x.dtype), params_a)
  stale, logp_a_BC = co.sample_groups(params_a, seed=0, Q=1)
  fresh, _ = co.sample_groups(params_b, seed=1, Q=1)
  two = Groups.concat([pipelining.stamp(stale, 0), pipelining.stamp(fresh, 1)])
  stale_QG = pipelining.staleness(two, 1)
  per_token_BC = np.broadcast_to(stale_QG.reshape(-1, 1), (2 * co.G, co.C))[two.mask_QGC.reshape(-1, co.C)]
  np.testing.assert_array_equal(np.unique(per_token_BC), [0, 1])
  np.testing.assert_array_equal(stale_QG, [[1] * co.G, [0] * co.G])
  pipelining.mark_stale(two, 1, decoupled=decoupled)
  assert two.carried_Q.tolist() == ([False, False] if decoupled else [True, False])
  batch, _ = advantages.to_train_batch(two, 2, co.P, norm_adv_by_std=True, overlong_filter=False)
  got = co.update(trainer, params_b, batch, tmp_path, 2)
  old_BC = np.full(batch.old_logp_BC.shape, np.nan)  # NaN: π_old is the current policy (B)
  if not decoupled:
    old_BC[:co.G] = logp_a_BC  # the behaviour log-probs of the stale group
  ref = co.reference_metrics(params_b, batch, old_BC)
  for k in ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy"):
    np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-7, err_msg=k)
  assert (abs(ref["ppo_kl"]) > 1e-2) != decoupled  # the stale rows' ratio is off-policy unless decoupled


def test_a_negative_staleness_is_refused_in_one_line_naming_the_field():
  from dapo_jax import builders
  cfg = run_config(-1)
  with pytest.raises(builders.ConfigError, match=r"^rollout.max_staleness=-1: expected >= 0 \(0: synchronous"):
    builders.validate(cfg, num_devices=1)
  builders.validate(run_config(3), num_devices=1)


def split_config(rollout_devices: int, max_staleness: int = 0):
  cfg = run_config(max_staleness, num_steps=2)
  cfg.train.eval_every = 0
  cfg.mesh.update(data=-1, fsdp=1, tensor=1, rollout_devices=rollout_devices)
  return cfg


@pytest.mark.slow  # three 2-step runlocal runs on 8 host devices
def test_split_mesh_equals_the_shared_mesh_and_runs_one_step_off(tmp_path):
  """`mesh.rollout_devices=4`: devices 0-3 decode, 4-7 train, the policy copied over each step. In
  sync it is the run of one 4-device mesh doing both (same shapes: every value equal); one-step-off,
  the rollout of step 2 decodes on its devices while update 1 runs on the others."""
  from dapo_jax import builders, sharding
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  runs = {}
  for name, cfg, mesh in [("shared", split_config(0), sharding.make_mesh({"data": 4}, jax.devices()[:4])),
                          ("split", split_config(4), None), ("split_off", split_config(4, 1), None)]:
    with builders.dapo(cfg, str(tmp_path / name), mesh=mesh) as run:
      run.run()
      params = jax.device_get(run.state.params)
      devices = ({d.id for d in jax.tree.leaves(run.state.params)[0].sharding.device_set},
                 {d.id for d in run.rollout.mesh.devices.flat})
    runs[name] = logged(tmp_path / name), params, devices
  assert runs["shared"][2] == ({0, 1, 2, 3}, {0, 1, 2, 3})
  assert runs["split"][2] == runs["split_off"][2] == ({4, 5, 6, 7}, {0, 1, 2, 3})
  for step in (1, 2):
    assert untimed(runs["split"][0][step]) == untimed(runs["shared"][0][step]), step
  jax.tree.map(np.testing.assert_array_equal, runs["split"][1], runs["shared"][1])
  off = runs["split_off"][0]
  assert [off[s]["rollout/staleness_max"] for s in (1, 2)] == [0, 1]
  assert untimed(off[1]) == untimed(runs["split"][0][1])


@pytest.mark.slow  # two 2-step runlocal runs on 8 host devices
def test_a_split_mesh_rollout_on_pages_equals_it_on_dense_rows(tmp_path):
  """`mesh.rollout_devices=4` with `rollout.kv_layout=paged`: the rollout's 4 batch shards each keep
  their own page pool (and a prefix cache) on their device. The run draws the dense rows' run's tokens:
  every logged value equal to it, to rounding (the prompts after cached pages are prefilled by another
  program, `decode.prefill_after_cache`), and so are the params."""
  from dapo_jax import builders
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  runs = {}
  for name in ("dense", "paged"):
    cfg = split_config(4, 1)
    if name == "paged":
      cfg.rollout.update(kv_layout="paged", page_size=8, prefix_cache=True)
    with builders.dapo(cfg, str(tmp_path / name)) as run:
      run.run()
      runs[name] = logged(tmp_path / name), jax.device_get(run.state.params)
  for step in (1, 2):
    paged, dense = untimed(runs["paged"][0][step]), untimed(runs["dense"][0][step])
    assert paged.keys() == dense.keys()
    for k in dense:
      assert paged[k] == pytest.approx(dense[k], rel=1e-5, abs=1e-7), (step, k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), runs["paged"][1], runs["dense"][1])


@pytest.mark.parametrize("rollout_devices,mesh,match", [
    (8, {}, r"^mesh.rollout_devices=8: expected 0 \(rollout and training share the devices\) or 1..7 of the 8 devices"),
    (-1, {}, r"^mesh.rollout_devices=-1: expected 0"),
    (3, {"data": 2, "fsdp": 1}, r"^mesh=.*\(mesh.rollout_devices=3: 3 rollout and 5 training devices\)$"),
])
def test_a_split_that_cannot_work_is_one_line(rollout_devices, mesh, match):
  from dapo_jax import builders
  cfg = split_config(rollout_devices)
  cfg.mesh.update(mesh)
  with pytest.raises(builders.ConfigError, match=match):
    builders.validate(cfg, num_devices=8)
  cfg.mesh.update(rollout_devices=4, data=-1)
  builders.validate(cfg, num_devices=8)


def test_partial_rollouts_need_one_step_off_and_streaming_in_one_line():
  from dapo_jax import builders
  cfg = run_config(0)
  cfg.rollout.partial_rollouts, cfg.dapo.streaming = True, True
  with pytest.raises(builders.ConfigError, match=r"^rollout.partial_rollouts=True needs rollout.max_staleness=1"):
    builders.validate(cfg, num_devices=1)
  cfg.rollout.max_staleness = 2  # the params of one update go to one rollout in flight
  with pytest.raises(builders.ConfigError, match=r"^rollout.partial_rollouts=True needs rollout.max_staleness=1"):
    builders.validate(cfg, num_devices=1)
  cfg.rollout.max_staleness = 1
  builders.validate(cfg, num_devices=1)
  cfg.dapo.streaming = False
  with pytest.raises(builders.ConfigError, match=r"needs dapo.streaming=True and rollout.engine='continuous'"):
    builders.validate(cfg, num_devices=1)


@pytest.mark.slow  # one 4-step runlocal run
def test_partial_rollouts_train_within_the_bound(tmp_path):
  """The loop hands each update's params to the rollout in flight. Whether a row switches depends on
  timing (the engine test checks the switch exactly); what holds whatever the timing: no row is more
  than one version stale, no token is staler than its row, and the step-1 values equal sync's."""
  import math
  cfg = run_config(1)
  cfg.rollout.partial_rollouts, cfg.dapo.streaming = True, True
  off = train(cfg, str(tmp_path / "partial"))
  cfg = run_config(0, num_steps=1)
  cfg.dapo.streaming = True
  sync = train(cfg, str(tmp_path / "sync"))
  assert untimed(off[1]) == untimed(sync[1])
  for step in (2, 3, 4):
    m = off[step]
    assert m["rollout/staleness_max"] <= 1 and math.isfinite(m["actor/pg_loss"])
    if "rollout/partial_rows" in m:
      assert m["rollout/staleness_token_mean"] <= m["rollout/staleness_mean"]
