r"""Stage 1 of the RLHF pipeline on the arithmetic task: SFT on its conversations, packed.

  python -m launch.prepare arith_sft --out=runs/arith/sft_train.jsonl --num=20000
  python -m launch.sft --config=configs/sft_chat_arith.py          # -> runs/sft_chat_arith/sft_model
Any conversation file works the same: --config.data.train_files=data/chats.jsonl (messages or
prompt/completion rows). Trains a BPE tokenizer on the conversations and a ~1M-parameter model from
scratch; the loss covers the assistant turns; 5% of the conversations are held out for the loss.
Measured (2 shared CPU cores, ~10 min): 5.0 conversations per row, held-out loss 0.61 / 0.065 / 0.023
after 100 / 200 / 300 updates; greedy answers to held-out prompts 89.8% correct.

  python -m launch.sft --config=configs/sft_chat_arith.py:weak     # -> runs/sft_chat_arith_weak/sft_model
stops after 180 updates: the start of configs/ppo_arith.py, which needs room to improve (greedy
held-out accuracy 2% / 19% / 40% / 74% after 120 / 130 / 180 / 200 updates: it rises steeply here).
"""
from configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False, weak=False)
  c = common.base()
  c.model.init = "random"
  c.model.update(embed_dim=128, mlp_dim=384, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32)
  c.tokenizer.vocab_size = 384
  c.data.update(task="file", train_files=("runs/arith/sft_train.jsonl",), max_prompt_len=32)
  c.sft.update(steps=300,          # updates
               batch_size=16,      # packed rows per update (~5 conversations each)
               seq_len=256,        # tokens per packed row
               lr=2e-3, warmup_steps=20)
  c.chat_sft.update(assistant_only=True, packing=True, heldout_fraction=0.05, eval_every=100)
  if arg.weak:  # The same run stopped early (a constant learning rate after warm-up: the same first updates).
    c.sft.steps = 180
  if arg.runlocal:
    common.runlocal(c)
    c.data.update(task="file", train_files=("runs/arith/sft_train.jsonl",))
    c.sft.update(steps=2, batch_size=2, seq_len=128)
  return c
