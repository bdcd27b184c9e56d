"""`bench train`: forward and update (forward + backward + AdamW) throughput and MFU of the train
step on rows of random tokens."""
from . import shared


def bench(cfg, peak):
  mc, params = shared.load_model(cfg)
  return rates(cfg, mc, params, shared.BATCH.value, shared.SEQ_LEN.value, shared.RUNS.value, peak)


def rates(cfg, mc, params, B: int, T: int, runs: int, peak: float) -> dict:
  """Forward and update (forward + backward + AdamW) of B rows of T tokens: tokens/s and MFU."""
  from dapo_jax import objectives, optim, sharding, train_step
  C = T - 1  # Score every position after the first, like a causal-LM loss over the whole row.
  mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
  trainer = train_step.Trainer(mc, optim.OptimConfig(lr=1e-6, warmup_steps=0), mesh,
                               objectives.policy_gradient(mc, objectives.PGConfig()),
                               num_microbatches=cfg.train.num_microbatches,
                               microbatch_tokens=cfg.train.microbatch_tokens)
  logprobs = trainer.forward(objectives.completion_logprobs(mc, 1.0))
  state = trainer.init(params=params)
  batch = trainer.put_batch(rl_batch(mc, B, T, C))
  t_fwd, _ = shared.timed(lambda: logprobs(state.params, batch), runs)
  holder = {"state": state}

  def step():
    holder["state"], m = trainer.step(holder["state"], batch)
    return m["loss"]
  t_step, times = shared.timed(step, runs)
  tokens = B * T
  fwd = 2 * shared.matmul_params(mc) * tokens + shared.attention_flops(mc, tokens, T / 2)
  return {"bench": "train", "microbatches": trainer.microbatches_for(batch),
          "forward_tokens_per_s": tokens / t_fwd, "update_tokens_per_s": tokens / t_step,
          "update_median_s": t_step, "runs_s": times, "forward_mfu": fwd / t_fwd / peak,
          "update_mfu": 3 * fwd / t_step / peak}


def rl_batch(mc, B, T, C, seed=0):
  """B rows of T random tokens, the last C scored, with fixed old log-probs and random advantages."""
  import numpy as np

  from dapo_jax.datatypes import RLBatch
  rng = np.random.default_rng(seed)
  return RLBatch(tokens_BT=rng.integers(0, mc.vocab_size, size=(B, T)).astype(np.int32),
                 mask_BT=np.ones((B, T), bool), loss_mask_BC=np.ones((B, C), bool),
                 old_logp_BC=np.full((B, C), -5.0, np.float32), adv_B=rng.normal(size=B).astype(np.float32),
                 ref_logp_BC=np.zeros((B, C), np.float32))
