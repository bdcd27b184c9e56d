"""Sweeps: the space syntax, the budget points the pruner sees, the report's table, the warm start key
(against hand-computed values and optuna's own samplers); then real sweeps of `launch.train` processes:
pruned trials stop early with their checkpoint, and a sweep killed with -9 resumes without rerunning a
finished trial."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import optuna
import pytest

from dapo_jax import testing
from dapo_jax.builders import sweep as sweep_builder
from dapo_jax.sweep import report, space, study, trials

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = f"{ROOT}/configs/ablation.py:runlocal,task=arith,stage=dapo"  # A warm start, held-out evals, seconds
# Correctness that varies inside groups even for a barely trained model, so every run updates.
FIXED = {"reward.fn": "dapo_jax.testing:length_reward"}
# The trials run on one CPU device, compiling fast (the 8 test devices would only slow compiling).
CHILD_ENV = dict(os.environ, XLA_FLAGS=testing.FAST_COMPILE_XLA_FLAGS, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)


# --- the space -------------------------------------------------------------------------------------

def test_space_syntax():
  p = space.parse("dapo.eps_high=[0.2, 0.28,true,none,word,'3']")
  assert p.key == "dapo.eps_high" and p.choices == (0.2, 0.28, True, None, "word", "3")
  p = space.parse("train.minibatches=range(1,4)")
  assert (p.low, p.high, p.step, p.log, p.integer) == (1, 4, None, False, True)
  p = space.parse("optim.lr=log(1e-5,1e-3)")
  assert (p.low, p.high, p.log, p.integer) == (1e-5, 1e-3, True, False)
  p = space.parse("dapo.eps_high=range(0.2,0.4,0.05)")
  assert (p.low, p.high, p.step, p.integer) == (0.2, 0.4, 0.05, False)
  assert space.parse(":stage=[naive_grpo,dapo]").choices == ("naive_grpo", "dapo")
  s = space.from_specs(["a.b=[1,2,3]", ":c=[x,y]"])
  assert s.grid == {"a.b": [1, 2, 3], ":c": ["x", "y"]} and s.size == 6
  assert space.from_specs(["a.b=[1,2]", "a.c=range(0,1)"]).grid is None


@pytest.mark.parametrize("spec,words", [
    ("dapo.eps_high", "expected KEY="), ("dapo eps=[1]", "expected KEY="), ("a.b=[]", "no choices"),
    ("a.b=[1,1]", "listed twice"), ("a.b=range(1)", "two or three numbers"), ("a.b=range(2,1)", "not below"),
    ("a.b=log(0,1)", "positive low bound"), ("a.b=log(1,2,3)", "two numbers"), ("a.b=range(0,1,-1)", "not positive"),
    ("a.b=uniform(0,1)", "expected [a,b"), ("a.b=range(x,1)", "two or three numbers")])
def test_space_errors_name_the_flag(spec, words):
  with pytest.raises(ValueError, match="--space=") as e:
    space.parse(spec)
  assert words in str(e.value)


def test_space_twice_is_an_error():
  with pytest.raises(ValueError, match="a.b is given more than once"):
    space.from_specs(["a.b=[1]", "a.b=[2]"])


def test_suggestions_stay_in_the_space():
  """optuna's samplers draw from the parsed ranges: integers for integer bounds, on the step, in bounds."""
  s = space.from_specs(["t.n=range(1,4)", "o.lr=log(1e-5,1e-3)", "d.e=range(0.2,0.4,0.05)", ":stage=[a,b]"])
  st = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
  for _ in range(40):
    v = s.suggest(st.ask())
    assert isinstance(v["t.n"], int) and 1 <= v["t.n"] <= 4
    assert 1e-5 <= v["o.lr"] <= 1e-3
    assert min(abs(v["d.e"] - g) for g in (0.2, 0.25, 0.3, 0.35, 0.4)) < 1e-9
    assert v[":stage"] in ("a", "b")
  assert s.overrides(v) == v


def test_recipe_points_and_labels():
  def sweep(add):
    add(**{"dapo.eps_high": 0.24})
    add(**{"dapo.eps_high": 0.32, ":stage": "dapo"})
  s = space.from_recipe(sweep)
  assert s.grid == {space.POINT: [0, 1]}
  assert s.overrides({space.POINT: 1}) == {"dapo.eps_high": 0.32, ":stage": "dapo"}
  assert space.label({"dapo.eps_high": 0.32, ":stage": "dapo"}) == "dapo.eps_high=0.32,stage=dapo"
  assert space.label({"data.path": "a/b c"}) == "data.path=a_b_c"
  assert space.command_args({"dapo.eps_high": 1e-05, ":stage": "dapo", "x.flag": True, "x.s": "w"}) == (
      ["stage=dapo"], ["--config.dapo.eps_high=1e-05", "--config.x.flag=True", "--config.x.s=w"])
  with pytest.raises(ValueError, match="added no setting"):
    space.from_recipe(lambda add: None)


