"""Lowers a recipe's DAPO train step and sampler (Qwen2.5-32B, Qwen3-30B-A3B) on a 128-device CPU
mesh with abstract shapes (nothing is allocated), then compiles a 2-layer cut. Run with 128 forced
host devices: `pod_lowering_worker.py CONFIG MESH`."""
import dataclasses
import importlib
import sys

import jax
import jax.numpy as jnp

from dapo_jax import builders, objectives, optim, sharding, train_step
from dapo_jax.datatypes import RLBatch
from dapo_jax.rollout import sampling

config_name, mesh_name = sys.argv[1:3]
cfg = importlib.import_module(f"configs.{config_name}").get_config(f"mesh={mesh_name}")
mc = builders.model_config(cfg, 0)
mesh = sharding.make_mesh(cfg.mesh)
assert mesh.devices.size == 128, mesh


def lower(mc, T_prompt, C, rows, gen_rows, compile_it):
  G = cfg.rollout.group_size  # As the loop runs it: one prompt forward per group, one prefill per prompt.
  pg = objectives.PGConfig(eps_low=0.2, eps_high=0.28, clip_ratio_c=10.0,
                           group_size=G if cfg.train.share_prompt else 0)
  trainer = train_step.Trainer(mc, optim.OptimConfig(**cfg.optim), mesh, objectives.policy_gradient(mc, pg),
                               num_microbatches=cfg.train.num_microbatches,
                               microbatch_tokens=cfg.train.microbatch_tokens)
  state = jax.eval_shape(lambda: train_step.TrainState.create(
      jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), trainer_param_shapes(mc)), trainer.tx))
  state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state,
                       trainer.state_sharding)
  T = T_prompt + C
  bs = trainer.batch_sharding
  sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=bs)
  batch = RLBatch(tokens_BT=sds((rows, T), jnp.int32), mask_BT=sds((rows, T), bool),
                  loss_mask_BC=sds((rows, C), bool), old_logp_BC=sds((rows, C), jnp.float32),
                  adv_B=sds((rows,), jnp.float32), ref_logp_BC=sds((rows, C), jnp.float32))
  lowered = trainer.lower_step(state, batch)
  sc = sampling.SamplerConfig(max_new_tokens=C, temperature=1.0, eos_ids=(151643, 151645))
  prompt = jax.ShapeDtypeStruct((gen_rows // G, T_prompt), jnp.int32, sharding=bs)
  pmask = jax.ShapeDtypeStruct((gen_rows // G, T_prompt), bool, sharding=bs)
  lowered_s = sampling.generate_jit.lower(mc, sc, state.params, prompt, pmask, jax.random.key(0),
                                          jnp.asarray(C, jnp.int32), G, jnp.zeros((gen_rows,), jnp.int32))
  if compile_it:
    lowered.compile()
    lowered_s.compile()
  return lowered


def trainer_param_shapes(mc):
  from dapo_jax.model import transformer as model
  return jax.eval_shape(lambda: model.init_params(mc, jax.random.key(0)))


rows = cfg.dapo.prompts_per_step * cfg.rollout.group_size // cfg.train.minibatches
with mesh:
  lower(mc, cfg.data.max_prompt_len, cfg.rollout.max_new_tokens, rows, cfg.rollout.rows_per_call, False)
  print(f"lowered full {config_name} train step and sampler", flush=True)
  cut = dataclasses.replace(mc, num_layers=2)
  lower(cut, 512, 1024, rows, cfg.rollout.rows_per_call, True)
  print("compiled 2-layer cut", flush=True)
