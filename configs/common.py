"""Shared config pieces: the base recipe every config starts from, and `parse_arg`."""
import json

import ml_collections as mlc

from dapo_jax import settings


def parse_arg(arg, **defaults):
  """'size=7b,runlocal' -> ConfigDict(size='7b', runlocal=True), over the given defaults."""
  out = mlc.ConfigDict(defaults)
  for part in (arg or "").split(","):
    if not part:
      continue
    key, _, value = part.partition("=")
    if key not in defaults:
      raise ValueError(f"config argument {key!r} is unknown; known: {sorted(defaults)}")
    if not value:
      out[key] = True
    elif isinstance(defaults[key], bool):
      out[key] = value.lower() in ("1", "true", "yes")
    else:
      out[key] = type(defaults[key])(value)
  return out


def base() -> mlc.ConfigDict:
  """The DAPO recipe of the paper (§5.1) on a model to be chosen; configs override what differs.

  Every field, its default and its meaning live in `dapo_jax.settings` (one frozen dataclass per
  section: `settings.Dapo.eps_high` is `--config.dapo.eps_high`); this is their ConfigDict.
  """
  return mlc.ConfigDict(settings.Config().to_dict())


def qwen2_5(size: str) -> dict:
  """Model fields of a Qwen2.5 size ('32b', '7b', '0_5b'), for a run that loads its HF weights."""
  return preset({"32b": "qwen2_5_32b", "7b": "qwen2_5_7b", "0_5b": "qwen2_5_0_5b"}[size])


def preset(name: str) -> dict:
  """Model fields of a `ModelConfig` preset ('qwen3_8b', 'llama3_1_8b', 'gemma3_4b', ...)."""
  import dataclasses

  from dapo_jax.model import transformer as model
  fields = dataclasses.asdict(getattr(model.ModelConfig, name)())
  fields.pop("vision")  # The presets are text models (`model.vision` stays the section's default).
  return fields


_RUNLOCAL_RESET = ("init", "hf_dir", "gguf", "vocab_size", "num_heads", "num_kv_heads", "rope_theta", "qkv_bias",
                   "tie_embeddings", "param_dtype", "dtype", "matmul_dtype", "attn_chunk", "logits_chunk", "arch",
                   "qk_norm", "rope_type", "sliding_window", "local_layers", "query_scale", "attn_softcap",
                   "final_softcap", "num_experts", "experts_per_token", "expert_mlp_dim", "norm_topk_prob",
                   "dense_layers", "router_aux_coef", "expert_chunk")


def defaults(section, *fields: str) -> dict:
  """{field: its default} of a `dapo_jax.settings` section: a recipe resets a field without restating it."""
  default = section()
  return {f: getattr(default, f) for f in fields}


def runlocal(c: mlc.ConfigDict) -> None:
  """Shrinks any recipe to a seconds-long CPU smoke run on the built-in arithmetic task."""
  # A family's fields back to the default model's (LoRA, norm_eps and RoPE scaling kept), then tiny sizes.
  c.model.update(defaults(settings.Model, *_RUNLOCAL_RESET))
  c.model.update(embed_dim=32, mlp_dim=64, num_layers=2, head_dim=8, remat="none")
  c.tokenizer.update(defaults(settings.Tokenizer, "path"), vocab_size=300)
  c.data.update(defaults(settings.Data, "prompt_buckets", "prompt_template", "digits_b", "fewshot"), task="arith",
                max_prompt_len=32, num_eval=8)
  c.rollout.update(defaults(settings.Rollout, "rows_per_call"), group_size=4, max_new_tokens=8)
  # A random tiny model rarely solves anything, so at the cap a smoke run trains on what it kept.
  c.dapo.update(prompts_per_step=4, gen_prompts=8 if c.dapo.dynamic_sampling else 4, max_gen_batches=2,
                overlong_buffer=min(c.dapo.overlong_buffer, 2), on_cap="train")
  c.train.update(num_steps=2, minibatches=2, num_microbatches=1, ckpt_every=0, eval_every=0,
                 log_samples_every=1)
  c.eval.update(defaults(settings.Eval, "max_new_tokens"), k=2)
  c.sft.update(defaults(settings.SFT, "steps"))
  c.mesh.update(defaults(settings.Mesh, "data", "fsdp", "tensor", "expert"))  # One device's mesh.


# reasoning-gym tasks the small checkpoints train on (configs/smollm2_135m_reasoning.py,
# configs/gemma3_270m_reasoning.py), with their generator settings: one-digit operands, short answers.
# Greedy before RL, SmolLM2-135M-Instruct with 3 worked examples: chain_sum 27%, basic_arithmetic 6%.
RG_TASKS = {"chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1},
            "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
# No "e.g. <answer>42</answer>" (data.reasoning_gym.INSTRUCTION): with worked examples before the
# question it only teaches a small model to answer 42.
RG_INSTRUCTION = "{question}\nGive your final answer inside <answer></answer> tags."


def reasoning_gym(c: mlc.ConfigDict, tasks: str) -> None:
  """DAPO on reasoning-gym tasks ("chain_sum+basic_arithmetic"), each scored by its own verifier,
  with three worked examples before each question."""
  names = tuple(tasks.split("+"))
  for name in names:
    if name not in RG_TASKS:
      raise ValueError(f"tasks={tasks!r}: {name!r} is not one of {sorted(RG_TASKS)}")
  c.data.update(task="reasoning_gym", rg_tasks=names, rg_settings=json.dumps({t: RG_TASKS[t] for t in names}),
                rg_num_train=4000, num_eval=48, fewshot=3, prompt_template=RG_INSTRUCTION,
                max_prompt_len=224, prompt_buckets=(224,))
  c.reward.update(defaults(settings.Reward, "workers"), fn="dapo_jax.rewards:reasoning_gym")
  c.rollout.update(defaults(settings.Rollout, "temperature", "top_p", "top_k"), group_size=8, max_new_tokens=32)
  c.dapo.update(prompts_per_step=8, gen_prompts=12, max_gen_batches=3, overlong_buffer=8)
  c.train.update(defaults(settings.Train, "ckpt_every", "log_samples_every"), num_steps=30, minibatches=1,
                 eval_every=10)
  c.eval.update(defaults(settings.Eval, "temperature"), k=4, top_p=1.0, greedy=True)
  c.mesh.update(defaults(settings.Mesh, "data", "fsdp", "tensor"))
