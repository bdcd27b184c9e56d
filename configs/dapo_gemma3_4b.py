r"""DAPO on DAPO-Math-17k with Gemma-3-4B's text model (local/global layers, 1024-token windows):
the paper's recipe (configs/dapo_qwen2_5_32b.py) on a 4B model. The HF directory must be a
`Gemma3ForCausalLM` (text-only) checkpoint.

  python -m launch.train --config=configs/dapo_gemma3_4b.py:mesh=gpu8 --workdir=$DIR \
      --config.model.hf_dir=/ckpt/gemma-3-4b-text --config.data.train_files=/data/dapo-math-17k.parquet \
      --config.data.eval_files=/data/aime-2024.parquet
  python -m launch.plan --config=configs/dapo_gemma3_4b.py:mesh=gpu8      # per-device memory
  python -m launch.train --config=configs/dapo_gemma3_4b.py:runlocal      # CPU smoke run, seconds

Variants (`:arg`): mesh=gpu8 (one 8-GPU node) | mesh=gpu2x8 (2 nodes) | mesh=v5p32 (TPU v5p-32);
runlocal shrinks everything to run on a laptop. Gemma 3 has 4 KV heads: tensor <= 4.
"""
from configs import common, dapo_qwen2_5_32b

MESHES = {
    "gpu8": dict(data=2, fsdp=1, tensor=4),
    "gpu2x8": dict(data=4, fsdp=1, tensor=4),
    "v5p32": dict(data=2, fsdp=4, tensor=2),   # 16 chips
    "auto": dict(data=1, fsdp=-1, tensor=1),
}

# Sampler rows per call: the KV cache fits beside the weights.
ROWS_PER_CALL = {'gpu8': 128, 'gpu2x8': 256, 'v5p32': 128, 'auto': 128}


def get_config(arg=None):
  arg = common.parse_arg(arg, mesh="auto", runlocal=False)
  c = dapo_qwen2_5_32b.get_config()
  c.model.update(init="hf", **common.preset("gemma3_4b"))
  c.model.update(dtype="bfloat16", remat="full", attn_chunk=2048)
  # One 22.5K-token row per data shard per micro-batch (num_microbatches=0: derived from the mesh);
  # rows are not grouped by prompt, so a micro-batch need not hold a whole group of 16.
  c.train.update(num_microbatches=0, microbatch_tokens=22_528, share_prompt=False)
  c.mesh.update(MESHES[arg.mesh])
  c.rollout.rows_per_call = ROWS_PER_CALL[arg.mesh]   # bounds the sampler's KV cache
  if arg.runlocal:
    common.runlocal(c)
  return c
