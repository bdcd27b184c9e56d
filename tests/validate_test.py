"""`builders.validate`: every shipped config passes, and each impossible value is named in one line."""
import glob
import importlib
import logging
import os

import pytest

from configs import ablation, common
from dapo_jax import builders

ROOT = os.path.join(os.path.dirname(__file__), "..")
CONFIGS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
                 if not os.path.basename(p).startswith(("_", "common")))
# (config, arg, devices of the machine it is meant for: None = any of 1, 2, 8).
SHIPPED = ([(n, None, None) for n in CONFIGS] + [(n, "runlocal", None) for n in CONFIGS if n != "default"]
           + [("ablation", f"stage={s}", None) for s in ablation.STAGES]
           + [("ablation", f"stage={s},runlocal", None) for s in ablation.STAGES]
           + [("ablation", f"stage={s},task=arith{r}", None) for s in ablation.STAGES for r in ("", ",runlocal")]
           + [("dapo_qwen2_5_32b", "mesh=gpu16x8", 128), ("dapo_qwen2_5_32b", "mesh=v5p256", 128)])


def load(name, arg=None):
  cfg = importlib.import_module(f"configs.{name}").get_config(arg)
  cfg.lock()
  return cfg


@pytest.mark.parametrize("name,arg,devices", SHIPPED)
def test_shipped_configs_pass(name, arg, devices):
  cfg = load(name, arg)
  for n in [devices] if devices else [1, 2, 8]:
    builders.validate(cfg, num_devices=n)


def base():
  """A small valid config to break one field at a time."""
  c = common.base()
  common.runlocal(c)
  c.lock()
  return c


