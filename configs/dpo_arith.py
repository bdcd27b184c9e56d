r"""Stage 3 of the RLHF pipeline on the arithmetic task: DPO on the preference pairs.

  python -m launch.dpo --config=configs/dpo_arith.py               # -> runs/dpo_arith/dpo_model
Starts from (and is regularised towards) the SFT model of configs/sft_chat_arith.py; reads the pairs
of configs/rm_arith.py. Prints the rule-checked greedy accuracy on held-out prompts before and after.
Measured (2 shared CPU cores, ~2.5 min): held-out implicit-reward accuracy 0.918, but greedy accuracy
0.898 -> 0.641 (lr 1e-5: -> 0.531): on pairs that differ in a digit or two, DPO lowers the chosen
answers' likelihood too (the chosen implicit reward goes negative), as Pal et al. 2024 (DPOP) report.
"""
from configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False)
  c = common.base()
  c.data.update(task="arith")
  c.dpo.update(train_files=("runs/arith/pairs_train.jsonl",), eval_files=("runs/arith/pairs_heldout.jsonl",),
               init_dir="runs/sft_chat_arith/sft_model",
               steps=150, batch_pairs=32, lr=1e-4, warmup_steps=10,
               beta=0.1, loss_type="sigmoid",
               prompt_len=32, response_len=40, eval_every=50, ckpt_every=50,
               eval_greedy=128, max_new_tokens=40)
  if arg.runlocal:
    common.runlocal(c)
    c.dpo.update(steps=2, batch_pairs=4, eval_every=0, ckpt_every=0, eval_greedy=4, max_new_tokens=8)
  return c
