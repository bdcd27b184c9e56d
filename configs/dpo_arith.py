r"""Stage 3 of the RLHF pipeline on the arithmetic task: DPO on the preference pairs, with RPO's NLL term.

  python -m launch.dpo --config=configs/dpo_arith.py               # -> runs/dpo_arith/dpo_model
  python -m launch.dpo --config=configs/dpo_arith.py --config.dpo.rpo_alpha=0   # plain DPO
Starts from (and is regularised towards) the SFT model of configs/sft_chat_arith.py; reads the pairs
of configs/rm_arith.py. Prints the rule-checked greedy accuracy on 128 held-out prompts before and
after. The pairs differ in a digit or two, and plain DPO lowers the chosen answers' likelihood along
with the rejected ones' (Pal et al. 2024, DPOP): greedy accuracy falls. RPO (Pang et al. 2024; TRL's
`rpo_alpha`) adds α times the chosen responses' NLL and keeps it rising, so it is the default here.
Measured (2 shared CPU cores, 150 updates, β 0.1, lr 1e-4), greedy accuracy 89.8% before:
  plain DPO (rpo_alpha=0): 34.4% / 46.1% / 64.1% after 50 / 100 / 150 updates (implicit-reward acc 0.918)
  RPO (rpo_alpha=1):       100% / 97.7% / 96.1% after 50 / 100 / 150 updates (implicit-reward acc 0.953)
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
               rpo_alpha=1.0,      # RPO's NLL on the chosen responses; 0 = plain DPO (lowers accuracy here)
               prompt_len=32, response_len=40, eval_every=50, ckpt_every=50,
               eval_greedy=128, max_new_tokens=40)
  if arg.runlocal:
    common.runlocal(c)
    c.dpo.update(steps=2, batch_pairs=4, eval_every=0, ckpt_every=0, eval_greedy=4, max_new_tokens=8)
  return c
