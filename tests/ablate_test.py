"""The ablation driver (a sweep over the stages) on the runlocal shrink: two stages, one seed, from one
shared warm start. The table is checked against the runs' own metrics.jsonl; a stage run by hand with
`launch.train` from the same start and seed logs the same numbers as the sweep's trial; the plot is a
PNG; and a second invocation re-runs nothing."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dapo_jax import metrics, testing
from dapo_jax.sweep import report, study

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = f"{ROOT}/configs/ablation.py:runlocal"
STAGES = ["naive_grpo", "dapo"]
# Correctness that varies inside groups even for a barely trained model, so both stages update.
REWARD = "--config.reward.fn=dapo_jax.testing:length_reward"
ENV = dict(os.environ, XLA_FLAGS=testing.FAST_COMPILE_XLA_FLAGS, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
TIMING = ("timing_s/", "perf/", "time/")  # wall-clock metrics: the only ones two identical runs may differ in


def run_dir(workdir, stage):
  return study.run_dir(workdir, f"stage={stage}", 0)


def ablate(workdir):
  out = subprocess.run([sys.executable, "-m", "launch.ablate", f"--config={CONFIG}", f"--stages={','.join(STAGES)}",
                        "--seeds=1", f"--workdir={workdir}", REWARD], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return out.stdout


@pytest.mark.slow
def test_ablation_table_plot_same_numbers_and_no_rerun(tmp_path):
  workdir = str(tmp_path / "ablation")
  ablate(workdir)
  recs = {s: metrics.read_jsonl(os.path.join(run_dir(workdir, s), "metrics.jsonl")) for s in STAGES}
  cfg = json.load(open(os.path.join(run_dir(workdir, "dapo"), "config.json")))
  Q, G, N = cfg["dapo"]["prompts_per_step"], cfg["rollout"]["group_size"], cfg["train"]["num_steps"]

  # Both runs started from the one warm start (trained once, into starts/<key>/).
  (start,) = os.listdir(os.path.join(workdir, "starts"))
  start = os.path.join(workdir, "starts", start, "sft_model")
  assert os.path.exists(os.path.join(start, "model.safetensors")) and cfg["model"]["hf_dir"] == start
  assert all(sorted(r) == list(range(N + 1)) for r in recs.values())
  # Same start, same seed: the held-out evaluation before RL is the same sampling of the same model.
  for k in ("val/acc/mean@2", "val/acc/greedy"):
    assert recs["naive_grpo"][0][k] == recs["dapo"][0][k]
  # Without dynamic sampling a step generates exactly Q groups of G; with it, at least that many.
  assert [recs["naive_grpo"][s]["rollout/samples"] for s in range(1, N + 1)] == [Q * G] * N
  assert all(recs["dapo"][s]["rollout/samples"] >= Q * G for s in range(1, N + 1))
  total = {s: sum(recs[s][i]["rollout/samples"] for i in range(1, N + 1)) for s in STAGES}

  saved = json.load(open(os.path.join(workdir, "table.json")))
  assert list(saved["settings"]) == STAGES and saved["eval"] == "mean@2"  # The stages' order.
  assert saved["budget_step"] == N and saved["budget_samples"] == min(total.values())
  for s in STAGES:
    row, last = saved["settings"][s], recs[s][N]
    assert row["samples_at_step"]["mean"] == total[s]
    assert row["mean@2_at_step"]["values"] == [last["val/acc/mean@2"]]
    assert row["greedy_at_step"]["values"] == [last["val/acc/greedy"]]
    assert row["before_rl"]["values"] == [recs[s][0]["val/acc/mean@2"]]
    assert row["truncated_start"]["values"] == [recs[s][1]["response_length/clip_ratio"]]
    ends = [recs[s][i]["actor/entropy"] for i in range(max(1, N - report.END_STEPS + 1), N + 1)]
    assert row["entropy"]["mean"] == pytest.approx(np.mean(ends), rel=1e-12)
    for field in ("mean@2_at_samples", "greedy_at_samples", "length", "truncated", "clip_high", "clip_low"):
      assert np.isfinite(row[field]["mean"]) and row[field]["std"] == 0.0, (s, field)
  # The stage that generated the fewest samples is read at its last evaluation; the other is
  # interpolated between its evaluations at that budget.
  fewest = min(STAGES, key=total.get)
  assert saved["settings"][fewest]["mean@2_at_samples"]["mean"] == pytest.approx(recs[fewest][N]["val/acc/mean@2"])
  md = open(os.path.join(workdir, "table.md")).read()
  for s in STAGES:
    assert f"| {s} | {saved['settings'][s]['mean@2_at_samples']['mean']:.3f} ± 0.000 |" in md
  assert f"mean@2 at {min(total.values()):,.0f} samples" in md
  from matplotlib import image
  assert image.imread(os.path.join(workdir, "curves.png")).shape[2] in (3, 4)

  # The dapo stage by hand, as `launch.train` runs it from the same start and seed: the same numbers.
  by_hand = str(tmp_path / "by_hand")
  out = subprocess.run([sys.executable, "-m", "launch.train", f"--config={CONFIG},task=arith,stage=dapo", REWARD,
                        "--config.seed=0", "--config.model.init=hf", f"--config.model.hf_dir={start}",
                        f"--workdir={by_hand}"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  hand = metrics.read_jsonl(os.path.join(by_hand, "metrics.jsonl"))
  assert hand.keys() == recs["dapo"].keys()
  for step, rec in hand.items():
    same = {k: v for k, v in rec.items() if not k.startswith(TIMING)}
    assert same == {k: v for k, v in recs["dapo"][step].items() if not k.startswith(TIMING)}, step

  # The same command again: every trial is finished, nothing trains, the table is rewritten.
  before = {s: open(os.path.join(run_dir(workdir, s), "metrics.jsonl")).read() for s in STAGES}
  os.remove(os.path.join(workdir, "table.md"))
  stdout = ablate(workdir)
  assert "=== trial" not in stdout and "warm start" not in stdout
  for s in STAGES:
    assert open(os.path.join(run_dir(workdir, s), "metrics.jsonl")).read() == before[s]
  assert open(os.path.join(workdir, "table.md")).read() == md
