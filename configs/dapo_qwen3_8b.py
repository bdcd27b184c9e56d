r"""DAPO on DAPO-Math-17k with Qwen3-8B: the paper's recipe (configs/dapo_qwen2_5_32b.py) on an 8B model.

  python -m launch.train --config=configs/dapo_qwen3_8b.py:mesh=gpu4x8 --workdir=$DIR \
      --config.model.hf_dir=/ckpt/Qwen3-8B-Base --config.data.train_files=/data/dapo-math-17k.parquet \
      --config.data.eval_files=/data/aime-2024.parquet
  python -m launch.plan --config=configs/dapo_qwen3_8b.py:mesh=gpu4x8     # per-device memory
  python -m launch.train --config=configs/dapo_qwen3_8b.py:runlocal       # CPU smoke run, seconds

Variants (`:arg`): mesh=gpu8 (one 8-GPU node) | mesh=gpu4x8 (4 nodes) | mesh=v5p64 (TPU v5p-64);
runlocal shrinks everything to run on a laptop.
"""
from configs import common, dapo_qwen2_5_32b

MESHES = {
    "gpu8": dict(data=1, fsdp=2, tensor=4),     # one node: 8 KV heads over 4, FSDP over pairs
    "gpu4x8": dict(data=4, fsdp=2, tensor=4),   # 32 GPUs: a model replica per node
    "v5p64": dict(data=2, fsdp=8, tensor=2),    # 32 chips
    "auto": dict(data=1, fsdp=-1, tensor=1),
}

# Sampler rows per call: the KV cache fits beside the weights.
ROWS_PER_CALL = {'gpu8': 128, 'gpu4x8': 512, 'v5p64': 256, 'auto': 128}


def get_config(arg=None):
  arg = common.parse_arg(arg, mesh="auto", runlocal=False)
  c = dapo_qwen2_5_32b.get_config()
  c.model.update(init="hf", **common.preset("qwen3_8b"))
  c.model.update(dtype="bfloat16", remat="full", attn_chunk=2048)
  # One 22.5K-token row per data shard per micro-batch (num_microbatches=0: derived from the mesh);
  # rows are not grouped by prompt, so a micro-batch need not hold a whole group of 16.
  c.train.update(num_microbatches=0, microbatch_tokens=22_528, share_prompt=False)
  c.mesh.update(MESHES[arg.mesh])
  c.rollout.rows_per_call = ROWS_PER_CALL[arg.mesh]   # bounds the sampler's KV cache
  if arg.runlocal:
    common.runlocal(c)
  return c
