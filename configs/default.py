r"""The default job: a tiny model learns 2-digit addition on a 2-core CPU, in minutes.

  python -m launch.train                       # this config, workdir ./runs/default
  python -m launch.train --config.train.num_steps=20
  python -m launch.train --config=configs/default.py:runlocal   # a seconds-long smoke run

It trains a BPE tokenizer and a 0.84M-parameter Qwen2-style model from scratch, warm-starts it
with a short SFT (which stops once greedy decoding solves 30% of a probe of training problems,
so RL starts with room to improve), then runs DAPO (dynamic sampling, decoupled clip,
token-level loss, soft overlong punishment) and prints held-out accuracy before, during and
after RL.
"""
from configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False)
  c = common.base()
  c.model.init = "sft"
  c.model.update(embed_dim=128, mlp_dim=384, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32)
  c.tokenizer.vocab_size = 384
  c.data.update(task="arith", digits=2, ops="+", max_prompt_len=32, num_eval=200)
  c.rollout.update(group_size=8, max_new_tokens=32)
  c.dapo.update(prompts_per_step=16, gen_prompts=24, max_gen_batches=4, overlong_buffer=4)
  c.optim.update(lr=1e-4, warmup_steps=3, weight_decay=0.0)
  c.train.update(num_steps=100, minibatches=2, ckpt_every=10, eval_every=10, log_samples_every=10)
  c.eval.update(k=4, temperature=1.0, top_p=0.7, greedy=True)
  c.sft.update(steps=600, batch_size=32, seq_len=128, lr=2e-3, warmup_steps=20, num_examples=20_000,
               target_acc=0.3, probe_every=5)
  if arg.runlocal:
    common.runlocal(c)
  return c
