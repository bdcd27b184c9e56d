"""Print the per-device memory plan of a config for its mesh, and which accelerators it fits.

  python -m launch.plan --config=configs/dapo_qwen2_5_32b.py:mesh=gpu16x8
  python -m launch.plan --config=configs/dapo_qwen2_5_32b.py:mesh=v5p256

`--compiled` also compiles the update of one micro-batch (the model cut to `--layers` layers) on as many
forced host devices as the mesh has, and prints XLA's own memory analysis of it per device: what the
sequence axis (`mesh.sequence`) and packing change, measured rather than modelled.
"""
import dataclasses
import os

from absl import flags

from . import common

_CONFIG = common.define_config()
_DEVICES = flags.DEFINE_integer("devices", None, "Device count (default: the recipe's mesh's own size; 128 for a "
                                "mesh with a -1 axis).")
_COMPILED = flags.DEFINE_bool("compiled", False, "Also compile one micro-batch's update on forced host devices and "
                              "print XLA's per-device memory analysis.")
_LAYERS = flags.DEFINE_integer("layers", 2, "--compiled: the layers of the model compiled (the rest cut off).")


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
      shards=sharding.batch_shards(shape), max_tokens=cfg.train.microbatch_tokens,
      prompt_len=cfg.data.max_prompt_len, scored=train_step.scored_token_positions(mc))
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


def compiled(cfg, devices: int | None = None, layers: int = 2) -> str:
  """XLA's memory analysis, per device, of the update of one micro-batch of `cfg` (rows of data.max_prompt_len +
  rollout.max_new_tokens tokens, one per batch shard; with train.packing those rows packed, one sequence a
  shard) on its mesh, the model cut to its first `layers` layers. Needs that many JAX devices (`main` forces
  host devices)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from dapo_jax import builders, objectives, optim, packing, sharding, train_step
  from dapo_jax.datatypes import RLBatch
  mc = builders.model_config(cfg, cfg.model.vocab_size or 1024)
  full = mc.num_layers
  kept = lambda ls: tuple(l for l in ls if l < layers)
  mc = dataclasses.replace(mc, num_layers=min(layers, full), local_layers=kept(mc.local_layers),
                           dense_layers=kept(mc.dense_layers))
  n = devices_of(cfg.mesh, devices)
  mesh = sharding.make_mesh({k: v for k, v in dict(cfg.mesh).items() if k != "rollout_devices"}, jax.devices()[:n])
  trainer = train_step.Trainer(mc, optim.OptimConfig(), mesh, objectives.policy_gradient(mc, objectives.PGConfig()),
                               num_microbatches=1)
  P, C, rows = cfg.data.max_prompt_len, cfg.rollout.max_new_tokens, sharding.batch_shards(mesh.shape)
  if cfg.train.packing:  # Each shard's row of P + C real tokens, packed as the update packs it.
    ones = lambda *s, dt=np.float32: np.ones(s, dt)
    host = RLBatch(tokens_BT=ones(rows, P + C, dt=np.int32), mask_BT=ones(rows, P + C, dt=bool),
                   loss_mask_BC=ones(rows, C, dt=bool), old_logp_BC=ones(rows, C), adv_B=ones(rows),
                   ref_logp_BC=ones(rows, C))
    batch = packing.packed_microbatches(host, max_tokens=P + C, shards=rows, block=cfg.train.packing_block)[0]
  else:
    shape = lambda *s, dt=jnp.float32: jax.ShapeDtypeStruct(s, dt)
    batch = RLBatch(tokens_BT=shape(rows, P + C, dt=jnp.int32), mask_BT=shape(rows, P + C, dt=jnp.bool_),
                    loss_mask_BC=shape(rows, C, dt=jnp.bool_), old_logp_BC=shape(rows, C), adv_B=shape(rows),
                    ref_logp_BC=shape(rows, C))
  m = trainer.compiled_step_memory(batch)
  gb = lambda b: f"{b / 2**30:.2f} GB"
  return (f"compiled update ({mc.num_layers} of {full} layers; {rows} rows x {P + C} tokens; mesh {dict(mesh.shape)}), "
          f"per device: arguments {gb(m.argument_size_in_bytes)}, temporaries {gb(m.temp_size_in_bytes)}, "
          f"outputs {gb(m.output_size_in_bytes)}")


def main(argv):
  del argv
  cfg = _CONFIG.value
  print(report(cfg, _DEVICES.value, common.default_workdir().split("/")[-1]))
  if _COMPILED.value:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={devices_of(cfg.mesh, _DEVICES.value)}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    print(compiled(cfg, _DEVICES.value, _LAYERS.value))


if __name__ == "__main__":
  common.run(main)
