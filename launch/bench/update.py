"""`bench update`: one rollout step's update on long-tailed rows, padded (micro-batches cut to length
buckets, `train.packing=False`) and packed (`train.packing=True`; with `--config.train.packing_block=c`,
also packed with attention by key blocks, "blocks"), side by side on the very same batch:
the update's median time (all micro-batches, forward + backward + AdamW; runs interleaved A B A B),
the positions each layout computes, and XLA's own FLOP count of each against the real tokens' FLOPs
(on the model cut to one layer: XLA's cost analysis counts a scanned loop's body once)."""
from . import e2e, shared


def bench(cfg, peak):
  """--num_prompts x --group rows: prompts of --prompt_len/4 to --prompt_len tokens, completions of up to
  --new_tokens tokens, log-normal with mean --mean_length (default --new_tokens / 4), one mini-batch."""
  import dataclasses
  import time

  import jax
  import numpy as np

  from dapo_jax import objectives, optim, packing, sharding, train_step
  from dapo_jax.model import transformer as model_lib
  mc, params = shared.load_model(cfg)
  Q, G, P, C = shared.NUM_PROMPTS.value, shared.GROUP.value, shared.PROMPT_LEN.value, shared.NEW_TOKENS.value
  batch = long_tail_batch(mc.vocab_size, Q, G, P, C, e2e.MEAN_LENGTH.value or max(C // 4, 1))
  mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
  shards = sharding.batch_shards(mesh.shape)
  share = G if cfg.train.share_prompt else 0
  pg = objectives.PGConfig(group_size=share, norm_len=C)
  trainer = train_step.Trainer(mc, optim.OptimConfig(lr=1e-6, warmup_steps=0), mesh, objectives.policy_gradient(mc, pg),
                               microbatch_tokens=cfg.train.microbatch_tokens)
  buckets = train_step.length_buckets(C, cfg.train.length_buckets) if cfg.train.length_buckets else ()
  layouts = {
      "padded": train_step.bucketed_microbatches(batch, 0, max(share, 1), buckets or (C,),
                                                 max_tokens=cfg.train.microbatch_tokens, shards=shards,
                                                 scored=trainer.scored_cost),
      "packed": packing.packed_microbatches(batch, max_tokens=cfg.train.microbatch_tokens, shards=shards,
                                            buckets=buckets, scored=trainer.scored_cost)}
  if cfg.train.packing_block:  # Attention by key blocks, in sequences of the whole budget.
    layouts["blocks"] = packing.packed_microbatches(batch, max_tokens=cfg.train.microbatch_tokens, shards=shards,
                                                    buckets=buckets, scored=trainer.scored_cost,
                                                    block=cfg.train.packing_block)
  state = {"s": trainer.init(params=params)}

  def update(parts):
    state["s"], metrics = trainer.updates(state["s"], [parts])
    return metrics[-1]["loss"]

  times = {name: [] for name in layouts}
  for name, parts in layouts.items():
    jax.block_until_ready(update(parts))  # Warm-up: compiles every shape.
  for _ in range(shared.RUNS.value):
    for name, parts in layouts.items():
      t0 = time.perf_counter()
      jax.block_until_ready(update(parts))
      times[name].append(time.perf_counter() - t0)
  real = real_tokens(batch, G)
  one = dataclasses.replace(mc, num_layers=1, local_layers=(), logits_chunk=0)  # No loop for the count to miss.
  one_params = jax.eval_shape(lambda: model_lib.init_params(one, jax.random.key(0)))
  one_objective = objectives.policy_gradient(one, pg)
  real_flops = real_update_flops(one, batch, G)
  out = {"bench": "update", "rows": Q * G, "prompt_len": P, "new_tokens": C,
         "microbatch_tokens": trainer.microbatch_tokens,
         "mean_length": float(np.asarray(batch.mask_BT[:, P:]).sum(1).mean()), "real_tokens": real,
         "real_update_flops_one_layer": real_flops}
  for name, parts in layouts.items():
    flops = sum(update_flops(one_objective, one_params, parts, p) for p in parts)
    out[name] = {"update_s": float(np.median(times[name])), "runs_s": times[name], "microbatches": len(parts),
                 "shapes": sorted({shape(p) for p in parts}), "positions": sum(positions(p, share) for p in parts),
                 "xla_update_flops": flops, "xla_flops_over_real": flops / real_flops}
  for name in layouts:
    if name != "padded":
      out[f"{name}_speedup"] = out["padded"]["update_s"] / out[name]["update_s"]
  return out


def long_tail_batch(V: int, Q: int, G: int, P: int, C: int, mean: int, seed: int = 0):
  """Q groups of G rows: a shared left-padded prompt, completions of log-normal lengths (`e2e.LengthHook`)."""
  import numpy as np

  from dapo_jax.datatypes import RLBatch
  rng = np.random.default_rng(seed)
  B = Q * G
  prompt_mask = np.repeat(np.arange(P)[None] >= P - rng.integers(max(P // 4, 1), P + 1, size=Q)[:, None], G, 0)
  prompt = np.repeat(rng.integers(0, V, size=(Q, P)), G, 0) * prompt_mask
  length_B = e2e.LengthHook(mean, C, seed)(B)
  mask_BC = np.arange(C)[None] < length_B[:, None]
  tokens = np.concatenate([prompt, rng.integers(0, V, size=(B, C)) * mask_BC], 1).astype(np.int32)
  return RLBatch(tokens_BT=tokens, mask_BT=np.concatenate([prompt_mask, mask_BC], 1), loss_mask_BC=mask_BC,
                 old_logp_BC=np.full((B, C), -5.0, np.float32), adv_B=rng.normal(size=B).astype(np.float32),
                 ref_logp_BC=np.zeros((B, C), np.float32))


def real_tokens(batch, G: int) -> int:
  """The tokens a forward must read: each group's prompt but its last token once, then each row's own
  tokens from there, but its last column."""
  import numpy as np
  mask = np.asarray(batch.mask_BT[:, :-1])
  P = batch.tokens_BT.shape[1] - batch.loss_mask_BC.shape[1]
  trunk_B = np.maximum(mask[:, :P].sum(1) - 1, 0)
  return int(mask.sum() - trunk_B.sum() + trunk_B[::G].sum())


def real_update_flops(mc, batch, G: int) -> float:
  """The forward and backward FLOPs of that work: the layers' matmuls on `real_tokens`, the lm head on
  the completion tokens, attention's QK^T and AV over each row's causal pairs (a shared prompt's own
  pairs once)."""
  import numpy as np
  mask = np.asarray(batch.mask_BT[:, :-1])
  P = batch.tokens_BT.shape[1] - batch.loss_mask_BC.shape[1]
  trunk_B = np.maximum(mask[:, :P].sum(1) - 1, 0).astype(np.float64)
  branch_B = mask.sum(1) - trunk_B
  scored = float(np.asarray(batch.mask_BT[:, P:]).sum())
  head = mc.vocab_size * mc.embed_dim
  pairs = (trunk_B[::G] ** 2).sum() / 2 + (branch_B * trunk_B + branch_B ** 2 / 2).sum()
  forward = 2 * (shared.matmul_params(mc) - head) * real_tokens(batch, G) + 2 * head * scored
  return 3 * (forward + shared.attention_flops(mc, 1, 1) * pairs)


def positions(mb, share: int) -> int:
  """Positions the model computes for a micro-batch (padding included; a shared prompt once per group
  of `share` rows, 0: none)."""
  import numpy as np
  if mb.packed is not None:
    return int(np.prod(mb.packed.tokens_MT.shape))
  B, C = mb.loss_mask_BC.shape
  P = mb.tokens_BT.shape[1] - C
  return B // share * P + B * C if share else B * (P + C)


def shape(mb) -> tuple:
  return tuple(mb.packed.tokens_MT.shape) + (mb.loss_mask_BC.shape[0],) if mb.packed is not None else mb.tokens_BT.shape


def update_flops(obj, params, parts, mb) -> float:
  """XLA's FLOP count (cost analysis of the compiled program) of one micro-batch's loss and gradient."""
  import jax
  counts = jax.tree.map(lambda *c: sum(c), *[obj.counts(p) for p in parts])
  lowered = jax.jit(jax.value_and_grad(obj.loss, has_aux=True)).lower(params, mb, counts)
  cost = lowered.compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get("flops", 0.0))
