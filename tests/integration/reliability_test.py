"""Bad input is named in one line; nothing half-written or non-finite is trusted."""
import logging
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import dapo_qwen2_5_32b
from dapo_jax import checkpoint, builders, loop, testing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny_cfg(**train):
  cfg = dapo_qwen2_5_32b.get_config("runlocal")
  cfg.reward.fn = "dapo_jax.testing:length_reward"
  cfg.train.update(train)
  return cfg


def run_train(*args):
  env = dict(os.environ, XLA_FLAGS=testing.FAST_COMPILE_XLA_FLAGS, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "launch.train", *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)


def test_mistyped_override_is_one_line(tmp_path):
  out = run_train(f"--workdir={tmp_path}", "--config.dapo.eps_hihg=0.3")
  assert out.returncode == 1
  assert out.stderr.strip().splitlines()[-1].startswith("error: config override --config.dapo.eps_hihg")
  assert "Traceback" not in out.stderr
  out = run_train(f"--workdir={tmp_path}", "--config.dapo.eps_high=abc")
  assert out.returncode == 1 and "eps_high=abc" in out.stderr and "Traceback" not in out.stderr


def test_missing_dataset_is_one_line(tmp_path):
  out = run_train(f"--config={ROOT}/configs/dapo_qwen2_5_32b.py:runlocal", f"--workdir={tmp_path}",
                  "--config.data.task=file", "--config.data.train_files=/no/such/file.parquet")
  assert out.returncode == 1 and "Traceback" not in out.stderr
  assert out.stderr.strip().splitlines()[-1] == "error: dataset file '/no/such/file.parquet' does not exist"


def test_checkpoint_from_another_config_is_named(tmp_path):
  workdir = str(tmp_path)
  builders.run(tiny_cfg(num_steps=1, ckpt_every=1, eval_every=0), workdir)
  cfg = tiny_cfg(num_steps=2, eval_every=0)
  cfg.model.mlp_dim = 96
  # The run's recorded config names the field at start...
  with pytest.raises(checkpoint.CheckpointMismatchError, match=r"model.mlp_dim=64, this config has model.mlp_dim=96"):
    builders.dapo(cfg, workdir)
  # ...and without it, the checkpoint itself names the array and both shapes.
  os.remove(os.path.join(workdir, "config.json"))
  with pytest.raises(checkpoint.CheckpointMismatchError, match=r"w_down_FD has shape \(2, 64, 32\).*\(2, 96, 32\)"):
    with builders.dapo(cfg, workdir) as dapo:
      dapo.restore()


def test_half_written_checkpoint_falls_back_to_the_last_intact_one(tmp_path, caplog):
  """A run checkpointed at steps 1 and 2 whose step-2 files were cut short resumes from step 1."""
  workdir = str(tmp_path)
  builders.run(tiny_cfg(num_steps=2, ckpt_every=1, eval_every=0), workdir)
  step2 = os.path.join(workdir, "checkpoints", "2")
  for root, _, files in os.walk(os.path.join(step2, "state")):
    for f in files:  # What a copy or a write stopped half-way leaves.
      path = os.path.join(root, f)
      with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) // 2)
  with builders.dapo(tiny_cfg(num_steps=2, ckpt_every=1, eval_every=0), workdir) as dapo:
    with caplog.at_level(logging.WARNING):
      assert dapo.restore() == 1
    assert f"checkpoint {step2}" in caplog.text and "falling back" in caplog.text
    ref = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
    _, state1, _ = ref.restore_latest(checkpoint.abstract(dapo.state, dapo.trainer.state_sharding))
    ref.close()
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), dapo.state, state1)


