r"""GSPO (Zheng et al. 2025, arXiv 2507.18071) on Qwen3-30B-A3B: sequence-level importance ratios.

  python -m launch.train --config=configs/gspo.py:mesh=gpu2x8 --workdir=$DIR \
      --config.model.hf_dir=/ckpt/Qwen3-30B-A3B-Base --config.data.train_files=/data/dapo-math-17k.parquet \
      --config.data.eval_files=/data/aime-2024.parquet
  python -m launch.train --config=configs/gspo.py:runlocal     # CPU smoke run (a tiny MoE)

The paper's choices: one ratio per response, s_i = (π_θ(y_i)/π_old(y_i))^(1/|y_i|), clipped to
[1 - 3e-4, 1 + 4e-4] (its §5.1), group-normalised advantages, a sequence mean of the loss, no KL, and
each rollout batch split into 4 mini-batches; it trains a Qwen3-30B-A3B mixture of experts, the
case GSPO was designed for (no routing replay needed). Where the paper gives no number (G, batch,
lengths, learning rate) this follows verl's examples/gspo_trainer: G=16, 512 prompts, 8K tokens, 1e-6.
Variants (`:arg`): the meshes of configs/dapo_qwen3_30b_a3b.py; runlocal.
Expected: <hardware, hours, AIME24 avg@32 — fill in after the first real run>.
"""
from configs import common, dapo_qwen3_30b_a3b


def get_config(arg=None):
  arg = common.parse_arg(arg, mesh="auto", runlocal=False)
  c = dapo_qwen3_30b_a3b.get_config(f"mesh={arg.mesh}")
  c.rollout.update(group_size=16, max_new_tokens=8192)
  c.dapo.update(policy_loss="gspo",
                eps_low=3e-4, eps_high=4e-4,          # the paper's clip of the sequence ratio
                clip_ratio_c=0.0,                     # no dual clip (GSPO's clip is the only one)
                loss_agg="seq_mean_token_mean",       # a sequence mean (verl's gspo forces it too)
                adv_estimator="grpo", norm_adv_by_std=True,
                kl_coef=0.0,
                dynamic_sampling=False, gen_prompts=512, prompts_per_step=512,
                overlong_buffer=0, overlong_filter=False)
  c.optim.update(lr=1e-6)
  c.train.update(minibatches=4)                       # "each batch ... partitioned into four minibatches"
  if arg.runlocal:
    common.runlocal(c)
  return c
