r"""Vision-language RL on 2 CPU cores: a tiny Gemma 3 with a vision tower learns to count red shapes.

  python -m launch.train --config=configs/vlm_count_shapes.py
  python -m launch.train --config=configs/vlm_count_shapes.py:blank   # the control: every picture blank
  python -m launch.train --config=configs/vlm_count_shapes.py:qwen    # a tiny Qwen2.5-VL instead

Pictures are drawn with Pillow (`data.count_shapes`): 1 to 4 red shapes among shapes of other
colours, the same question for every picture, so only the image tells the answer (guessing: 25%).
The model (a 4-layer Gemma 3 text model with a 2-layer SigLIP tower and Gemma 3's projector, all
random) is warm-started by SFT on the answers, then trained by DAPO; the tower stays as it
started (`model.vision`: frozen), so what is learnt is the language model reading its vectors.
With `qwen`, the same sizes as a Qwen2.5-VL: a Qwen2 text model with M-RoPE positions and Qwen2.5-VL's
tower (windows of 2 x 2 merged tokens but in its last layer, 2D rotary patches, the patch merger).
"""
from configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, runlocal=False, blank=False, qwen=False)
  c = common.base()
  c.model.init = "sft"
  c.model.update(arch="gemma3", qk_norm=True, qkv_bias=False, rope_theta=10_000.0, embed_dim=128, mlp_dim=384,
                 num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32)
  c.model.vision.update(image_size=32, patch_size=4, embed_dim=64, mlp_dim=128, num_layers=2, num_heads=4,
                        tokens_per_image=16)
  if arg.qwen:
    c.model.update(arch="qwen2", qk_norm=False, qkv_bias=True, mrope_section=(4, 6, 6))
    c.model.vision.update(kind="qwen2_5_vl", merge_size=2, window_size=16, full_attention_layers=(1,))
  c.tokenizer.vocab_size = 384
  c.data.update(task="count_shapes", max_count=4, blank_images=arg.blank, max_prompt_len=128, num_eval=200,
                solution_style="direct")
  c.rollout.update(group_size=8, max_new_tokens=8)
  c.dapo.update(prompts_per_step=16, gen_prompts=24, max_gen_batches=4, overlong_buffer=0)
  c.optim.update(lr=1e-4, warmup_steps=3, weight_decay=0.0)
  c.train.update(num_steps=60, minibatches=2, ckpt_every=10, eval_every=10, log_samples_every=10)
  c.eval.update(k=4, temperature=1.0, top_p=0.7, greedy=True)
  c.sft.update(steps=400, batch_size=32, seq_len=128, lr=2e-3, warmup_steps=20, num_examples=4096,
               target_acc=0.4, probe_every=10, completion_only=True)
  if arg.runlocal:  # The shrink, kept a vision-language model on its task.
    common.runlocal(c)
    if arg.qwen:
      c.model.update(arch="qwen2", qkv_bias=True, mrope_section=(2, 1, 1))
    else:
      c.model.update(arch="gemma3", qk_norm=True, qkv_bias=False)
    c.model.vision.update(embed_dim=16, mlp_dim=32, num_layers=1, num_heads=2, full_attention_layers=())
    c.data.update(task="count_shapes", max_prompt_len=128, solution_style="direct")
  return c
