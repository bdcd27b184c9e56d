"""`python -m launch.sample` on tiny checkpoints made here: greedy completions against a naive
argmax loop over `model.logits`, scores against the reward function called directly, and a
quiet start (no PyTorch notice) in a process where torch cannot be found."""
import ast
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import dapo_qwen2_5_32b
from dapo_jax import checkpoint, builders, objectives, rewards, sharding, testing
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.hf import convert as hf
from dapo_jax.model import transformer as model_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTICE = "PyTorch was not found"
# Hides the installed torch from this process tree, as on a machine without it: transformers then
# logs its notice on import (the control below shows it does).
HIDE_TORCH = '''import importlib.machinery, sys
class _NoTorch(importlib.machinery.PathFinder):
  @classmethod
  def find_spec(cls, name, path=None, target=None):
    return None if name.split(".")[0] == "torch" else super().find_spec(name, path, target)
sys.meta_path[:] = [_NoTorch if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
'''


def env(extra_path=""):
  e = dict(os.environ, XLA_FLAGS=testing.FAST_COMPILE_XLA_FLAGS)  # One device: fast start-up.
  e["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, ROOT, e.get("PYTHONPATH", "")) if p)
  return e


def sample(args, extra_path=""):
  res = subprocess.run([sys.executable, "-m", "launch.sample", *args], cwd=ROOT, env=env(extra_path),
                       capture_output=True, text=True, timeout=300)
  assert res.returncode == 0, res.stderr[-3000:]
  return res


def greedy_reference(model_cfg, params, tok, prompt: str, eos_ids, max_new_tokens: int) -> str:
  """Argmax of the teacher-forced logits, one token at a time (no KV cache, no sampler); rows
  left-padded to one length so that one compile serves every step."""
  text = tokenizer_lib.render(tok, [{"role": "user", "content": prompt}], True)
  ids = tok(text, add_special_tokens=False)["input_ids"]
  T = 64
  logits_fn = jax.jit(lambda t, m: model_lib.logits(model_cfg, params, t, m))
  out = []
  for _ in range(max_new_tokens):
    row = ids + out
    tokens = np.asarray([[tok.pad_token_id] * (T - len(row)) + row], np.int32)
    mask = np.asarray([[False] * (T - len(row)) + [True] * len(row)])
    nxt = int(np.argmax(np.asarray(logits_fn(tokens, mask))[0, -1]))
    out.append(nxt)
    if nxt in eos_ids:
      break
  return tok.decode(out, skip_special_tokens=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer_dir):
  path = str(tmp_path_factory.mktemp("model"))
  tok = tokenizer_lib.load(tiny_tokenizer_dir)
  cfg = testing.tiny_model_config(vocab_size=((len(tok) + 63) // 64) * 64)
  params = testing.sharp_params(cfg)  # Peaked logits: greedy ties are unlikely.
  hf.save(path, cfg, jax.device_get(params), tokenizer=tok)
  return path


def test_model_dir_batch_greedy_scored_and_quiet(model_dir, tmp_path):
  hide = tmp_path / "hide_torch"
  hide.mkdir()
  (hide / "sitecustomize.py").write_text(HIDE_TORCH)
  control = subprocess.run([sys.executable, "-c", "import transformers"], env=env(str(hide)),
                           capture_output=True, text=True, timeout=120)
  assert NOTICE in control.stderr + control.stdout  # The notice shows without our filter.

  prompts = tmp_path / "prompts.jsonl"
  rows = [{"prompt": [{"role": "user", "content": "What is 38+46?"}], "reward_model": {"ground_truth": "84"}},
          {"prompt": "What is 2+3?"}]
  prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  res = sample([f"--model_dir={model_dir}", f"--prompts={prompts}", "--k=2", "--temperature=0",
                "--max_new_tokens=6", "--json", "--config.reward.fn=dapo_jax.testing:length_reward",
                "--config.reward.workers=1"], extra_path=str(hide))
  assert NOTICE not in res.stdout + res.stderr
  out = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
  assert [(o["prompt"], o["sample"]) for o in out] == [("What is 38+46?", 0), ("What is 38+46?", 1),
                                                        ("What is 2+3?", 0), ("What is 2+3?", 1)]
  model_cfg, params = hf.load(model_dir)
  tok = tokenizer_lib.load(model_dir)
  eos = tokenizer_lib.stop_ids(tok, model_dir, "chat")
  for prompt in ("What is 38+46?", "What is 2+3?"):
    expected = greedy_reference(model_cfg, params, tok, prompt, eos, 6)
    assert [o["completion"] for o in out if o["prompt"] == prompt] == [expected, expected]
  for o in out[:2]:  # The row with a ground truth: scored by the configured reward.
    expected = testing.length_reward(o["completion"], "84")
    assert (o["score"], o["acc"], o["ground_truth"]) == (expected["score"], expected["acc"], "84")
  assert all("score" not in o for o in out[2:])


@pytest.mark.slow
def test_workdir_checkpoint_one_prompt(tmp_path):
  """The latest checkpoint of a run directory (config, tokenizer and orbax state as a run writes
  them), sampled at temperature 1 and scored with the config's math_dapo reward."""
  cfg = dapo_qwen2_5_32b.get_config("runlocal")
  workdir = tmp_path / "run"
  tok = testing.build_tokenizer(str(workdir / "tokenizer"), vocab_size=cfg.tokenizer.vocab_size)
  model_cfg = builders.model_config(cfg, ((len(tok) + 63) // 64) * 64)
  mesh = sharding.make_mesh(cfg.mesh, devices=jax.devices()[:1])
  trainer = builders.trainer(cfg, model_cfg, mesh, objectives.language_model(model_cfg))
  ckpt = checkpoint.Checkpointer(str(workdir / "checkpoints"))
  ckpt.save(2, trainer.init(jax.random.key(1)), {"rollout_step": 2, "seed": 0})
  ckpt.wait()
  ckpt.close()

  res = sample([f"--config={ROOT}/configs/dapo_qwen2_5_32b.py:runlocal", f"--workdir={workdir}",
                "--prompt=What is 38+46?", "--ground_truth=84", "--k=3", "--max_new_tokens=5"])
  lines = res.stdout.splitlines()
  # The question as the arithmetic task trains on it: with its instruction.
  assert lines[0] == "prompt 1/1: 'What is 38+46? End with: Answer: <number>'  (ground truth '84')"
  samples = [line for line in lines if line.startswith("  ")]
  assert [s.split(":", 1)[0] for s in samples] == ["  1", "  2", "  3"]
  acc = []
  for s in samples:
    text_repr, score = s.split(": ", 1)[1].rsplit("  [score ", 1)
    expected = rewards.math_dapo(ast.literal_eval(text_repr), "84")
    assert score == f"{expected['score']:+.2f}, acc {int(expected['acc'])}, pred {expected['pred']!r}]"
    acc.append(expected["acc"])
  assert lines[-1] == f"accuracy {np.mean(acc):.3f} over 3 scored completions"


def test_bad_prompts_file_is_one_line(tmp_path, model_dir):
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({"question": "no prompt"}) + "\n")
  res = subprocess.run([sys.executable, "-m", "launch.sample", f"--model_dir={model_dir}", f"--prompts={bad}"],
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
  assert res.returncode == 1
  assert res.stderr.strip().splitlines()[-1] == f"error: {bad}: row 0: field 'prompt' must be a non-empty " \
                                                "string, or a list of messages with a ground truth"


@pytest.mark.parametrize("config", ["default", "smollm2_135m_arith"])
def test_a_typed_question_is_put_as_the_training_prompts_are(config):
  """`launch.sample --prompt=...` asks the model what it trained on: the task's instruction template
  and worked examples around the question (a bare question is a prompt it never saw)."""
  import importlib
  cfg = importlib.import_module(f"configs.{config}").get_config()
  train, _ = builders.datasets(cfg)
  ex = train[0]
  question = "What is " + ex.messages[-1]["content"].split("What is ")[1].split("?")[0] + "?"
  asked = builders.user_prompt(cfg, question)
  assert asked.messages == ex.messages
  assert asked.messages[-1]["content"] != question
