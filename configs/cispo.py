r"""CISPO (MiniMax-M1, arXiv 2506.13585) in the paper's controlled comparison: DAPO's recipe on
Qwen2.5-32B base (configs/dapo_qwen2_5_32b.py) with the clipped-IS-weight loss in place of the clip.

  python -m launch.train --config=configs/cispo.py:mesh=gpu16x8 --workdir=$DIR \
      --config.model.hf_dir=/ckpt/Qwen2.5-32B --config.data.train_files=/data/dapo-math-17k.parquet \
      --config.data.eval_files=/data/aime-2024.parquet
  python -m launch.train --config=configs/cispo.py:runlocal     # CPU smoke run

The loss: -sg(clip(r, 1-ε_low, 1+ε_high))·A·log π, normalised by all the batch's tokens (the paper's
1/Σ|o_i|: token_mean), group-relative advantages, no KL. The paper sets no lower bound on the weight
(ε_low^IS large: eps_low=1, a bound of 0) and tunes only ε_high^IS, whose value it does not print;
0.28 here is DAPO's upper clip, the recipe CISPO is compared with (verl's example uses 0.2).
Everything else (dynamic sampling, overlong shaping, batch 512x16, 20K tokens) is DAPO's.
Expected: the paper's Fig. 2 (CISPO reaches DAPO's AIME 2024 score in about half the steps).
"""
from configs import common, dapo_qwen2_5_32b


def get_config(arg=None):
  arg = common.parse_arg(arg, mesh="auto", runlocal=False)
  c = dapo_qwen2_5_32b.get_config(f"mesh={arg.mesh}")
  c.dapo.update(policy_loss="cispo",
                eps_low=1.0,            # no lower bound on the IS weight
                eps_high=0.28,          # ε_high^IS (tuned in the paper; see the docstring)
                clip_ratio_c=0.0,       # CISPO clips the weight only
                loss_agg="token_mean", kl_coef=0.0)
  if arg.runlocal:
    common.runlocal(c)
  return c
