r"""DAPO on DAPO-Math-17k with Qwen3-30B-A3B (128 experts, 8 per token): the paper's recipe
(configs/dapo_qwen2_5_32b.py) on a mixture of experts.

  python -m launch.train --config=configs/dapo_qwen3_30b_a3b.py:mesh=gpu2x8 --workdir=$DIR \
      --config.model.hf_dir=/ckpt/Qwen3-30B-A3B-Base --config.data.train_files=/data/dapo-math-17k.parquet \
      --config.data.eval_files=/data/aime-2024.parquet
  python -m launch.plan --config=configs/dapo_qwen3_30b_a3b.py:mesh=gpu2x8   # per-device memory
  python -m launch.train --config=configs/dapo_qwen3_30b_a3b.py:runlocal     # CPU smoke run (a tiny MoE)

Variants (`:arg`): mesh=gpu8 (one node of 8 H200s) | mesh=gpu2x8 (2 nodes of 8 H100s) |
mesh=v5p64 (TPU v5p-64) | mesh=gpu16x8 (16 nodes); runlocal shrinks everything to a 4-expert model on a laptop.
The load-balancing loss is off (model.router_aux_coef=0), as verl's RL recipes run MoE policies.
"""
from configs import common, dapo_qwen2_5_32b

# Tensor parallelism splits the 152K-entry logits and the 4 KV heads; the expert axis the experts.
MESHES = {
    "gpu8": dict(data=1, fsdp=1, expert=2, tensor=4),   # one 8-GPU node (H200: 141 GB)
    "gpu2x8": dict(data=1, fsdp=2, expert=4, tensor=2), # 16 GPUs (H100-80GB)
    "v5p64": dict(data=1, fsdp=4, expert=4, tensor=2),  # 32 chips
    "gpu16x8": dict(data=4, fsdp=2, expert=4, tensor=4),  # 128 GPUs: 4 model replicas of 32
    "auto": dict(data=1, fsdp=-1, expert=1, tensor=1),
}

# Sampler rows per call: they bound the KV cache.
ROWS_PER_CALL = {"gpu8": 64, "gpu2x8": 128, "v5p64": 256, "gpu16x8": 512, "auto": 64}


def get_config(arg=None):
  arg = common.parse_arg(arg, mesh="auto", runlocal=False)
  c = dapo_qwen2_5_32b.get_config()
  c.model.update(init="hf", **common.preset("qwen3_30b_a3b"))
  c.model.update(dtype="bfloat16", remat="full", attn_chunk=2048,
                 expert_chunk=2048)   # tokens per device per dispatch block: bounds its buffers
  # One 22.5K-token row per data shard per micro-batch (num_microbatches=0: derived from the mesh).
  c.train.update(num_microbatches=0, microbatch_tokens=22_528, share_prompt=False)
  c.mesh.update(MESHES[arg.mesh])
  c.rollout.rows_per_call = ROWS_PER_CALL[arg.mesh]
  if arg.runlocal:
    common.runlocal(c)
    c.model.update(arch="qwen3_moe", qk_norm=True, qkv_bias=False, num_experts=4, experts_per_token=2,
                   expert_mlp_dim=32, norm_topk_prob=True)
  return c