# (field, bad value, what the one-line error must say)
BAD = [
    ("rollout.temperature", -0.1, "rollout.temperature=-0.1: expected >= 0 (0 = greedy)"),
    ("rollout.top_p", 0.0, "rollout.top_p=0.0: expected in (0, 1]"),
    ("rollout.top_p", 1.5, "rollout.top_p=1.5: expected in (0, 1]"),
    ("rollout.top_k", -1, "rollout.top_k=-1: expected >= 0 (0 = off)"),
    ("eval.temperature", -1.0, "eval.temperature=-1.0: expected >= 0"),
    ("eval.top_p", 2.0, "eval.top_p=2.0: expected in (0, 1]"),
    ("eval.k", 0, "eval.k=0: expected >= 1"),
    ("rollout.group_size", 1, "rollout.group_size=1: expected >= 2 (group-relative advantages are 0"),
    ("rollout.max_new_tokens", 0, "rollout.max_new_tokens=0: expected >= 1"),
    ("dapo.eps_low", 0.0, "dapo.eps_low=0.0: expected > 0 and < 1"),
    ("dapo.eps_low", 1.0, "dapo.eps_low=1.0: expected > 0 and < 1"),
    ("dapo.eps_high", -0.28, "dapo.eps_high=-0.28: expected > 0"),
    ("dapo.clip_ratio_c", 0.5, "dapo.clip_ratio_c=0.5: expected 0 (off) or > 1 (dual clip)"),
    ("dapo.clip_ratio_c", 1.0, "dapo.clip_ratio_c=1.0: expected 0 (off) or > 1"),
    ("dapo.clip_ratio_c", -3.0, "dapo.clip_ratio_c=-3.0: expected >= 0"),
    ("dapo.loss_agg", "token_max", "dapo.loss_agg='token_max': expected one of"),
    ("dapo.on_cap", "stop", "dapo.on_cap='stop': expected 'train' or 'raise'"),
    ("dapo.kl_estimator", "k2", "dapo.kl_estimator='k2': expected 'k1' or 'k3'"),
    ("dapo.kl_coef", -0.1, "dapo.kl_coef=-0.1: expected >= 0"),
    ("dapo.overlong_buffer", 9, "dapo.overlong_buffer=9: expected from 0 to rollout.max_new_tokens=8"),
    ("dapo.overlong_penalty", -1.0, "dapo.overlong_penalty=-1.0: expected >= 0"),
    ("dapo.max_gen_batches", -1, "dapo.max_gen_batches=-1: expected >= 0 (0 = unlimited)"),
    ("dapo.prompts_per_step", 0, "dapo.prompts_per_step=0: expected >= 1"),
    ("dapo.gen_prompts", 3, "dapo.gen_prompts=3: expected >= dapo.prompts_per_step=4 when dynamic sampling"),
    ("rollout.rows_per_call", 6, "rollout.rows_per_call=6: expected 0, or a multiple of rollout.group_size=4 "
                                 "that divides the 32 rows of a generation batch"),
    ("rollout.rows_per_call", 12, "rollout.rows_per_call=12: expected 0, or a multiple"),
    ("train.minibatches", 3, "train batch of 4 prompts x 4 = 16 rows does not split into train.minibatches=3"),
    ("train.minibatches", 0, "train.minibatches=0: expected >= 1"),
    ("train.num_microbatches", 3, "does not split into train.minibatches=2 x train.num_microbatches=3"),
    ("train.num_microbatches", -1, "train.num_microbatches=-1: expected >= 1, or 0 (auto)"),
    ("train.microbatch_tokens", 0, "train.microbatch_tokens=0: expected a positive token budget"),
    ("train.ppo_epochs", 0, "train.ppo_epochs=0: expected >= 1"),
    ("train.num_steps", -1, "train.num_steps=-1: expected >= 0"),
    ("train.keep_ckpts", 0, "train.keep_ckpts=0: expected >= 1"),
    ("train.max_bad_steps", 0, "train.max_bad_steps=0: expected >= 1"),
    ("optim.lr", -1e-4, "optim.lr=-0.0001: expected >= 0"),
    ("optim.warmup_steps", -1, "optim.warmup_steps=-1: expected >= 0"),
    ("optim.b2", 1.0, "optim.b2=1.0: expected >= 0 and < 1"),
    ("optim.eps", 0.0, "optim.eps=0.0: expected > 0"),
    ("optim.grad_clip", -1.0, "optim.grad_clip=-1.0: expected >= 0 (0 = off)"),
    ("reward.timeout_s", 0.0, "reward.timeout_s=0.0: expected > 0"),
    ("reward.workers", 0, "reward.workers=0: expected >= 1"),
    ("reward.fn", "rewards.math", "reward.fn='rewards.math': expected 'package.module:function'"),
    ("model.init", "pretrained", "model.init='pretrained': expected one of"),
    ("model.remat", "some", "model.remat='some': expected one of ('none', 'full', 'dots')"),
    ("model.dtype", "float8", "model.dtype='float8': expected one of"),
    ("model.num_kv_heads", 3, "model.num_heads=4: expected a multiple of model.num_kv_heads=3"),
    ("model.head_dim", 7, "model.head_dim=7: expected an even number"),
    ("model.embed_dim", 0, "model.embed_dim=0: expected >= 1"),
    ("data.task", "gsm8k", "data.task='gsm8k': expected 'arith', 'file', 'reasoning_gym' or 'count_shapes'"),
    ("data.max_prompt_len", 0, "data.max_prompt_len=0: expected >= 1"),
    ("data.prompt_buckets", (16, 64), "data.prompt_buckets=(16, 64): expected prompt lengths from 1 to "
                                      "data.max_prompt_len=32"),
    ("data.missing_answer", "drop", "data.missing_answer='drop': expected 'error' or 'skip'"),
    ("data.heldout_fraction", 1.0, "data.heldout_fraction=1.0: expected > 0 and < 1"),
    ("tokenizer.vocab_size", 0, "tokenizer.vocab_size=0: expected >= 1"),
    ("dapo.policy_loss", "ppo2", "dapo.policy_loss='ppo2': expected one of ('vanilla', 'gspo', 'sapo', 'gpg', "
     "'clip_cov', 'kl_cov', 'geo_mean', 'dro', 'cispo', 'dppo_tv', 'dppo_kl', 'reinforce')"),
    ("dapo.eps_low", 1.0, "dapo.eps_low=1.0: expected > 0 and < 1"),
    ("mesh.tensor", 0, "mesh.tensor=0: expected a positive size, or -1 for the rest of the devices"),
    ("mesh.data", -1, "at most one axis may be -1"),
    ("mesh.tensor", 3, "the fixed axes multiply to 3, which does not divide the 8 devices"),
]