# --- what the pruner sees, and the report ------------------------------------------------------------

def _write_run(path, samples_per_step, evals, extra=None):
  """A metrics.jsonl: rollout/samples per step 1..N, and {step: value} held-out evaluations."""
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    steps = range(0, len(samples_per_step) + 1)
    for s in steps:
      rec = {"step": s}
      if s:
        rec.update({"rollout/samples": samples_per_step[s - 1], "actor/entropy": 1.0, "response_length/mean": 5.0,
                    "response_length/clip_ratio": 0.0, "actor/pg_clipfrac_eps_high": 0.0,
                    "actor/pg_clipfrac_eps_low": 0.0, **(extra or {})})
      if s in evals:
        rec.update({"val/acc/mean@4": evals[s], "val/acc/greedy": evals[s] + 0.1})
      f.write(json.dumps(rec) + "\n")


def test_budget_points_interpolate_between_evaluations(tmp_path):
  # Evaluations at steps 0, 2, 4: samples 0, 300 (100 + 200), 700 (+ 150 + 250).
  _write_run(str(tmp_path), [100, 200, 150, 250], {0: 0.2, 2: 0.5, 4: 0.9})
  curve = trials.read_curve(str(tmp_path), "val/acc/mean@4")
  assert curve.eval_samples.tolist() == [0, 300, 700] and curve.last_step == 4 and curve.samples == 700
  points = trials.budget_points(curve, 250)
  # 250: 0.2 + 250/300 * 0.3; 500: 0.5 + 200/400 * 0.4; 750 is past the last evaluation.
  assert [b for b, _ in points] == [250, 500]
  np.testing.assert_allclose([v for _, v in points], [0.2 + 0.25, 0.5 + 0.2], rtol=1e-12)
  assert trials.read_curve(str(tmp_path), "val/acc/none") is None


def _record(n, state, setting, seed, workdir, error=""):
  return study.TrialRecord(n, state, setting, {}, seed, workdir, None, 0.0, error)


