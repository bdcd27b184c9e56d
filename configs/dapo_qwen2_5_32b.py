r"""DAPO on DAPO-Math-17k with Qwen2.5-32B: the paper's recipe (§5.1).

  python -m launch.train --config=configs/dapo_qwen2_5_32b.py:mesh=gpu16x8 --workdir=$DIR \
      --config.model.hf_dir=/ckpt/Qwen2.5-32B --config.data.train_files=/data/dapo-math-17k.parquet \
      --config.data.eval_files=/data/aime-2024.parquet
  python -m launch.train --config=configs/dapo_qwen2_5_32b.py:runlocal     # CPU smoke run, seconds

Variants (`:arg`): mesh=gpu16x8 (16 nodes x 8 GPUs) | mesh=v5p256 (TPU v5p-256 pod);
runlocal shrinks everything to run on a laptop.
Expected: AIME 2024 avg@32 ~50 after ~330 rollout steps (paper Fig. 1; 52 in the verl reproduction).
"""
from configs import common

MESHES = {
    "gpu16x8": dict(data=1, fsdp=16, tensor=8),    # 128 GPUs: tensor-parallel in a node, FSDP across nodes
    "v5p256": dict(data=1, fsdp=32, tensor=4),     # 128 chips (v5p-256 counts TensorCores)
    "auto": dict(data=1, fsdp=-1, tensor=1),
}


def get_config(arg=None):
  arg = common.parse_arg(arg, mesh="auto", runlocal=False)
  c = common.base()
  c.model.update(init="hf", **common.qwen2_5("32b"))
  c.model.update(dtype="bfloat16", remat="full", attn_chunk=2048)
  c.data.update(task="file", train_files=("dapo-math-17k.parquet",), eval_files=("aime-2024.parquet",),
                max_prompt_len=2048, prompt_buckets=(512, 1024, 2048), num_eval=0)
  c.rollout.update(group_size=16, max_new_tokens=20_480, temperature=1.0, top_p=1.0, top_k=0,
                   rows_per_call=1024,     # 24 sampler calls per 1536 x 16 generation batch
                   stop="generation_config")   # verl: Qwen2.5-32B (base) ends on <|endoftext|> only
  c.dapo.update(prompts_per_step=512, gen_prompts=1536, dynamic_sampling=True, max_gen_batches=10,
                eps_low=0.2, eps_high=0.28, clip_ratio_c=10.0, loss_agg="token_mean",
                overlong_buffer=4096, overlong_penalty=1.0, overlong_filter=False, filter_metric="acc",
                # As verl's recipe: whole generation batches, then the filter (streaming=False); raise
                # when max_gen_batches generation batches did not fill Q groups, and drop the kept
                # groups beyond Q (verl: batch[:Q*G]).
                streaming=False,
                on_cap="raise", carry_over=False)
  c.optim.update(lr=1e-6, warmup_steps=10, weight_decay=0.1, grad_clip=1.0)
  c.train.update(num_steps=500, minibatches=16, ppo_epochs=1, num_microbatches=32, ckpt_every=5,
                 eval_every=5)
  c.eval.update(k=1, temperature=1.0, top_p=0.7)   # the AIME file holds each problem 32 times: avg@32
  c.mesh.update(MESHES[arg.mesh])
  if arg.runlocal:
    common.runlocal(c)
  return c


def sweep(add):
  for eps_high in (0.24, 0.28, 0.32):
    add(**{"dapo.eps_high": eps_high})
