r"""The paper's Table 1 ablation: each technique added in turn to naive GRPO.

  python -m launch.train --config=configs/ablation.py:stage=clip_higher --workdir=$DIR ...
  python -m launch.train --config=configs/ablation.py:stage=dapo,runlocal
  python -m launch.ablate --config=configs/ablation.py --seeds=3 --workdir=runs/ablation

Stages (cumulative, AIME24 avg@32 in the paper): naive_grpo 30, overlong_filtering 36,
clip_higher 38, soft_overlong 41, token_level_loss 42, dapo (dynamic sampling) 50.

`task` picks what the stages are applied to:
  dapo_math (default)  the paper's recipe (configs/dapo_qwen2_5_32b.py): Qwen2.5-32B on DAPO-Math-17k.
  arith                the built-in task in miniature, on 2 CPU cores: the default job's model and SFT
                       warm start (configs/default.py) on 3-digit addition with a 38-token budget, so
                       that responses vary in length and some overrun it, and groups are often all
                       right or all wrong. `launch.ablate` runs every stage this way (its default),
                       all from one shared warm start.
  arith_long           the same, with something for the techniques to act on: the warm start writes
                       half its solutions in a long form (`data.solution_style="mixed"`: 40-57 tokens
                       against 27-35) and the budget is 48 tokens with the soft zone from 40, so a
                       fifth of the first responses are cut off and the policy must learn to keep its
                       answers short; 4 update mini-batches per rollout step (the clip binds on the
                       later ones) and 60 steps.
Only the stage's fields differ between stages; everything else is the task's recipe.
"""
import ml_collections as mlc

from configs import common, dapo_qwen2_5_32b, default

STAGES = ("naive_grpo", "overlong_filtering", "clip_higher", "soft_overlong", "token_level_loss", "dapo")
TASKS = ("dapo_math", "arith", "arith_long")


def get_config(arg=None):
  a = common.parse_arg(arg, stage="dapo", task="dapo_math", mesh="auto", runlocal=False)
  if a.stage not in STAGES:
    raise ValueError(f"stage={a.stage!r}; expected one of {STAGES}")
  if a.task not in TASKS:
    raise ValueError(f"task={a.task!r}; expected one of {TASKS}")
  c = {"dapo_math": lambda: dapo_qwen2_5_32b.get_config(f"mesh={a.mesh}"), "arith": arith,
       "arith_long": arith_long}[a.task]()
  level = STAGES.index(a.stage)
  c.dapo.update(eps_high=0.28 if level >= 2 else 0.2,
                overlong_filter=1 <= level < 3,           # the paper's later runs drop filtering
                overlong_buffer=c.dapo.overlong_buffer if level >= 3 else 0,
                loss_agg="token_mean" if level >= 4 else "seq_mean_token_mean",
                dynamic_sampling=level >= 5)
  if level < 5:
    c.dapo.gen_prompts = c.dapo.prompts_per_step
  if a.runlocal:
    common.runlocal(c)
    if a.task != "dapo_math":  # What the ablation reads: a warm start, held-out evals, a few steps.
      c.model.init = "sft"
      c.sft.update(steps=2, batch_size=8, seq_len=64, num_examples=64, target_acc=0.0)
      c.train.update(num_steps=2, eval_every=1)
  return c


def arith() -> mlc.ConfigDict:
  """The default job on 3-digit addition: worked solutions of 27-35 tokens (with the end of turn)
  in a 38-token budget, so a response with one step too many is penalised or cut off."""
  c = default.get_config()
  c.data.digits = 3
  c.rollout.max_new_tokens = 38            # L_max: the longest worked solution plus 3 tokens
  c.dapo.overlong_buffer = 3               # L_cache: penalised beyond 35 tokens, above every worked
                                           # solution, as the paper's 16k threshold sits above its
                                           # typical responses
  c.train.num_steps = 40                   # rollout steps (held-out evaluation every 10, as the default job)
  return c


def arith_long() -> mlc.ConfigDict:
  """`arith` where length is the lever: half the warm start's solutions are written in words
  ("ones 6+9=15 write 5 carry 1; tens ...", 40-57 tokens with the end of turn) and half as terse steps
  (27-35 tokens), by a hash of the problem, and the budget fits only the terse form whole. The probe
  counts a solution as reproduced in its own form, so its target is half the default job's."""
  c = arith()
  c.data.solution_style = "mixed"
  c.rollout.max_new_tokens = 48            # L_max: inside it only the terse form, or a long one with few carries
  c.dapo.overlong_buffer = 8               # L_cache: penalised beyond 40 tokens, above every terse solution
  c.train.update(num_steps=60, minibatches=4)
  c.sft.target_acc = 0.15
  return c