def test_report_table_over_seeds_at_equal_samples(tmp_path):
  w = str(tmp_path)
  # Setting A, two seeds: 300 samples per step; B one seed: 200 per step (its 2 steps = 400 samples).
  # A's groups: half dropped by dynamic sampling in seed 0, a quarter in seed 1 (B: no such metric).
  _write_run(f"{w}/a0", [300, 300], {0: 0.2, 1: 0.6, 2: 0.8}, {"train/kept_fraction": 0.5})
  _write_run(f"{w}/a1", [300, 300], {0: 0.2, 1: 0.4, 2: 0.6}, {"train/kept_fraction": 0.75})
  _write_run(f"{w}/b0", [200, 200], {0: 0.2, 1: 0.3, 2: 0.5})
  _write_run(f"{w}/p", [500], {0: 0.2, 1: 0.1})
  recs = [_record(0, "COMPLETE", "A", 0, f"{w}/a0"), _record(1, "COMPLETE", "A", 1, f"{w}/a1"),
          _record(2, "COMPLETE", "B", 0, f"{w}/b0"), _record(3, "PRUNED", "C", 0, f"{w}/p"),
          _record(4, "FAIL", "D", 0, f"{w}/missing", error="boom")]
  t = report.write(w, recs, "val/acc/mean@4", order=["B", "A"])
  # The budget every finished run reached at an evaluation: 400 (B's last). A at 400 samples:
  # seed 0: 0.6 + 100/300 * 0.2, seed 1: 0.4 + 100/300 * 0.2.
  assert t["budget_samples"] == 400 and list(t["settings"]) == ["B", "A"]
  a = t["settings"]["A"]["mean@4_at_samples"]
  np.testing.assert_allclose(a["values"], [0.6 + 0.2 / 3, 0.4 + 0.2 / 3], rtol=1e-12)
  assert a["mean"] == pytest.approx(0.5 + 0.2 / 3) and a["std"] == pytest.approx(np.std([0.2, 0.0], ddof=1) * 1)
  assert t["settings"]["B"]["mean@4_at_samples"]["values"] == [0.5] and t["best"] == "A"
  # Samples in dropped groups by step 2 (the last every finished run evaluated): 2 x 300 x (1 - kept).
  assert t["settings"]["A"]["dropped_at_step"]["values"] == [300.0, 150.0]
  assert t["settings"]["B"]["dropped_at_step"]["values"] == [0.0]
  assert [(r["setting"], r["state"], r["samples"], r["value"]) for r in t["stopped"]] == [
      ("C", "PRUNED", 500.0, 0.1), ("D", "FAIL", 0.0, None)]
  assert t["spent"] == {"finished": 1600.0, "finished_runs": 3, "stopped": 500.0}
  md = open(f"{w}/table.md").read()
  assert md.index("| B |") < md.index("| A |") and "| C | 0 | pruned | 500 | 0.100 |" in md
  assert "| samples by step 2 | of them in dropped groups |" in md and "| 600 | 225 |" in md
  assert "| D | 0 | fail | 0 |  | boom |" in md and "Best at 400 samples: A" in md
  assert json.load(open(f"{w}/table.json"))["best"] == "A"
  with open(f"{w}/curves.png", "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert report.write(w, recs, "val/acc/mean@4", direction="minimize")["best"] == "B"


# --- the config side -------------------------------------------------------------------------------

def test_warm_start_key_follows_what_the_start_reads():
  file, args = sweep_builder.split_config_path(f"{ROOT}/configs/default.py")
  key = lambda **o: sweep_builder.start_key(sweep_builder.load_config(file, args, o))
  assert key() == key(**{"dapo.eps_high": 0.4, "optim.lr": 3e-4, "train.num_steps": 7, "rollout.max_new_tokens": 9,
                         "data.curriculum": True, "data.revisit_after": 3})
  for field, value in (("sft.lr", 1e-3), ("model.num_layers", 2), ("seed", 1), ("data.digits", 3),
                       ("rollout.env", "dapo_jax.envs:Calculator"), ("train.microbatch_tokens", 64)):
    assert key(**{field: value}) != key(), field
  with pytest.raises(sweep_builder.ConfigError, match="dapo.nope: names no config field"):
    sweep_builder.load_config(file, args, {"dapo.nope": 1})


def test_trial_command_and_shared_start(tmp_path):
  trials_ = sweep_builder.Trials(SMALL, {"train.num_steps": 3}, str(tmp_path), "launch.train")
  plan = trials_.plan({"dapo.eps_high": 0.3, ":task": "arith"}, 2)
  argv = plan.argv("OUT")
  assert argv[:3] == [sys.executable, "-m", "launch.train"]
  assert argv[3] == f"--config={ROOT}/configs/ablation.py:runlocal,task=arith,stage=dapo"
  assert "--config.train.num_steps=3" in argv and "--config.dapo.eps_high=0.3" in argv
  assert "--config.seed=2" in argv and argv[-1] == "--workdir=OUT" and plan.num_steps == 3
  assert f"--config.model.hf_dir={plan.start_dir}/sft_model" in argv and "--config.model.init=hf" in argv
  assert plan.start_argv[-1] == "--warm_start_only" and plan.start_dir.startswith(f"{tmp_path}/starts/")
  assert trials_.plan({"dapo.eps_high": 0.2}, 0).start_dir == plan.start_dir  # an RL field: one start


def test_a_recipes_sweep_function_is_its_space(tmp_path):
  s = sweep_builder.recipe_space(f"{ROOT}/configs/dapo_qwen2_5_32b.py")
  assert [s.overrides(p) for p in s.grid_points()] == [{"dapo.eps_high": v} for v in (0.24, 0.28, 0.32)]
  plan = sweep_builder.Trials(f"{ROOT}/configs/dapo_qwen2_5_32b.py:runlocal", {}, str(tmp_path), "launch.train").plan(
      s.overrides({space.POINT: 2}), 1)
  assert "--config.dapo.eps_high=0.32" in plan.argv("OUT") and "--config.seed=1" in plan.argv("OUT")
  assert sweep_builder.recipe_space(f"{ROOT}/configs/default.py") is None


def test_resuming_another_sweep_is_refused(tmp_path):
  s = space.from_specs(["dapo.eps_high=[0.2,0.3]"])
  cfg = study.SweepConfig(metric="val/acc/mean@2", report_every=10)
  study.Sweep(cfg, s, str(tmp_path), None, {"space": ["dapo.eps_high=[0.2,0.3]"]})
  study.Sweep(cfg, s, str(tmp_path), None, {"space": ["dapo.eps_high=[0.2,0.3]"]})  # the same: resumes
  with pytest.raises(study.SweepError, match=r"space=\['dapo.eps_high=\[0.2,0.3\]'\], this command has"):
    study.Sweep(cfg, s, str(tmp_path), None, {"space": ["dapo.eps_high=[0.2,0.4]"]})
  with pytest.raises(study.SweepError, match="needs --trials"):
    study.Sweep(study.SweepConfig(sampler="tpe", metric="m", report_every=1),
                space.from_specs(["a.b=range(0,1)"]), str(tmp_path / "x"), None, {})


def test_dry_run_lists_the_trials_and_names_a_refused_setting():
  env = dict(CHILD_ENV)
  run = lambda *a: subprocess.run([sys.executable, "-m", "launch.sweep", "--dry_run", *a], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=120)
  out = run("--space=dapo.eps_high=[0.28,0.4]", "--space=optim.lr=[1e-4,3e-4]", "--seeds=2")
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.splitlines()
  assert lines[0] == "# 4 settings x 2 seed(s) = 8 trials (grid, in this order)"
  assert [x.split()[0] for x in lines[1:5]] == [f"dapo.eps_high={e},optim.lr={lr}" for e in (0.28, 0.4)
                                               for lr in (0.0001, 0.0003)]
  assert len({x.split("warm start ")[1] for x in lines[1:5]}) == 1  # One shared start.
  out = run("--space=dapo.eps_high=[0.28,-1]")
  assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == (
      "error: --space setting dapo.eps_high=-1: dapo.eps_high=-1.0: expected > 0")
  out = run("--space=dapo.eps_high=uniform(0,1)")
  assert out.returncode == 1 and "error: --space='dapo.eps_high=uniform(0,1)'" in out.stderr


# --- real sweeps -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_pruned_trials_stop_early_with_their_checkpoint(tmp_path):
  """The first setting writes 8-token answers; the pruner, reading response length at equal samples,
  stops the 4- and 2-token settings at their first reports, after a step, with a checkpoint."""
  w = str(tmp_path / "sweep")
  s = space.from_specs(["rollout.max_new_tokens=[8,4,2]"])
  cfg = study.SweepConfig(pruner="median", prune_after=1, metric="response_length/mean", report_every=32,
                          poll_s=0.2)
  t = sweep_builder.run(SMALL, {**FIXED, "train.num_steps": 40}, s, cfg, w, "launch.train", {"space": "t"},
                        env=CHILD_ENV)
  st = optuna.load_study(study_name=study.STUDY_NAME, storage=f"sqlite:///{w}/study.db")
  states = {t_.user_attrs["setting"]: t_.state.name for t_ in st.trials}
  assert states == {"rollout.max_new_tokens=8": "COMPLETE", "rollout.max_new_tokens=4": "PRUNED",
                    "rollout.max_new_tokens=2": "PRUNED"}
  for setting in ("rollout.max_new_tokens=4", "rollout.max_new_tokens=2"):
    run = study.run_dir(w, setting, 0)
    steps = sorted(json.loads(line)["step"] for line in open(f"{run}/metrics.jsonl"))
    assert steps[-1] < 40  # Stopped early ...
    assert sorted(int(d) for d in os.listdir(f"{run}/checkpoints") if d.isdigit())[-1] == steps[-1]  # ... saved
    assert "Stopped by SIGTERM" in open(f"{run}/{trials.LOG_FILE}").read()
  # One warm start, shared: the trials load it.
  assert len(os.listdir(f"{w}/starts")) == 1
  assert [r["state"] for r in t["stopped"]] == ["PRUNED", "PRUNED"] and list(t["settings"]) == [
      "rollout.max_new_tokens=8"]
  assert "pruned" in open(f"{w}/table.md").read()


@pytest.mark.slow
def test_a_failed_trial_is_recorded_with_its_last_line_and_the_sweep_goes_on(tmp_path):
  """A reward that does not exist fails each of its trials at start; the other setting runs; the report
  names the failure."""
  w = str(tmp_path / "sweep")
  s = space.from_specs(["reward.fn=[dapo_jax.testing:no_such_reward,dapo_jax.testing:length_reward]"])
  cfg = study.SweepConfig(pruner="none", metric="val/acc/mean@2", report_every=32, poll_s=0.2)
  t = sweep_builder.run(SMALL, {"train.num_steps": 1}, s, cfg, w, "launch.train", {"space": "f"}, env=CHILD_ENV)
  (failed,) = t["stopped"]
  assert failed["state"] == "FAIL" and failed["setting"] == "reward.fn=dapo_jax.testing_no_such_reward"
  assert "has no function 'no_such_reward'" in failed["error"]  # The trial's own one-line error.
  assert list(t["settings"]) == ["reward.fn=dapo_jax.testing_length_reward"]
  st = optuna.load_study(study_name=study.STUDY_NAME, storage=f"sqlite:///{w}/study.db")
  assert [x.state.name for x in st.trials] == ["FAIL", "COMPLETE"]
  assert "has no function" in open(f"{w}/table.md").read()


@pytest.mark.slow
def test_a_random_sweep_draws_its_settings_from_the_range(tmp_path):
  w = str(tmp_path / "sweep")
  s = space.from_specs(["dapo.eps_high=range(0.2,0.3)"])
  cfg = study.SweepConfig(sampler="random", trials=2, pruner="none", metric="val/acc/mean@2", report_every=32,
                          poll_s=0.2, sampler_seed=3)
  t = sweep_builder.run(SMALL, {**FIXED, "train.num_steps": 1}, s, cfg, w, "launch.train", {"space": "r"},
                        env=CHILD_ENV)
  st = optuna.load_study(study_name=study.STUDY_NAME, storage=f"sqlite:///{w}/study.db")
  values = [x.params["dapo.eps_high"] for x in st.trials]
  assert [x.state.name for x in st.trials] == ["COMPLETE", "COMPLETE"] and len(set(values)) == 2
  assert all(0.2 <= v <= 0.3 for v in values) and len(t["settings"]) == 2
  for v in values:  # Each trial ran with its value.
    run = study.run_dir(w, space.label({"dapo.eps_high": v}), 0)
    assert json.load(open(f"{run}/config.json"))["dapo"]["eps_high"] == v


@pytest.mark.slow
def test_killed_sweep_resumes_without_rerunning_finished_trials(tmp_path):
  w = str(tmp_path / "sweep")
  cmd = [sys.executable, "-m", "launch.sweep", f"--config={SMALL}", f"--workdir={w}", "--space=dapo.eps_high=[0.2,0.3]",
         "--pruner=none", "--config.train.num_steps=12", "--config.train.ckpt_every=1",
         f"--config.reward.fn={FIXED['reward.fn']}"]
  first = subprocess.Popen(cmd, cwd=ROOT, env=CHILD_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  second = study.run_dir(w, "dapo.eps_high=0.3", 0)  # The grid's second setting.
  deadline = time.time() + 400
  while time.time() < deadline:  # Until the second trial has logged two steps.
    path = f"{second}/metrics.jsonl"
    if os.path.exists(path) and max((json.loads(x)["step"] for x in open(path)), default=0) >= 2:
      break
    assert first.poll() is None, first.stdout.read()
    time.sleep(0.2)
  first.send_signal(signal.SIGKILL)
  first.wait()
  done = study.run_dir(w, "dapo.eps_high=0.2", 0)
  finished = open(f"{done}/metrics.jsonl").read()
  while trials.busy(second):  # The orphan got SIGTERM and is saving its checkpoint.
    time.sleep(0.2)
  log = open(f"{second}/{trials.LOG_FILE}").read()
  assert "Stopped by SIGTERM" in log
  stopped_at = int(log.split("Stopped by SIGTERM after rollout step ")[1].split(";")[0])
  assert 2 <= stopped_at < 12

  out = subprocess.run(cmd, cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "trial 1 (dapo.eps_high=0.3, seed 0) was running when the sweep stopped: resuming it" in out.stdout
  assert "=== trial 0" not in out.stdout and open(f"{done}/metrics.jsonl").read() == finished  # Not rerun.
  resumed = open(f"{second}/{trials.LOG_FILE}").read()
  assert f"Resumed from {second}/checkpoints at rollout step {stopped_at}." in resumed
  st = optuna.load_study(study_name=study.STUDY_NAME, storage=f"sqlite:///{w}/study.db")
  assert [t.state.name for t in st.trials] == ["COMPLETE", "COMPLETE"]
  steps = [json.loads(x)["step"] for x in open(f"{second}/metrics.jsonl")]
  assert sorted(set(steps)) == list(range(13))  # Every step once logged, none lost.
  assert "| dapo.eps_high=0.2 |" in out.stdout and "| dapo.eps_high=0.3 |" in out.stdout
