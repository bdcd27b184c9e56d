r"""On-policy distillation on the arithmetic task: the default job's trained policy teaches a
smaller student of its tokenizer, on the student's own samples, after the student's SFT warm start.

  python -m launch.train --workdir=runs/default                              # the teacher
  python -m launch.export --workdir=runs/default --out=runs/default_hf
  python -m launch.train --config=configs/distill_arith.py --workdir=runs/distill

The student is the default job's model at half the width and depth (~0.3M parameters). Each token's
advantage is log π_teacher(y_t) - log π(y_t) (`dapo.adv_estimator=distill`; no reward enters the
loss, the rewards are still computed and logged), so dynamic sampling is off: every group teaches,
whatever its accuracy. `dapo.teacher_dir` and `tokenizer.path` name the teacher's HF directory
(the student must use the teacher's token ids).
"""
from configs import common, default

TEACHER = "runs/default_hf"


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False)
  c = default.get_config()
  c.model.update(embed_dim=64, mlp_dim=192, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32)
  c.tokenizer.path = TEACHER
  c.dapo.update(adv_estimator="distill", teacher_dir=TEACHER, dynamic_sampling=False)
  if arg.runlocal:
    common.runlocal(c)
  return c