@pytest.mark.parametrize("field,value,message", BAD, ids=[f"{f}={v}" for f, v, _ in BAD])
def test_impossible_value_is_named(field, value, message):
  c = base()
  builders.validate(c, num_devices=8)  # The base is valid; only `field` breaks it.
  group, key = field.split(".")
  c[group][key] = value
  with pytest.raises(builders.ConfigError) as e:
    builders.validate(c, num_devices=8)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_mesh_against_devices():
  c = base()
  c.mesh.update(data=1, fsdp=2, tensor=2)
  builders.validate(c, num_devices=4)
  with pytest.raises(builders.ConfigError, match=r"data\*fsdp\*expert\*sequence\*tensor = 4, but there are 8 devices"):
    builders.validate(c, num_devices=8)
  c.mesh.update(data=1, fsdp=-1, tensor=1)
  c.train.minibatches = 4  # 4 rows per mini-batch over 8 batch shards.
  c.train.num_microbatches = 1
  with pytest.raises(builders.ConfigError, match=r"4 rows per mini-batch do not split over the mesh's "
                                                    r"data\*fsdp\*expert = 8 batch shards"):
    builders.validate(c, num_devices=8)


def test_share_prompt_needs_whole_groups_per_microbatch():
  c = base()
  c.train.num_microbatches = 4  # 8 rows per mini-batch, 2 per micro-batch, groups of 4.
  with pytest.raises(builders.ConfigError, match="train.share_prompt needs whole groups"):
    builders.validate(c, num_devices=2)
  c.train.share_prompt = False
  builders.validate(c, num_devices=2)


def test_share_prompt_needs_whole_groups_per_minibatch_with_auto_microbatches():
  """Shared prompts and a mini-batch that cuts a group: rows would be scored against the next
  group's prompt (or, with length buckets, fail in a reshape). The auto micro-batch count (0) too."""
  c = base()
  c.rollout.group_size, c.dapo.prompts_per_step, c.dapo.gen_prompts = 4, 3, 3  # 12 rows
  c.train.update(minibatches=2, num_microbatches=0)                           # of 6: groups of 4 cut
  with pytest.raises(builders.ConfigError) as e:
    builders.validate(c, num_devices=2)
  assert "train.share_prompt needs whole groups per mini-batch: train.minibatches=2" in str(e.value)
  assert "rollout.group_size=4" in str(e.value)
  c.train.share_prompt = False
  builders.validate(c, num_devices=2)


def test_sft_needs_the_arith_task():
  c = base()
  c.model.init = "sft"
  c.data.task, c.data.train_files = "file", ("x.parquet",)
  with pytest.raises(builders.ConfigError, match=r"model.init='sft': expected 'random', 'hf' or 'gguf' when "
                                                    r"data.task='file'"):
    builders.validate(c, num_devices=8)


def test_file_task_needs_a_file():
  c = base()
  c.data.task = "file"
  with pytest.raises(builders.ConfigError, match=r"data.train_files=\('',\): expected at least one dataset"):
    builders.validate(c, num_devices=8)


def test_lengths_beyond_the_models_positions_warn(tmp_path, caplog):
  """Rotary positions extend past max_position_embeddings (the model never trained there): a warning."""
  (tmp_path / "config.json").write_text('{"max_position_embeddings": 36}')
  c = base()
  c.model.update(init="hf", hf_dir=str(tmp_path))
  with caplog.at_level(logging.WARNING):
    builders.validate(c, num_devices=8)
  assert "data.max_prompt_len=32 + rollout.max_new_tokens=8 = 40 tokens exceeds the model's " \
         "max_position_embeddings=36" in caplog.text
  c.rollout.max_new_tokens, c.dapo.overlong_buffer = 4, 2
  builders.validate(c, num_devices=8)


def test_dynamic_sampling_off_allows_any_gen_prompts():
  c = base()
  c.dapo.dynamic_sampling = False
  c.dapo.gen_prompts = 1
  builders.validate(c, num_devices=8)
