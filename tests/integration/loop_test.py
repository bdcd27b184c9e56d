"""The DAPO loop end to end on a tiny config: metrics, checkpoints, resume, stop signals."""
import ast
import glob
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
from tensorboard.backend.event_processing import event_accumulator

from configs import dapo_qwen2_5_32b
from dapo_jax import builders, metrics, testing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A toy reward with mixed correctness inside groups, so dynamic sampling keeps groups and the
# random tiny model still gets updates.
REWARD = "dapo_jax.testing:length_reward"


def tiny_cfg(**train):
  cfg = dapo_qwen2_5_32b.get_config("runlocal")
  cfg.reward.fn = REWARD
  cfg.train.update(train)
  return cfg


def test_runlocal_loop_logs_checkpoints_and_resumes(tmp_path):
  workdir = str(tmp_path / "run")
  last = builders.run(tiny_cfg(num_steps=2, ckpt_every=1, eval_every=2), workdir)
  assert math.isfinite(last["actor/pg_loss"]) and last["train/num_gen_batches"] >= 1
  recs = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  assert sorted(recs) == [0, 1, 2] and "val/acc/mean@2" in recs[0] and "val/acc/mean@2" in recs[2]
  for key in ("critic/score/mean", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm",
              "actor/lr", "response_length/mean", "train/kept_fraction", "timing_s/gen", "perf/throughput"):
    assert key in recs[2], key
  acc = event_accumulator.EventAccumulator(os.path.join(workdir, "tb"))
  acc.Reload()
  assert [e.step for e in acc.Scalars("actor/pg_loss")] == [1, 2]
  assert os.path.isdir(os.path.join(workdir, "checkpoints", "2"))
  # Same command with more steps: resumes at step 2 and runs step 3 only.
  last = builders.run(tiny_cfg(num_steps=3, ckpt_every=1, eval_every=0), workdir)
  recs = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  assert sorted(recs) == [0, 1, 2, 3]
  assert os.path.isdir(os.path.join(workdir, "checkpoints", "3"))

  # The run remembers how it was made: sample, eval and export need no --config. Each answer shows
  # the recorded config, not the default one: the length reward scores, eval.k=2, a 32-wide model.
  def launch(*args):
    res = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env(), capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout
  out = launch("launch.sample", f"--workdir={workdir}", "--prompt=What is 38+46?", "--ground_truth=84", "--k=2",
               "--max_new_tokens=4").splitlines()
  assert out[0] == "prompt 1/1: 'What is 38+46? End with: Answer: <number>'  (ground truth '84')"
  for line in [x for x in out if x.startswith("  ")]:
    text, score = line.split(": ", 1)[1].rsplit("  [score ", 1)
    assert score.startswith(f"{testing.length_reward(ast.literal_eval(text), '84')['score']:+.2f},"), line
  result = json.loads(launch("launch.eval", f"--workdir={workdir}").splitlines()[-1])
  assert result["rollout_step"] == 3 and result["num_prompts"] == 8 and "val/acc/mean@2" in result, result
  launch("launch.export", f"--workdir={workdir}", f"--out={tmp_path / 'exported'}")
  exported = json.load(open(tmp_path / "exported" / "config.json"))
  assert (exported["hidden_size"], exported["num_hidden_layers"]) == (32, 2), exported


def test_bad_reward_path_fails_at_start(tmp_path):
  cfg = tiny_cfg()
  cfg.reward.fn = "no_such_pkg.rewards:score"
  with pytest.raises(Exception, match="no_such_pkg"):
    builders.dapo(cfg, str(tmp_path)).close()


@pytest.mark.parametrize("field,value", [("num_microbatches", -1), ("num_microbatches", 3),
                                         ("microbatch_tokens", 0)])
def test_bad_microbatching_is_named_at_start(tmp_path, field, value):
  cfg = tiny_cfg()
  cfg.train[field] = value
  with pytest.raises(ValueError, match=f"train.{field}={value}"):
    builders.dapo(cfg, str(tmp_path)).close()


def train_cmd(workdir, steps):
  return [sys.executable, "-m", "launch.train", f"--config={ROOT}/configs/dapo_qwen2_5_32b.py:runlocal",
          f"--workdir={workdir}", f"--config.reward.fn={REWARD}", f"--config.train.num_steps={steps}",
          "--config.train.ckpt_every=1", "--config.train.eval_every=0"]


def env():
  return dict(os.environ, XLA_FLAGS=testing.FAST_COMPILE_XLA_FLAGS, JAX_PLATFORMS="cpu")


def wait_for(pred, timeout):
  t0 = time.time()
  while time.time() - t0 < timeout:
    if pred():
      return True
    time.sleep(0.2)
  return False


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_checkpoints_and_exits_cleanly(tmp_path, sig):
  workdir = str(tmp_path / "run")
  p = subprocess.Popen(train_cmd(workdir, 1000), cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
  assert wait_for(lambda: os.path.exists(os.path.join(workdir, "metrics.jsonl")) and
                  len(open(os.path.join(workdir, "metrics.jsonl")).readlines()) >= 2, 300)
  p.send_signal(sig)
  out, _ = p.communicate(timeout=120)
  assert p.returncode == 0, out
  assert "Run the same command again to resume" in out
  steps = [int(os.path.basename(d)) for d in glob.glob(os.path.join(workdir, "checkpoints", "*"))
           if os.path.basename(d).isdigit()]
  recs = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  assert max(steps) == max(recs)  # The last logged step is checkpointed.