@pytest.mark.slow
def test_damaged_checkpoints_from_the_command_line(tmp_path):
  """The CLI resumes past a damaged newest step, and stops in one line when every step is damaged."""
  workdir = str(tmp_path)
  args = [f"--config={ROOT}/configs/dapo_qwen2_5_32b.py:runlocal", f"--workdir={workdir}",
          "--config.reward.fn=dapo_jax.testing:length_reward", "--config.train.ckpt_every=1",
          "--config.train.eval_every=0"]
  assert run_train(*args, "--config.train.num_steps=1").returncode == 0
  os.makedirs(os.path.join(workdir, "checkpoints", "2"))  # A step directory with nothing in it.
  out = run_train(*args, "--config.train.num_steps=2")
  assert out.returncode == 0, out.stderr[-2000:]
  assert f"checkpoint {workdir}/checkpoints/2" in out.stderr and "at rollout step 1." in out.stdout
  for root, _, files in os.walk(os.path.join(workdir, "checkpoints")):
    for f in files:
      path = os.path.join(root, f)
      if "/state/" in path and os.path.getsize(path) > 1000:
        raw = bytearray(open(path, "rb").read())
        raw[len(raw) // 2: len(raw) // 2 + 64] = b"\x7f" * 64
        open(path, "wb").write(bytes(raw))
  out = run_train(*args, "--config.train.num_steps=3")
  assert out.returncode == 1 and "Traceback" not in out.stderr
  assert out.stderr.strip().splitlines()[-1] == (
      f"error: every checkpoint in {workdir}/checkpoints is damaged ({workdir}/checkpoints/2, "
      f"{workdir}/checkpoints/1); delete them to start over, or restore them from a backup")


def test_nonfinite_updates_stop_after_k_in_a_row(tmp_path):
  """Fault injection: the frozen reference model's weights are NaN, so every update's KL term (and
  loss) is non-finite while rollouts stay sound. (A NaN reward no longer gets this far: it is a
  counted failure, tests/rewards_test.py.)"""
  cfg = tiny_cfg(num_steps=10, ckpt_every=1, eval_every=0, max_bad_steps=2)
  cfg.dapo.kl_coef = 0.1
  with builders.dapo(cfg, str(tmp_path)) as dapo:
    dapo.ref_params = jax.tree.map(lambda x: x * np.nan, dapo.ref_params)
    with pytest.raises(loop.TrainingError, match="2 updates in a row had a non-finite"):
      dapo.run()
  assert not os.path.isdir(tmp_path / "checkpoints" / "1")  # The bad step is not checkpointed.


@pytest.mark.slow
def test_full_disk_is_a_clear_error_and_keeps_checkpoints(tmp_path):
  mnt = tmp_path / "small_disk"
  mnt.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True).returncode:
    pytest.skip("needs permission to mount a small tmpfs")
  try:
    workdir = str(mnt / "run")
    args = [f"--config={ROOT}/configs/dapo_qwen2_5_32b.py:runlocal", f"--workdir={workdir}",
            "--config.reward.fn=dapo_jax.testing:length_reward", "--config.train.ckpt_every=1",
            "--config.train.eval_every=0"]
    assert run_train(*args, "--config.train.num_steps=1").returncode == 0
    free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
    with open(mnt / "filler", "wb") as f:  # Leave a few KB: less than one checkpoint.
      f.write(b"\0" * max(free - 8192, 0))
    out = run_train(*args, "--config.train.num_steps=3")
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "error: no space left on device" in out.stderr and "Traceback" not in out.stderr.splitlines()[-1]
    os.remove(mnt / "filler")
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
    assert ckpt.latest_step() == 1  # The earlier checkpoint is intact and still the latest.
    ckpt.close()
    out = run_train(*args, "--config.train.num_steps=2")
    assert out.returncode == 0 and "Resumed" in out.stdout
  finally:
    subprocess.run(["umount", str(mnt)], capture_output=True)


