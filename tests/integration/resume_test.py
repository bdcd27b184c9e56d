"""The supervised pipelines resume after kill -9 through their shared loop (`pipelines.fit`).

For each of SFT (the task's warm start), chat SFT, the reward model and DPO: one uninterrupted run,
and the same command killed with SIGKILL once a mid-run checkpoint is on disk, then run again. The
rerun resumes from the newest checkpoint and logs, at every step after it, the metrics of the run
that was never stopped (training metrics and held-out evaluations alike).
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from dapo_jax import metrics, testing

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, CKPT_EVERY = 300, 50  # The kill lands mid-run (250 steps left); few checkpoints to write. Logs every 10.


def env():
  return dict(os.environ, XLA_FLAGS=testing.FAST_COMPILE_XLA_FLAGS, JAX_PLATFORMS="cpu")


def run(*args):
  out = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env(), capture_output=True, text=True)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  return out.stdout


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("data"))
  run("launch.prepare", "arith_sft", f"--out={d}/sft.jsonl", "--num=200")
  run("launch.prepare", "arith_pairs", f"--out={d}/pairs.jsonl", "--num=64")
  run("launch.prepare", "arith_pairs", f"--out={d}/held.jsonl", "--num=8", "--split=heldout")
  run("launch.sft", "--config=configs/sft_chat_arith.py:runlocal", f"--workdir={d}/init",
      f"--config.data.train_files=('{d}/sft.jsonl',)")
  return d


def command(pipeline: str, d: str, workdir: str) -> tuple[list[str], str]:
  """(the launch command, the run directory its checkpoints and metrics.jsonl go to)."""
  if pipeline == "sft":
    return ["launch.sft", "--config=configs/dapo_qwen2_5_32b.py:runlocal", f"--workdir={workdir}",
            f"--config.sft.steps={STEPS}", f"--config.sft.ckpt_every={CKPT_EVERY}", "--config.sft.batch_size=4",
            "--config.sft.seq_len=32", "--config.sft.num_examples=64", "--config.sft.lr=1e-2"], f"{workdir}/sft"
  if pipeline == "chat_sft":
    return ["launch.sft", "--config=configs/sft_chat_arith.py:runlocal", f"--workdir={workdir}",
            f"--config.data.train_files=('{d}/sft.jsonl',)", f"--config.sft.steps={STEPS}",
            f"--config.sft.ckpt_every={CKPT_EVERY}", "--config.chat_sft.eval_every=50"], f"{workdir}/sft"
  return [f"launch.{pipeline}", f"--config=configs/{pipeline}_arith.py:runlocal", f"--workdir={workdir}",
          f"--config.{pipeline}.train_files=('{d}/pairs.jsonl',)", f"--config.{pipeline}.eval_files=('{d}/held.jsonl',)",
          f"--config.{pipeline}.init_dir={d}/init/sft_model", f"--config.{pipeline}.steps={STEPS}",
          f"--config.{pipeline}.ckpt_every={CKPT_EVERY}", f"--config.{pipeline}.eval_every=100"], workdir


def newest_checkpoint(run_dir: str) -> int:
  path = os.path.join(run_dir, "checkpoints")
  steps = [int(s) for s in os.listdir(path) if s.isdigit()] if os.path.isdir(path) else []
  return max(steps, default=0)


@pytest.mark.parametrize("pipeline", ["sft", "chat_sft", "rm", "dpo"])
def test_kill_9_then_resume_matches_uninterrupted_run(tmp_path, files, pipeline):
  ref_cmd, ref_dir = command(pipeline, files, str(tmp_path / "ref"))
  run(*ref_cmd)
  cmd, run_dir = command(pipeline, files, str(tmp_path / "killed"))
  p = subprocess.Popen([sys.executable, "-m", *cmd], cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
  t0 = time.time()
  while newest_checkpoint(run_dir) < CKPT_EVERY and p.poll() is None and time.time() - t0 < 300:
    time.sleep(0.01)
  p.send_signal(signal.SIGKILL)
  assert p.wait() == -signal.SIGKILL, "the run ended before it could be killed mid-run"
  killed_at = newest_checkpoint(run_dir)
  assert CKPT_EVERY <= killed_at < STEPS
  out = run(*cmd)
  assert "Resumed from" in out
  ref = metrics.read_jsonl(os.path.join(ref_dir, "metrics.jsonl"))
  got = metrics.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  later = [s for s in sorted(ref) if s > killed_at]
  assert later and STEPS in later and sorted(got) == sorted(ref)
  for step in later:
    assert ref[step].keys() == got[step].keys(), step
    for k, v in ref[step].items():
      if k.startswith(("timing_s/", "perf/")) or not isinstance(v, (int, float)):
        continue
      assert got[step][k] == pytest.approx(v, rel=1e-6, abs=1e-7), (step, k)
  # The pipeline recorded what it starts from and optimises; a rerun that changes it is refused, naming it.
  field, value = {"sft": ("sft.seq_len", 48), "chat_sft": ("chat_sft.assistant_only", False)}.get(
      pipeline, (f"{pipeline}.prompt_len", 40))
  name = "sft" if pipeline == "chat_sft" else pipeline
  assert os.path.exists(os.path.join(str(tmp_path / "killed"), f"{name}_config.json"))
  res = subprocess.run([sys.executable, "-m", *cmd, f"--config.{field}={value}"], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=300)
  last = res.stderr.strip().splitlines()[-1]
  assert res.returncode == 1 and f"was started with {field}=" in last and f"this config has {field}={value!r}" in last, \
      res.stderr[-2000:]
