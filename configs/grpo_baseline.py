r"""GRPO baseline (paper Eq. 5): symmetric clip, sample-level loss, KL penalty, no dynamic sampling.

  python -m launch.train --config=configs/grpo_baseline.py --workdir=$DIR ...
  python -m launch.train --config=configs/grpo_baseline.py:runlocal
"""
from configs import dapo_qwen2_5_32b


def get_config(arg=None):
  c = dapo_qwen2_5_32b.get_config(arg)
  runlocal = "runlocal" in (arg or "")
  c.dapo.update(eps_low=0.2, eps_high=0.2, clip_ratio_c=0.0, loss_agg="seq_mean_token_mean",
                dynamic_sampling=False, gen_prompts=c.dapo.prompts_per_step, overlong_buffer=0,
                overlong_filter=False, kl_coef=0.001, kl_estimator="k3")
  if runlocal:
    c.dapo.gen_prompts = c.dapo.prompts_per_step
  return c
