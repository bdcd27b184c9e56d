r"""Stage 2 of the RLHF pipeline on the arithmetic task: a reward model on preference pairs.

  python -m launch.prepare arith_pairs --out=runs/arith/pairs_train.jsonl --num=8000
  python -m launch.prepare arith_pairs --out=runs/arith/pairs_heldout.jsonl --num=512 --split=heldout
  python -m launch.rm --config=configs/rm_arith.py                 # -> runs/rm_arith/rm_model
Starts from the SFT model of configs/sft_chat_arith.py with a zero score head: the reward and value
model of configs/ppo_arith.py. Chosen: the correct worked answer; rejected: one of the mistakes of
`preference.ERROR_KINDS` in turn. Measured (2 shared CPU cores, 13 min): held-out pairwise accuracy
0.764 / 0.795 / 0.840 after 100 / 300 / 600 updates; after 600, per kind: carry, extra_carry, steps,
truncated 1.00, digit 0.83, sum 0.59, operand 0.56 (a wrong digit sum or a misread digit is still
near chance). On the pairs of `launch.prepare arith_pairs --kinds=carry,digit` (4000 train, 256
held out), 300 updates reach 0.934 (margin 5.9).

  python -m launch.rm --config=configs/rm_arith.py:weak            # -> runs/rm_arith_weak/rm_model
starts from the SFT model of configs/sft_chat_arith.py:weak instead (600 updates: 0.826; sum 0.48,
operand 0.64).
"""
from configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False, weak=False)
  c = common.base()
  c.data.update(task="arith")    # the prompts' chat template and stop tokens only
  c.rm.update(train_files=("runs/arith/pairs_train.jsonl",), eval_files=("runs/arith/pairs_heldout.jsonl",),
              init_dir="runs/sft_chat_arith/sft_model",
              steps=600, batch_pairs=32, lr=3e-4, warmup_steps=20,
              prompt_len=32, response_len=40,   # tokens; the task's prompts and answers fit
              eval_every=100, ckpt_every=100)
  if arg.weak:
    c.rm.init_dir = "runs/sft_chat_arith_weak/sft_model"
  if arg.runlocal:
    common.runlocal(c)
    c.rm.update(steps=2, batch_pairs=4, eval_every=0, ckpt_every=0)
  return c
