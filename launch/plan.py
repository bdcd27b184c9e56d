"""Print the per-device memory plan of a config for its mesh, and which accelerators it fits.

  python -m launch.plan --config=configs/dapo_qwen2_5_32b.py:mesh=gpu16x8
  python -m launch.plan --config=configs/dapo_qwen2_5_32b.py:mesh=v5p256
"""
from absl import flags

from . import common

_CONFIG = common.define_config()
_DEVICES = flags.DEFINE_integer("devices", None, "Device count (default: the recipe's mesh's own size; 128 for a "
                                "mesh with a -1 axis).")


def devices_of(mesh_cfg, devices: int | None) -> int:
  """The devices the plan is for: as given, else the mesh's own count (128 when an axis is -1)."""
  from dapo_jax import sharding
  return devices or sharding.mesh_devices(mesh_cfg) or 128


def report(cfg, devices: int | None = None, name: str = "") -> str:
  """The plan of `cfg` on `devices` (default: its mesh's size, `devices_of`) as printed."""
  from dapo_jax import builders, sharding, train_step
  from dapo_jax.model import lora as lora_lib
  from dapo_jax.model import memory
  lora = builders.lora_config(cfg)
  mc = builders.model_config(cfg, cfg.model.vocab_size or 1024)
  try:
    shape = sharding.mesh_shape(dict(cfg.mesh), devices_of(cfg.mesh, devices))
  except ValueError as e:
    raise builders.ConfigError(f"{e} (--devices={devices})") from None
  rows_per_update = cfg.dapo.prompts_per_step * cfg.rollout.group_size // cfg.train.minibatches
  seq_len = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
  num_microbatches = cfg.train.num_microbatches or train_step.auto_microbatches(
      rows_per_update, seq_len, group_size=cfg.rollout.group_size if cfg.train.share_prompt else 1,
      shards=sharding.batch_shards(shape), max_tokens=cfg.train.microbatch_tokens)
  p = memory.plan(mc, shape, rows_per_update=rows_per_update, num_microbatches=num_microbatches,
                  prompt_len=cfg.data.max_prompt_len, completion_len=cfg.rollout.max_new_tokens,
                  gen_rows=cfg.rollout.rows_per_call or cfg.dapo.gen_prompts * cfg.rollout.group_size,
                  lora=lora)
  lines = []
  if lora is not None:
    lines.append(f"LoRA rank {lora.rank} on {', '.join(lora.targets)}: {lora_lib.param_count(mc, lora) / 1e6:.2f}M "
                 f"trainable parameters; base {lora.base_quant or mc.param_dtype}, frozen (no gradients or optimizer "
                 "state)")
  active = f" ({mc.num_active_params / 1e9:.2f}B active per token)" if mc.moe else ""
  batches = "micro-batch" + ("es" if num_microbatches > 1 else "")
  lines.append(f"model: {mc.num_params / 1e9:.2f}B parameters{active}, mesh {shape}, "
               f"{rows_per_update} rows x {seq_len} tokens per update in {num_microbatches} {batches}")
  lines.append(memory.report(p, name))
  return "\n".join(lines)


def main(argv):
  del argv
  print(report(_CONFIG.value, _DEVICES.value, common.default_workdir().split("/")[-1]))


if __name__ == "__main__":
  common.run(main)
