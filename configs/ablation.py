r"""The paper's Table 1 ablation: each technique added in turn to naive GRPO.

  python -m launch.train --config=configs/ablation.py:stage=clip_higher --workdir=$DIR ...
  python -m launch.train --config=configs/ablation.py:stage=dapo,runlocal

Stages (cumulative, AIME24 avg@32 in the paper): naive_grpo 30, overlong_filtering 36,
clip_higher 38, soft_overlong 41, token_level_loss 42, dapo (dynamic sampling) 50.
"""
from configs import common, dapo_qwen2_5_32b

STAGES = ("naive_grpo", "overlong_filtering", "clip_higher", "soft_overlong", "token_level_loss", "dapo")


def get_config(arg=None):
  a = common.parse_arg(arg, stage="dapo", mesh="auto", runlocal=False)
  if a.stage not in STAGES:
    raise ValueError(f"stage={a.stage!r}; expected one of {STAGES}")
  c = dapo_qwen2_5_32b.get_config(f"mesh={a.mesh}")
  level = STAGES.index(a.stage)
  c.dapo.update(eps_high=0.28 if level >= 2 else 0.2,
                overlong_filter=1 <= level < 3,           # the paper's later runs drop filtering
                overlong_buffer=4096 if level >= 3 else 0,
                loss_agg="token_mean" if level >= 4 else "seq_mean_token_mean",
                dynamic_sampling=level >= 5)
  if level < 5:
    c.dapo.gen_prompts = c.dapo.prompts_per_step
  if a.runlocal:
    common.runlocal(c)
  return c
