"""The pure, sharded train step: micro-batch gradient accumulation, global denominators, AdamW.

`Trainer` is the only place that calls `jax.jit` for training. It infers the sharding of the
whole `TrainState` from the parameters' logical axes, jits the step with in/out shardings and
donation, and jits the forward pass that recomputes π_old log-probs.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dapo_jax import loss as loss_lib
from dapo_jax import model as model_lib
from dapo_jax import optim, sharding
from dapo_jax.datatypes import LMBatch, RLBatch


@struct.dataclass
class TrainState:
  step: jax.Array           # optimizer updates applied
  rollout_step: jax.Array   # the rollout step being trained; sets the learning rate (§1.8)
  params: Any
  opt_state: Any
  skipped: jax.Array        # updates skipped because the loss or gradient norm was not finite
  bad_streak: jax.Array     # consecutive skipped updates

  @classmethod
  def create(cls, params, tx: optax.GradientTransformation) -> "TrainState":
    zero = jnp.zeros((), jnp.int32)
    return cls(step=zero, rollout_step=zero, params=params, opt_state=tx.init(params), skipped=zero,
               bad_streak=zero)


@dataclasses.dataclass(frozen=True)
class PGConfig:
  """Static settings of the policy-gradient objective."""
  eps_low: float = 0.2
  eps_high: float = 0.28
  clip_ratio_c: float | None = 10.0
  loss_agg: str = "token_mean"
  verl_microbatch_weighting: bool = False   # reproduce verl's per-micro-batch token mean (§1.5c)
  temperature: float = 1.0                  # rollout temperature; log-probs use scaled logits
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  old_is_current: bool = False              # π_old = π_θ (one update per rollout step): ratio is 1
  group_size: int = 0                       # >0: rows come in groups of G sharing one prompt, which
                                            # then runs through the model once per group


# --- objectives: (counts over the whole mini-batch, loss of one micro-batch) ---------------------

def pg_counts(batch: RLBatch) -> dict:
  return {"num_tokens": jnp.sum(batch.loss_mask_BC.astype(jnp.float32)),
          "num_seqs": loss_lib.num_seqs_with_tokens(batch.loss_mask_BC),
          "num_rows": jnp.asarray(batch.adv_B.shape[0], jnp.float32)}


def policy_logits(model_cfg: model_lib.ModelConfig, group_size: int, params, mb: RLBatch) -> jax.Array:
  """Logits [B, C, V] predicting each completion token of a mini-batch of RL rows."""
  C = mb.loss_mask_BC.shape[1]
  P = mb.tokens_BT.shape[1] - C
  if group_size:
    return model_lib.completion_logits(model_cfg, params, mb.tokens_BT[::group_size, :P],
                                       mb.mask_BT[::group_size, :P], mb.tokens_BT[:, P:], mb.mask_BT[:, P:])
  # Logits at position P-1+t predict completion token t.
  return model_lib.logits(model_cfg, params, mb.tokens_BT[:, :-1], mb.mask_BT[:, :-1], logits_from=P - 1)


def pg_objective(model_cfg: model_lib.ModelConfig, cfg: PGConfig, params, mb: RLBatch, counts: dict):
  P = mb.tokens_BT.shape[1] - mb.loss_mask_BC.shape[1]
  z_BCV = policy_logits(model_cfg, cfg.group_size, params, mb) / cfg.temperature
  logp_BC = loss_lib.token_logprobs(z_BCV, mb.tokens_BT[:, P:])
  old_logp_BC = jax.lax.stop_gradient(logp_BC) if cfg.old_is_current else mb.old_logp_BC
  if cfg.verl_microbatch_weighting:
    # verl: token mean inside the micro-batch, weighted by its share of the mini-batch's rows.
    denoms = dict(num_tokens=None, num_seqs=None)
    weight = mb.adv_B.shape[0] / counts["num_rows"]
  else:
    denoms = dict(num_tokens=counts["num_tokens"], num_seqs=counts["num_seqs"])
    weight = 1.0
  loss, metrics = loss_lib.policy_loss(
      logp_BC, old_logp_BC, mb.adv_B, mb.loss_mask_BC, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
      clip_ratio_c=cfg.clip_ratio_c, agg=cfg.loss_agg, ref_logp_BC=mb.ref_logp_BC, kl_coef=cfg.kl_coef,
      kl_estimator=cfg.kl_estimator, **denoms)
  metrics = jax.tree.map(lambda m: m * weight, metrics)
  metrics["entropy"] = loss_lib.masked_mean(loss_lib.entropy(jax.lax.stop_gradient(z_BCV)),
                                            mb.loss_mask_BC, denoms["num_tokens"]) * weight
  return loss * weight, metrics


def lm_counts(batch: LMBatch) -> dict:
  return {"num_tokens": jnp.sum(batch.loss_mask_BT[:, 1:].astype(jnp.float32))}


def lm_objective(model_cfg: model_lib.ModelConfig, params, mb: LMBatch, counts: dict):
  """Next-token cross-entropy, token mean over the whole mini-batch."""
  logits_BTV = model_lib.logits(model_cfg, params, mb.tokens_BT[:, :-1], mb.mask_BT[:, :-1])
  logp_BT = loss_lib.token_logprobs(logits_BTV, mb.tokens_BT[:, 1:])
  mask = mb.loss_mask_BT[:, 1:]
  nll = -loss_lib.masked_mean(logp_BT, mask, counts["num_tokens"])
  correct = (jnp.argmax(logits_BTV, -1) == mb.tokens_BT[:, 1:]).astype(jnp.float32)
  return nll, {"lm_loss": nll, "token_acc": loss_lib.masked_mean(correct, mask, counts["num_tokens"])}


# --- the step ---------------------------------------------------------------------------------

def split_microbatches(batch, num_microbatches: int, group_size: int = 1):
  """[B, ...] -> [M, B/M, ...]; micro-batch m takes groups of rows m, m+M, ... so data shards stay local.

  A group is `group_size` consecutive rows (the samples of one prompt) and is never split.
  """
  M, G = num_microbatches, max(group_size, 1)

  def split(x):
    B = x.shape[0]
    if B % (M * G):
      raise ValueError(f"batch of {B} rows does not split into {M} micro-batches of whole groups of {G}")
    x = x.reshape(B // (M * G), M, G, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1).reshape(M, B // M, *x.shape[3:])
  return jax.tree.map(split, batch)


def auto_microbatches(rows: int, seq_len: int, *, group_size: int = 1, shards: int = 1,
                      max_tokens: int = 2048) -> int:
  """The fewest micro-batches that keep each one's tokens per data shard at or below `max_tokens`.

  A count is valid when every shard's rows split into it in whole groups (`split_microbatches`),
  so it divides the groups per shard; past the last valid count it returns the largest (one group
  per shard per micro-batch). On CPU, activations that stay in cache make a 3M model's update ~15%
  faster at ~2K tokens than at 6K, and SmolLM2-135M's 1.4x (its 49K-entry logits alone are 1.4 GB
  at 7K tokens); a compute-bound 30M model with a small vocabulary is indifferent.
  """
  G = max(group_size, 1)
  if rows % (G * shards):
    return 1  # Uneven shards: `split_microbatches` needs whole groups per shard.
  groups = rows // (G * shards)
  counts = [m for m in range(1, groups + 1) if groups % m == 0]
  return next((m for m in counts if rows // (m * shards) * seq_len <= max_tokens), counts[-1])


def merge_microbatches(x_M, group_size: int = 1):
  """Inverse of `split_microbatches` for one array [M, B/M, ...] -> [B, ...]."""
  M, rows = x_M.shape[:2]
  G = max(group_size, 1)
  x = x_M.reshape(M, rows // G, G, *x_M.shape[2:])
  return jnp.swapaxes(x, 0, 1).reshape(M * rows, *x_M.shape[2:])


def train_step(state: TrainState, batch, *, objective: Callable, counts_fn: Callable,
               tx: optax.GradientTransformation, optim_cfg: optim.OptimConfig, num_microbatches: int = 1,
               group_size: int = 1):
  """One optimizer update on one mini-batch; pure. Returns (state, metrics)."""
  counts = counts_fn(batch)  # Global over the mini-batch: the denominators of every micro-batch.
  grad_fn = jax.value_and_grad(lambda p, mb: objective(p, mb, counts), has_aux=True)

  def accumulate(carry, mb):
    (loss, metrics), grads = grad_fn(state.params, mb)
    return jax.tree.map(jnp.add, carry, (loss, metrics, grads)), None

  if num_microbatches == 1:
    (loss, metrics), grads = grad_fn(state.params, batch)
  else:
    micro = split_microbatches(batch, num_microbatches, group_size)
    first = jax.tree.map(lambda x: x[0], micro)
    shapes = jax.eval_shape(lambda: grad_fn(state.params, first))
    (loss0, metrics0), grads0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    (loss, metrics, grads), _ = jax.lax.scan(accumulate, (loss0, metrics0, grads0), micro)

  grad_norm = optax.global_norm(grads)
  ok = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
  lr = optim.lr_at(optim_cfg, state.rollout_step)
  updates, new_opt_state = tx.update(grads, optim.with_lr(state.opt_state, lr), state.params)
  new_params = optax.apply_updates(state.params, updates)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
  state = state.replace(
      step=state.step + ok.astype(jnp.int32), params=keep(new_params, state.params),
      opt_state=keep(new_opt_state, state.opt_state),
      skipped=state.skipped + (~ok).astype(jnp.int32),
      bad_streak=jnp.where(ok, 0, state.bad_streak + 1))
  metrics = dict(metrics, loss=loss, grad_norm=grad_norm, lr=lr, update_skipped=(~ok).astype(jnp.float32),
                 **{k: v for k, v in counts.items() if k == "num_tokens"})
  return state, metrics


def completion_logprobs(model_cfg, temperature: float, params, batch: RLBatch, num_microbatches: int = 1,
                        group_size: int = 0):
  """log π(completion token) under `params`, from temperature-scaled logits: [B, C] fp32."""
  def one(mb):
    C = mb.loss_mask_BC.shape[1]
    P = mb.tokens_BT.shape[1] - C
    logits_BCV = policy_logits(model_cfg, group_size, params, mb)
    return loss_lib.token_logprobs(logits_BCV / temperature, mb.tokens_BT[:, P:])
  if num_microbatches == 1:
    return one(batch)
  return merge_microbatches(jax.lax.map(one, split_microbatches(batch, num_microbatches, group_size)), group_size)


class Trainer:
  """Owns the mesh placement of the train state and the jitted step / log-prob functions."""

  def __init__(self, model_cfg: model_lib.ModelConfig, optim_cfg: optim.OptimConfig, mesh: Mesh, *,
               objective: str = "pg", pg_cfg: PGConfig = PGConfig(), num_microbatches: int = 1,
               microbatch_tokens: int = 2048, param_rules=sharding.PARAM_RULES):
    """`num_microbatches` splits each update's mini-batch for gradient accumulation; 0 picks, for
    each batch shape, the fewest micro-batches of at most `microbatch_tokens` tokens per data shard
    (`auto_microbatches`). The old-log-prob forward runs in the same micro-batches."""
    sharding.check_divisible(model_cfg, mesh)
    if num_microbatches < 0 or (num_microbatches == 0 and microbatch_tokens <= 0):
      raise ValueError(f"num_microbatches={num_microbatches}, microbatch_tokens={microbatch_tokens}: expected a "
                       "count >= 1, or 0 (auto) with a positive token budget")
    self.model_cfg, self.optim_cfg, self.mesh, self.pg_cfg = model_cfg, optim_cfg, mesh, pg_cfg
    self.tx = optim.make(optim_cfg)
    self.num_microbatches, self.microbatch_tokens = num_microbatches, microbatch_tokens

    # Shardings of the whole state from the parameters' logical axes (boxed abstract params:
    # optax's moments inherit the boxes, so they shard like their parameters).
    def boxed_state():
      return TrainState.create(model_lib.init_boxed(model_cfg, jax.random.key(0)), self.tx)
    logical = nn.get_partition_spec(jax.eval_shape(boxed_state))
    self.state_sharding = nn.logical_to_mesh_sharding(logical, mesh, param_rules)
    self.params_sharding = self.state_sharding.params
    # The sampler gathers FSDP shards once per rollout instead of once per decoded token.
    self.sampling_params_sharding = nn.logical_to_mesh_sharding(logical.params, mesh,
                                                                sharding.SAMPLING_PARAM_RULES)
    self.batch_sharding = NamedSharding(mesh, P(("data", "fsdp")))
    self.replicated = NamedSharding(mesh, P())

    if objective == "pg":
      obj, counts_fn = functools.partial(pg_objective, model_cfg, pg_cfg), pg_counts
    elif objective == "lm":
      obj, counts_fn = functools.partial(lm_objective, model_cfg), lm_counts
    else:
      raise ValueError(f"objective {objective!r}; expected 'pg' or 'lm'")
    self.group_size = pg_cfg.group_size if objective == "pg" else 1

    # The micro-batch count is read off each batch's (static) shape when the function is traced.
    def step(state, batch):
      return train_step(state, batch, objective=obj, counts_fn=counts_fn, tx=self.tx, optim_cfg=optim_cfg,
                        num_microbatches=self.microbatches_for(batch), group_size=self.group_size)

    def logprobs(params, batch):
      return completion_logprobs(model_cfg, pg_cfg.temperature, params, batch,
                                 num_microbatches=self.microbatches_for(batch), group_size=pg_cfg.group_size)
    self.step = jax.jit(step, in_shardings=(self.state_sharding, self.batch_sharding),
                        out_shardings=(self.state_sharding, self.replicated), donate_argnums=0)
    self.logprobs = jax.jit(logprobs, in_shardings=(self.params_sharding, self.batch_sharding),
                            out_shardings=self.batch_sharding)
    self._create = jax.jit(lambda p: TrainState.create(p, self.tx), in_shardings=(self.params_sharding,),
                           out_shardings=self.state_sharding)
    self._init_params = jax.jit(lambda rng: model_lib.init_params(model_cfg, rng),
                                out_shardings=self.params_sharding)

  def microbatches_for(self, batch) -> int:
    """Micro-batches an update (or old-log-prob pass) over `batch`, an array tree of [B, T] rows, runs in."""
    if self.num_microbatches:
      return self.num_microbatches
    rows, seq_len = batch.tokens_BT.shape
    shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    return auto_microbatches(rows, seq_len, group_size=self.group_size, shards=shards,
                             max_tokens=self.microbatch_tokens)

  def init(self, rng: jax.Array | None = None, params=None) -> TrainState:
    """A fresh state from given params (e.g. `hf.load`) or from random ones."""
    if params is None:
      params = self._init_params(rng)
    else:
      params = sharding.put(params, self.params_sharding)
    return self._create(params)

  def put_batch(self, batch):
    """Places a host batch (the same global rows on every process) on the mesh, split by rows."""
    return sharding.put(batch, self.batch_sharding)