def _default_job(workdir, steps):
  """The default job (configs/default.py: tokenizer, SFT warm start, DAPO), shrunk to seconds a step.

  The held-out set is large enough that an evaluation lasts seconds, so a kill aimed inside one lands there
  even on a loaded machine."""
  return [sys.executable, "-m", "launch.train", f"--workdir={workdir}", f"--config.train.num_steps={steps}",
          "--config.model.embed_dim=32", "--config.model.mlp_dim=64", "--config.model.num_layers=2",
          "--config.model.head_dim=8", "--config.tokenizer.vocab_size=300", "--config.sft.steps=30",
          "--config.sft.target_acc=0.0", "--config.sft.batch_size=8", "--config.sft.seq_len=64",
          "--config.dapo.prompts_per_step=4", "--config.dapo.gen_prompts=8", "--config.rollout.group_size=4",
          "--config.rollout.max_new_tokens=16", "--config.dapo.overlong_buffer=4", "--config.data.num_eval=256",
          "--config.train.ckpt_every=1", "--config.train.eval_every=2", "--config.train.log_samples_every=0",
          "--config.reward.fn=dapo_jax.testing:length_reward"]


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_matches_uninterrupted_run(tmp_path):
  """SIGKILL during SFT, mid rollout step, during a held-out evaluation and while a checkpoint is
  written; each resume ends with the metrics of an uninterrupted run."""
  import random
  import signal
  import time

  from dapo_jax import metrics
  steps, rng = 5, random.Random(0)
  ref_dir, dir_ = tmp_path / "ref", tmp_path / "killed"
  env = dict(os.environ, XLA_FLAGS=testing.FAST_COMPILE_XLA_FLAGS, JAX_PLATFORMS="cpu")
  out = subprocess.run(_default_job(ref_dir, steps), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]

  def logged():
    path = dir_ / "metrics.jsonl"
    return len(open(path).read().splitlines()) if path.exists() else 0

  def saving():
    return any(".orbax-checkpoint-tmp" in p for p in os.listdir(dir_ / "checkpoints")) \
        if (dir_ / "checkpoints").exists() else False

  moments = [  # (what, the condition to wait for, extra random delay in seconds)
      ("SFT", lambda: (dir_ / "tokenizer" / "tokenizer.json").exists(), rng.uniform(0.5, 3.0)),
      ("rollout/update", lambda: logged() >= 2, rng.uniform(0.0, 2.0)),  # steps 0 and 1 logged: step 2 runs
      # Step 4's rollouts are dumped as it ends; its evaluation runs next, before its metrics are logged.
      ("evaluation", lambda: (dir_ / "rollouts" / "step_4.jsonl.gz").exists(), 0.0),
      ("checkpoint write", saving, 0.0),
  ]
  killed = []
  for what, cond, delay in moments:
    p = subprocess.Popen(_default_job(dir_, steps), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    t0 = time.time()
    while not cond() and p.poll() is None and time.time() - t0 < 300:
      time.sleep(0.02)
    time.sleep(delay)
    if p.poll() is None:
      p.send_signal(signal.SIGKILL)
      killed.append(what)
    p.wait()
    if what == "evaluation":  # Killed inside it: neither its samples nor step 4's metrics were written.
      assert not (dir_ / "rollouts" / "eval_step_4.jsonl.gz").exists() and 4 not in metrics.read_jsonl(
          str(dir_ / "metrics.jsonl")), "the kill missed the evaluation"
  assert {"SFT", "rollout/update", "evaluation"} <= set(killed), killed
  out = subprocess.run(_default_job(dir_, steps), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  ref = metrics.read_jsonl(str(ref_dir / "metrics.jsonl"))
  got = metrics.read_jsonl(str(dir_ / "metrics.jsonl"))
  assert sorted(got) == sorted(ref) == list(range(steps + 1))
  for step in range(steps + 1):
    for k, v in ref[step].items():
      if k.startswith(("timing_s/", "perf/")):
        continue
      assert got[step][k] == pytest.approx(v, rel=1e-6, abs=1e-7), (step, k, killed)
