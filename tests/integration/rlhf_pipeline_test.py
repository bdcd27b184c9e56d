"""The RLHF pipeline's entry points end to end on tiny files: prepare -> SFT (packed conversations)
-> reward model (HF export, resume) -> DPO, and a bad preference row named by file and row."""
import json
import os
import subprocess
import sys

import pytest

from dapo_jax import testing

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*args, check=True):
  env = dict(os.environ, XLA_FLAGS=testing.FAST_COMPILE_XLA_FLAGS, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, check=check, capture_output=True,
                        text=True)


def test_sft_rm_dpo_pipeline(tmp_path):
  d = str(tmp_path)
  run("launch.prepare", "arith_sft", f"--out={d}/sft.jsonl", "--num=200")
  run("launch.prepare", "arith_pairs", f"--out={d}/pairs.jsonl", "--num=64")
  run("launch.prepare", "arith_pairs", f"--out={d}/held.jsonl", "--num=8", "--split=heldout")
  out = run("launch.sft", "--config=configs/sft_chat_arith.py:runlocal", f"--workdir={d}/sft",
            f"--config.data.train_files=('{d}/sft.jsonl',)")
  assert "held-out loss" in out.stdout and os.path.exists(f"{d}/sft/sft_model/model.safetensors")
  pairs = [f"--config.{s}.train_files=('{d}/pairs.jsonl',)" for s in ("rm", "dpo")]
  held = [f"--config.{s}.eval_files=('{d}/held.jsonl',)" for s in ("rm", "dpo")]
  init = [f"--config.{s}.init_dir={d}/sft/sft_model" for s in ("rm", "dpo")]
  out = run("launch.rm", "--config=configs/rm_arith.py:runlocal", f"--workdir={d}/rm", pairs[0], held[0], init[0])
  assert "held-out pairwise accuracy" in out.stdout
  cfg = json.load(open(f"{d}/rm/rm_model/config.json"))
  assert cfg["architectures"] == ["Qwen2ForSequenceClassification"] and cfg["num_labels"] == 1
  again = run("launch.rm", "--config=configs/rm_arith.py:runlocal", f"--workdir={d}/rm", pairs[0], held[0], init[0])
  assert "Resumed from" in again.stdout
  out = run("launch.dpo", "--config=configs/dpo_arith.py:runlocal", f"--workdir={d}/dpo", pairs[1], held[1], init[1])
  assert "dpo update 2: val/dpo/rewards/accuracies" in out.stdout and "mean@1" in out.stdout
  assert os.path.exists(f"{d}/dpo/dpo_model/model.safetensors")
  # A row without 'chosen' fails in one line naming the file and row.
  with open(f"{d}/bad.jsonl", "w") as f:
    f.write(json.dumps({"prompt": "What is 1+1?", "chosen": "Answer: 2", "rejected": "Answer: 3"}) + "\n")
    f.write(json.dumps({"prompt": "What is 1+2?", "rejected": "Answer: 4"}) + "\n")
  bad = run("launch.rm", "--config=configs/rm_arith.py:runlocal", f"--workdir={d}/rm2",
            f"--config.rm.train_files=('{d}/bad.jsonl',)", init[0], check=False)
  assert bad.returncode == 1 and f"{d}/bad.jsonl: row 1: no field 'chosen'" in bad.stderr
