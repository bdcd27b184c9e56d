r"""A calculator tool and 4-digit x 4-digit products: multi-turn episodes on a 2-core CPU.

  python -m launch.train --config=configs/tools_arith.py --workdir=runs/tools_arith

The tiny model of the default job cannot multiply 4-digit numbers in its head. Each episode offers
it a calculator (`envs.tasks.CalculatorArith`): the policy calls it with an expression, the tool's
result comes back in the template's tool role (token-in/token-out, masked out of the loss), and the
policy answers; `math_dapo` scores the final answer. The SFT warm start trains on reference episodes
with the loss on the policy's tokens only (`sft.completion_only`: the call and the answer; the
question and the tool's result are context) for 1,200 updates: the call is learned long before the
copy of the tool's result into the answer, which comes abruptly and at an update that varies with the
machine's floating point, so the warm start does not stop at a probe of the calls. DAPO then runs 30
steps (docs/results.md has the measured run).

  --config.rollout.env_args='{"use_tool": false}'    the same episodes with no calculator (near 0%)
"""
from configs import default


def get_config(arg=None):
  c = default.get_config(arg)
  c.tokenizer.vocab_size = 448
  c.data.update(task="arith", digits=4, ops="*", max_prompt_len=96, num_eval=200, solution_style="tool")
  c.rollout.update(env="dapo_jax.envs.tasks:CalculatorArith", env_args="{}", max_turns=3, max_new_tokens=40,
                   max_episode_tokens=96 + 96, env_timeout_s=10.0)
  c.dapo.update(overlong_buffer=8)
  c.train.update(num_steps=30)
  c.sft.update(steps=1200, lr=3e-3, target_acc=0.0, seq_len=256, batch_size=16, completion_only=True)
  return c
