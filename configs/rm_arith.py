r"""Stage 2 of the RLHF pipeline on the arithmetic task: a reward model on preference pairs.

  python -m launch.sft --config=configs/sft_chat_arith.py:weak      # the policy PPO will train
  python -m launch.prepare policy_pairs --model_dir=runs/sft_chat_arith_weak/sft_model \
      --out=runs/arith/policy_pairs_train.jsonl --num=3000 --k=8 --chosen=reference
  python -m launch.prepare policy_pairs --model_dir=runs/sft_chat_arith_weak/sft_model \
      --out=runs/arith/policy_pairs_heldout.jsonl --num=300 --k=8 --chosen=reference --split=heldout
  python -m launch.rm --config=configs/rm_arith.py                 # -> runs/rm_arith/rm_model
Starts from the SFT model of configs/sft_chat_arith.py with a zero score head: the reward and value
model of configs/ppo_arith.py. The pairs are the weak policy's own answers (StackLLaMA's recipe: 8
samples per training problem from the SFT model that PPO starts from, labelled by the rule check, the
worked answer preferred to each wrong sample): the reward model learns the mistakes of the policy it
will score. Measured (2 CPU cores shared with other jobs, 8 min per 300 updates): held-out pairwise
accuracy 0.721 / 0.866 / 0.905 / 0.918 / 0.896 after 100 / 300 / 400 / 500 / 600 updates, on the 599
pairs of the weak policy's answers to held-out problems (`policy_pairs_heldout.jsonl`; no held-out
problem is in the training pairs).

  python -m launch.rm --config=configs/rm_arith.py:mixed            # -> runs/rm_arith_mixed/rm_model
the policy's pairs and the planted mistakes of `launch.prepare arith_pairs` (6.0k and 8.0k pairs,
drawn alike), 300 updates (7.5 min): 0.790 on the same held-out pairs.

  python -m launch.prepare arith_pairs --out=runs/arith/pairs_train.jsonl --num=8000
  python -m launch.prepare arith_pairs --out=runs/arith/pairs_heldout.jsonl --num=512 --split=heldout
  python -m launch.rm --config=configs/rm_arith.py:planted          # -> runs/rm_arith_planted/rm_model
the planted mistakes alone, 600 updates (13 min): 0.840 on their held-out pairs (carry, extra_carry,
steps, truncated 1.00, digit 0.83, sum 0.59, operand 0.56). On the pairs of
`launch.prepare arith_pairs --kinds=carry,digit` (4000 train, 256 held out), 300 updates reach 0.934.

  python -m launch.rm --config=configs/rm_arith.py:weak            # -> runs/rm_arith_weak/rm_model
starts from the SFT model of configs/sft_chat_arith.py:weak instead.
"""
from configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False, weak=False, planted=False, mixed=False)
  c = common.base()
  c.data.update(task="arith")    # the prompts' chat template and stop tokens only
  c.rm.update(train_files=("runs/arith/policy_pairs_train.jsonl",),
              eval_files=("runs/arith/policy_pairs_heldout.jsonl",),
              init_dir="runs/sft_chat_arith/sft_model",
              steps=500, batch_pairs=32, lr=3e-4, warmup_steps=20,
              prompt_len=32, response_len=40,   # tokens; the task's prompts and answers fit
              eval_every=100, ckpt_every=100)
  if arg.mixed:
    c.rm.update(train_files=("runs/arith/policy_pairs_train.jsonl", "runs/arith/pairs_train.jsonl"), steps=300)
  if arg.planted:
    c.rm.update(train_files=("runs/arith/pairs_train.jsonl",), eval_files=("runs/arith/pairs_heldout.jsonl",),
                steps=600)
  if arg.weak:
    c.rm.init_dir = "runs/sft_chat_arith_weak/sft_model"
  if arg.runlocal:
    common.runlocal(c)
    c.rm.update(steps=2, batch_pairs=4, eval_every=0, ckpt_every=0)
  return c
