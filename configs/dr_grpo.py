r"""Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783): GRPO without
its length and standard-deviation normalisations, R1-Zero-style on Qwen2.5-Math-7B and MATH.

  python -m launch.train --config=configs/dr_grpo.py --workdir=$DIR \
      --config.model.hf_dir=/ckpt/Qwen2.5-Math-7B --config.data.train_files=/data/math-level3to5.parquet \
      --config.data.eval_files=/data/aime-2024.parquet
  python -m launch.train --config=configs/dr_grpo.py:runlocal     # CPU smoke run

The paper's two fixes: advantages R - mean (no division by the group's std: norm_adv_by_std=False)
and each response's token sum divided by a constant, the generation budget (loss_agg=
seq_mean_token_sum_norm, C = rollout.max_new_tokens), instead of by its own length. The rest is the
paper's Oat-Zero-7B setup: PPO's symmetric clip 0.2, no KL, 128 prompts x 8 responses per rollout,
3,000 tokens, temperature 1, constant learning rate 1e-6, 8 updates per rollout batch.
(Qwen2.5-Math-7B has Qwen2.5-7B's shapes; its rope_theta and context come from its config.json.)
Expected: Oat-Zero-7B, AIME 2024 ~43 (paper Table 4) after ~27 h on 8 A100s.
"""
from configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False)
  c = common.base()
  c.model.update(init="hf", **common.qwen2_5("7b"))
  c.model.update(dtype="bfloat16", remat="full", attn_chunk=2048)
  c.data.update(task="file", train_files=("math-level3to5.parquet",), eval_files=("aime-2024.parquet",),
                max_prompt_len=1024, num_eval=0)
  c.rollout.update(group_size=8, max_new_tokens=3000, temperature=1.0, top_p=1.0, top_k=0)
  c.dapo.update(prompts_per_step=128, gen_prompts=128, dynamic_sampling=False,
                eps_low=0.2, eps_high=0.2, clip_ratio_c=0.0,   # PPO's clip, no dual clip
                policy_loss="vanilla",
                loss_agg="seq_mean_token_sum_norm",           # Σ_t L / max_new_tokens, mean over responses
                norm_adv_by_std=False,                        # A = R - mean(R)
                adv_estimator="grpo", kl_coef=0.0,
                overlong_buffer=0, overlong_filter=False)
  c.optim.update(lr=1e-6, warmup_steps=0, weight_decay=0.0)
  c.train.update(minibatches=8, ppo_epochs=1)
  c.eval.update(k=1, temperature=0.0, greedy=True)
  if arg.runlocal:
    common.runlocal(c)
  return c
