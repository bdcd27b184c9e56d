"""Every config builds, validates its model, and rejects mistyped overrides."""
import glob
import importlib
import math
import os

import pytest

from configs import ablation
from dapo_jax import builders
from dapo_jax.model import transformer as model

ROOT = os.path.join(os.path.dirname(__file__), "..")
CONFIGS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
                 if not os.path.basename(p).startswith(("_", "common")))
ARGS = [(n, None) for n in CONFIGS] + [(n, "runlocal") for n in CONFIGS if n != "default"] + [
    ("ablation", f"stage={s}") for s in ablation.STAGES] + [("ablation", f"stage={s},task={t}") for s in
                                                           ablation.STAGES for t in ("arith", "arith_long")] + [("dapo_qwen2_5_32b", "mesh=gpu16x8"),
                                                           ("dapo_qwen2_5_32b", "mesh=v5p256")] + [
    ("dapo_qwen3_30b_a3b", f"mesh={m}") for m in ("gpu8", "gpu2x8", "v5p64")]


def load(name, arg):
  cfg = importlib.import_module(f"configs.{name}").get_config(arg)
  cfg.lock()
  return cfg


@pytest.mark.parametrize("name,arg", ARGS)
def test_config_builds_and_passes_startup_validation(name, arg):
  cfg = load(name, arg)
  # The same check `builders.run` makes before building anything (pod meshes: on their 128 devices).
  axes = [v for k, v in cfg.mesh.items() if k != "rollout_devices"]
  if arg and "mesh=" in arg and -1 not in axes:  # The mesh's own device count.
    builders.validate(cfg, num_devices=math.prod(axes))
  else:
    builders.validate(cfg, num_devices=128 if arg and "mesh=" in arg else None)
  mc = builders.model_config(cfg, 1024)
  assert isinstance(mc, model.ModelConfig)


@pytest.mark.parametrize("field,value,message", [
    ("train.minibatches", 7, r"does not split into train.minibatches=7"),
    ("train.num_microbatches", -1, r"train.num_microbatches=-1"),
    ("train.microbatch_tokens", 0, r"train.microbatch_tokens=0"),
    ("dapo.loss_agg", "sum", r"dapo.loss_agg='sum'"),
    ("dapo.on_cap", "skip", r"dapo.on_cap='skip'"),
    ("dapo.overlong_buffer", 10**6, r"dapo.overlong_buffer=1000000: expected from 0 to rollout.max_new_tokens=32"),
])
def test_startup_validation_names_the_field(field, value, message):
  cfg = load("default", None)
  group, name = field.split(".")
  cfg[group][name] = value
  with pytest.raises(ValueError, match=message):
    builders.validate(cfg)


def test_paper_recipe_values():
  c = load("dapo_qwen2_5_32b", None)
  assert (c.dapo.eps_low, c.dapo.eps_high, c.dapo.clip_ratio_c) == (0.2, 0.28, 10.0)
  assert (c.dapo.prompts_per_step, c.dapo.gen_prompts, c.rollout.group_size) == (512, 1536, 16)
  assert (c.rollout.max_new_tokens, c.dapo.overlong_buffer, c.dapo.max_gen_batches) == (20480, 4096, 10)
  assert (c.optim.lr, c.optim.warmup_steps, c.optim.weight_decay, c.train.minibatches) == (1e-6, 10, 0.1, 16)
  # verl's recipe: raise at the cap, drop surplus groups, filter on acc, stop on generation_config's EOS.
  assert (c.dapo.on_cap, c.dapo.carry_over, c.dapo.filter_metric) == ("raise", False, "acc")
  assert c.rollout.stop == "generation_config"
  mc = builders.model_config(c, 0)
  assert mc == model.ModelConfig.qwen2_5_32b(dtype="bfloat16", remat="full", attn_chunk=2048)


def test_ablation_stages_are_cumulative():
  stages = {s: load("ablation", f"stage={s}") for s in ablation.STAGES}
  assert stages["naive_grpo"].dapo.eps_high == 0.2 and stages["clip_higher"].dapo.eps_high == 0.28
  assert stages["overlong_filtering"].dapo.overlong_filter and not stages["naive_grpo"].dapo.overlong_filter
  assert stages["soft_overlong"].dapo.overlong_buffer == 4096
  assert stages["token_level_loss"].dapo.loss_agg == "token_mean"
  assert stages["dapo"].dapo.dynamic_sampling and not stages["token_level_loss"].dapo.dynamic_sampling


def flat(cfg):
  return {f"{g}.{k}": v for g, sub in cfg.to_dict().items() if isinstance(sub, dict) for k, v in sub.items()}


def test_ablation_on_arith_differs_from_the_default_job_only_where_it_says():
  stages = {s: flat(load("ablation", f"stage={s},task=arith")) for s in ablation.STAGES}
  algorithm = {"dapo.eps_high", "dapo.overlong_filter", "dapo.overlong_buffer", "dapo.loss_agg",
               "dapo.dynamic_sampling", "dapo.gen_prompts"}
  for s, c in stages.items():
    assert {k for k in c if c[k] != stages["dapo"][k]} <= algorithm, s
  # The dapo stage is the default job on the ablation's workload.
  default = flat(load("default", None))
  assert {k for k in default if default[k] != stages["dapo"][k]} == {
      "data.digits", "rollout.max_new_tokens", "dapo.overlong_buffer", "train.num_steps"}
  assert stages["naive_grpo"]["dapo.overlong_buffer"] == 0 and stages["soft_overlong"]["dapo.overlong_buffer"] == 3


def test_ablation_on_arith_long_differs_from_arith_only_in_the_length_lever():
  long = {s: flat(load("ablation", f"stage={s},task=arith_long")) for s in ablation.STAGES}
  short = {s: flat(load("ablation", f"stage={s},task=arith")) for s in ablation.STAGES}
  algorithm = {"dapo.eps_high", "dapo.overlong_filter", "dapo.overlong_buffer", "dapo.loss_agg",
               "dapo.dynamic_sampling", "dapo.gen_prompts"}
  for s, c in long.items():
    assert {k for k in c if c[k] != long["dapo"][k]} <= algorithm, s
  assert {k for k in short["dapo"] if short["dapo"][k] != long["dapo"][k]} == {
      "data.solution_style", "rollout.max_new_tokens", "dapo.overlong_buffer", "train.num_steps",
      "train.minibatches", "sft.target_acc"}
  assert long["naive_grpo"]["dapo.overlong_buffer"] == 0 and long["soft_overlong"]["dapo.overlong_buffer"] == 8


def test_locked_config_rejects_typos():
  cfg = load("default", None)
  with pytest.raises(AttributeError):
    cfg.dapo.eps_hihg = 0.3


def test_bf16_on_a_cpu_without_bf16_instructions_warns():
  fast_cpu = "flags : fpu sse2 avx512f avx512_bf16 avx512_vnni"
  slow_cpu = "flags : fpu sse2 avx2 fma"
  assert "AVX512-BF16" in builders.bf16_cpu_warning("bfloat16", "cpu", slow_cpu)
  assert builders.bf16_cpu_warning("bfloat16", "cpu", fast_cpu) is None
  assert builders.bf16_cpu_warning("bfloat16", "cpu", "flags : avx2 amx_bf16 amx_tile") is None
  assert builders.bf16_cpu_warning("float32", "cpu", slow_cpu) is None
  assert builders.bf16_cpu_warning("bfloat16", "gpu", slow_cpu) is None
