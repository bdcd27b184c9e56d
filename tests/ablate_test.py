"""The ablation driver on the runlocal shrink: two stages, one seed, from one shared warm start.
The table is checked against the runs' own metrics.jsonl, the plot is a PNG, and a second
invocation (the command line) re-runs nothing."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from dapo_jax import metrics, sharding, testing
from dapo_jax.builders import ablation
from launch import ablate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = f"{ROOT}/configs/ablation.py:runlocal"
STAGES = ["naive_grpo", "dapo"]
# Correctness that varies inside groups even for a barely trained model, so both stages update.
OVERRIDES = {"reward.fn": "dapo_jax.testing:length_reward"}


def jsonl(workdir, stage):
  return metrics.read_jsonl(os.path.join(ablation.run_dir(workdir, stage, 0), "metrics.jsonl"))


@pytest.mark.slow
def test_ablation_table_plot_and_no_rerun(tmp_path):
  workdir = str(tmp_path / "ablation")
  cfgs = ablate.stage_configs(CONFIG, OVERRIDES, STAGES)
  Q, G, N = cfgs["dapo"].dapo.prompts_per_step, cfgs["dapo"].rollout.group_size, cfgs["dapo"].train.num_steps
  # One device, as the command line below runs (the 8 test devices would only slow compiling).
  t = ablation.run(cfgs, 1, workdir, sharding.make_mesh(cfgs["dapo"].mesh, jax.devices()[:1]))

  # Both runs started from the one warm start (trained once, into start/).
  assert os.path.exists(os.path.join(workdir, "start", "sft_model", "model.safetensors"))
  recs = {s: jsonl(workdir, s) for s in STAGES}
  assert all(sorted(r) == list(range(N + 1)) for r in recs.values())
  # Same start, same seed: the held-out evaluation before RL is the same sampling of the same model.
  for k in ("val/acc/mean@2", "val/acc/greedy"):
    assert recs["naive_grpo"][0][k] == recs["dapo"][0][k]
  # Without dynamic sampling a step generates exactly Q groups of G; with it, at least that many.
  assert [recs["naive_grpo"][s]["rollout/samples"] for s in range(1, N + 1)] == [Q * G] * N
  assert all(recs["dapo"][s]["rollout/samples"] >= Q * G for s in range(1, N + 1))
  total = {s: sum(recs[s][i]["rollout/samples"] for i in range(1, N + 1)) for s in STAGES}

  saved = json.load(open(os.path.join(workdir, "table.json")))
  assert saved["stages"].keys() == set(STAGES) and saved["eval"] == "mean@2"
  assert saved["budget_step"] == N and saved["budget_samples"] == min(total.values())
  for s in STAGES:
    row, last = saved["stages"][s], recs[s][N]
    assert row["samples_at_step"]["mean"] == total[s]
    assert row["mean@2_at_step"]["values"] == [last["val/acc/mean@2"]]
    assert row["greedy_at_step"]["values"] == [last["val/acc/greedy"]]
    assert row["before_rl"]["values"] == [recs[s][0]["val/acc/mean@2"]]
    assert row["truncated_start"]["values"] == [recs[s][1]["response_length/clip_ratio"]]
    ends = [recs[s][i]["actor/entropy"] for i in range(max(1, N - ablation.END_STEPS + 1), N + 1)]
    assert row["entropy"]["mean"] == pytest.approx(np.mean(ends), rel=1e-12)
    for field in ("mean@2_at_samples", "greedy_at_samples", "length", "truncated", "clip_high", "clip_low"):
      assert np.isfinite(row[field]["mean"]) and row[field]["std"] == 0.0, (s, field)
  # The stage that generated the fewest samples is read at its last evaluation; the other is
  # interpolated between its evaluations at that budget.
  fewest = min(STAGES, key=total.get)
  assert saved["stages"][fewest]["mean@2_at_samples"]["mean"] == pytest.approx(recs[fewest][N]["val/acc/mean@2"])
  assert t["stages"].keys() == saved["stages"].keys()

  md = open(os.path.join(workdir, "table.md")).read()
  for s in STAGES:
    row = saved["stages"][s]
    assert f"| {s} | {row['mean@2_at_samples']['mean']:.3f} ± 0.000 |" in md
  assert f"mean@2 at {min(total.values()):,.0f} samples" in md

  png = os.path.join(workdir, "curves.png")
  with open(png, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  from matplotlib import image
  assert image.imread(png).shape[2] in (3, 4)

  # The same command again: every run is finished, nothing trains, the table is rewritten.
  before = {s: open(os.path.join(ablation.run_dir(workdir, s, 0), "metrics.jsonl")).read() for s in STAGES}
  os.remove(os.path.join(workdir, "table.md"))
  out = subprocess.run(
      [sys.executable, "-m", "launch.ablate", f"--config={CONFIG}", f"--stages={','.join(STAGES)}", "--seeds=1",
       f"--workdir={workdir}", f"--config.reward.fn={OVERRIDES['reward.fn']}"],
      cwd=ROOT, env=dict(os.environ, XLA_FLAGS=testing.FAST_COMPILE_XLA_FLAGS, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT), capture_output=True,
      text=True, timeout=300)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  for s in STAGES:
    assert f"{ablation.run_dir(workdir, s, 0)}: finished, not re-run" in out.stdout
    assert open(os.path.join(ablation.run_dir(workdir, s, 0), "metrics.jsonl")).read() == before[s]
  assert "Held-out before RL" not in out.stdout and open(os.path.join(workdir, "table.md")).read() == md
