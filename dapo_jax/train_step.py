"""The pure, sharded train step: micro-batch gradient accumulation, global denominators, AdamW.

`Trainer` is the only place that calls `jax.jit` for training. It infers the sharding of the
whole `TrainState` from the parameters' logical axes, jits the step of any `objectives.Objective`
with in/out shardings and donation, and jits read-only forward passes (π_old, reference) that run
in the same micro-batches.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dapo_jax import optim, sharding
from dapo_jax.datatypes import RLBatch
from dapo_jax.model import lora as lora_lib
from dapo_jax.model import transformer as model_lib
from dapo_jax.objectives import Objective

# Tokens per automatic micro-batch (per data shard): keeps a small model's activations in cache
# (docs/benchmarks.md) and bounds a large one's memory.
MICROBATCH_TOKENS = 2048


@struct.dataclass
class TrainState:
  step: jax.Array           # optimizer updates applied
  rollout_step: jax.Array   # the rollout step being trained; sets the learning rate (§1.8)
  params: Any
  opt_state: Any
  skipped: jax.Array        # updates skipped because the loss or gradient norm was not finite
  bad_streak: jax.Array     # consecutive skipped updates
  controls: Any = None      # an objective's controller state (`objectives.EntropyControl`); None: none

  @classmethod
  def create(cls, params, tx: optax.GradientTransformation, adapters: bool = False, controls=None) -> "TrainState":
    """With `adapters`, params is a `lora` tree and the optimizer state covers params["lora"] alone."""
    zero = jnp.zeros((), jnp.int32)
    return cls(step=zero, rollout_step=zero, params=params, opt_state=tx.init(trainable(params, adapters)),
               skipped=zero, bad_streak=zero, controls=controls)


def trainable(params, adapters: bool = False):
  """What the optimizer updates: all params, or the adapters of a `lora` tree."""
  return params["lora"] if adapters else params


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
                      max_tokens: int = MICROBATCH_TOKENS, prefix: tuple[int, int] = (0, 0), prompt_len: int = 0,
                      scored: float = 0.0) -> int:
  """The fewest micro-batches that keep each one's tokens per data shard at or below `max_tokens`.

  A count is valid when every shard's rows split into it in whole groups (`split_microbatches`),
  so it divides the groups per shard; past the last valid count it returns the largest (one group
  per shard per micro-batch). On CPU, activations that stay in cache make a 3M model's update ~15%
  faster at ~2K tokens than at 6K, and SmolLM2-135M's 1.4x (its 49K-entry logits alone are 1.4 GB
  at 7K tokens); a compute-bound 30M model with a small vocabulary is indifferent. Tokens count as
  `group_tokens` says (rows whole, or what the shared-prefix layout `prefix` computes; `prompt_len`:
  the prompt's columns of a row; `scored`: what a completion position's logits hold, in positions).
  """
  G = max(group_size, 1)
  if rows % (G * shards):
    return 1  # Uneven shards: `split_microbatches` needs whole groups per shard.
  groups = rows // (G * shards)
  counts = [m for m in range(1, groups + 1) if groups % m == 0]
  per_group = group_tokens(G, prompt_len, seq_len - prompt_len, prefix, scored)
  return next((m for m in counts if groups // m * per_group + prefix[0] <= max_tokens), counts[-1])


def group_tokens(G: int, P: int, C: int, prefix: tuple[int, int] = (0, 0), scored: float = 0.0) -> float:
  """The tokens a group of G rows [P prompt | C completion columns] costs a micro-batch's budget:
  its rows whole, G x (P + C); in the shared-prefix layout (`prefix` = (N, W), `RLBatch.prefix_len`,
  `suffix_len`) what the model computes, W + G x C (and N once per micro-batch); and its G x C
  completion positions' logits, `scored` positions each (`scored_token_positions`)."""
  N, W = prefix
  return (W + G * C if N else G * (P + C)) + G * C * scored


def scored_token_positions(cfg: model_lib.ModelConfig) -> float:
  """What a scored token's logits hold through the backward, in positions' saved activations: the
  micro-batch budget (`microbatch_tokens`) counts each scored completion position as 1 + this. Its
  logits, their softmax and their gradient are 3 V floats (none kept past a chunk with
  `logits_chunk`); a position keeps, per layer, its input with remat "full", also every projection's
  output with "dots", and about twice that with "none" (norms, activations, attention's rows)."""
  if cfg.logits_chunk:
    return 0.0
  D, N, K, H = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  F = cfg.expert_mlp_dim * cfg.experts_per_token if cfg.moe else cfg.mlp_dim
  dots = N * H + 2 * K * H + 2 * D + 2 * F  # q, k, v, attention out, o, gate, up, down
  per_layer = {"full": D, "dots": D + dots, "none": 2 * (D + dots)}[cfg.remat]
  return 3 * cfg.vocab_size / (cfg.num_layers * per_layer)


def merge_microbatches(x_M, group_size: int = 1):
  """Inverse of `split_microbatches` for one array [M, B/M, ...] -> [B, ...]."""
  M, rows = x_M.shape[:2]
  G = max(group_size, 1)
  x = x_M.reshape(M, rows // G, G, *x_M.shape[2:])
  return jnp.swapaxes(x, 0, 1).reshape(M * rows, *x_M.shape[2:])


def train_step(state: TrainState, batch, *, objective: Callable, counts_fn: Callable,
               tx: optax.GradientTransformation, optim_cfg: optim.OptimConfig, num_microbatches: int = 1,
               group_size: int = 1, adapters: bool = False, dropout: float = 0.0, seed: int = 0, control=None):
  """One optimizer update on one mini-batch; pure. Returns (state, metrics).

  With `adapters` (a `lora` tree), gradients are taken with respect to the adapters alone, and
  the adapters' inputs are dropped with probability `dropout` (masks from `lora.dropout_key`).
  `control` (`objectives.EntropyControl`): the coefficient it applies joins the counts, and the
  update moves it (`state.controls`).
  """
  counts = with_controls(counts_fn(batch), state, control)  # Global over the mini-batch: every micro-batch's.
  grad_fn = jax.value_and_grad(adapter_loss(objective, state.params, adapters, dropout, seed, state.step),
                               has_aux=True)
  params = trainable(state.params, adapters)

  def accumulate(carry, mb_i):
    (loss, metrics), grads = grad_fn(params, *mb_i, counts)
    return jax.tree.map(jnp.add, carry, (loss, metrics, grads)), None

  if num_microbatches == 1:
    (loss, metrics), grads = grad_fn(params, batch, 0, counts)
  else:
    micro = split_microbatches(batch, num_microbatches, group_size)
    first = jax.tree.map(lambda x: x[0], micro)
    shapes = jax.eval_shape(lambda: grad_fn(params, first, 0, counts))
    (loss0, metrics0), grads0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    (loss, metrics, grads), _ = jax.lax.scan(accumulate, (loss0, metrics0, grads0),
                                             (micro, jnp.arange(num_microbatches)))

  return apply_update(state, loss, metrics, grads, counts, tx=tx, optim_cfg=optim_cfg, adapters=adapters,
                      control=control)


def with_controls(counts: dict, state: TrainState, control) -> dict:
  """`counts` and what the state's controller applies in this update (the entropy coefficient)."""
  if control is None:
    return counts
  return dict(counts, entropy_coef=control.applied(state.controls))


def adapter_loss(objective: Callable, params, adapters: bool, dropout: float, seed: int, update) -> Callable:
  """(trainable params, micro-batch, its index, counts) -> objective(...): the loss as a function of
  what the optimizer updates. With `adapters`, the rest of `params` (the frozen base) is closed
  over, and a `dropout` > 0 drops the adapters' inputs with the masks of (seed, update, micro-batch)."""
  if not adapters:
    return lambda p, mb, i, counts: objective(p, mb, counts)

  def loss(lora, mb, i, counts):
    full = dict(params, lora=lora)
    if dropout:
      full = lora_lib.with_dropout(full, dropout, lora_lib.dropout_key(seed, update, i))
    return objective(full, mb, counts)
  return loss


def apply_update(state: TrainState, loss, metrics: dict, grads, counts: dict, *, tx: optax.GradientTransformation,
                 optim_cfg: optim.OptimConfig, adapters: bool = False, control=None) -> tuple[TrainState, dict]:
  """AdamW on accumulated gradients (of the adapters alone with `adapters`); pure. A non-finite loss
  or gradient skips the update (counted); so does a mini-batch with no loss tokens (only padding),
  which must not move the weights, the optimizer moments or the step count (AdamW would still
  apply momentum and weight decay). `control`: its state moves by the update's metrics (a mini-batch
  without loss tokens leaves it)."""
  params = trainable(state.params, adapters)
  grad_norm = optax.global_norm(grads)
  ok = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
  has_tokens = counts["num_tokens"] > 0 if "num_tokens" in counts else jnp.asarray(True)
  apply = ok & has_tokens
  lr = optim.lr_at(optim_cfg, state.rollout_step)

  def updated(operands):
    params, opt_state, grads = operands
    updates, opt_state = tx.update(grads, optim.with_lr(opt_state, lr), params)
    return optax.apply_updates(params, updates), opt_state

  # A branch, not a select between the new and the old trees: XLA updates the donated state in place
  # instead of holding both (a params-sized temporary less).
  new_params, new_opt_state = jax.lax.cond(apply, updated, lambda operands: operands[:2],
                                           (params, state.opt_state, grads))
  state = state.replace(
      step=state.step + apply.astype(jnp.int32),
      params=dict(state.params, lora=new_params) if adapters else new_params,
      opt_state=new_opt_state,
      skipped=state.skipped + (~ok).astype(jnp.int32),
      bad_streak=jnp.where(ok, 0, state.bad_streak + 1))
  metrics = dict(metrics, loss=loss, grad_norm=grad_norm, lr=lr, update_skipped=(~ok).astype(jnp.float32),
                 update_applied=apply.astype(jnp.float32),
                 **{k: v for k, v in counts.items() if k == "num_tokens"})
  if control is not None:
    moved = control.update(state.controls, metrics["entropy"])
    state = state.replace(controls=jax.tree.map(lambda n, o: jnp.where(has_tokens, n, o), moved, state.controls))
    metrics.update(entropy_coef_applied=counts["entropy_coef"], entropy_coef=state.controls["entropy_coef"])
  return state, metrics


def microbatched_forward(fn: Callable, params, batch, num_microbatches: int = 1, group_size: int = 1):
  """`fn(params, batch) -> [B, ...]` over micro-batches (as the update splits the batch), reassembled."""
  if num_microbatches == 1:
    return fn(params, batch)
  micro = split_microbatches(batch, num_microbatches, group_size)
  return jax.tree.map(lambda x: merge_microbatches(x, group_size), jax.lax.map(lambda mb: fn(params, mb), micro))


class Trainer:
  """Owns the mesh placement of the train state and the jitted update of one objective.

  The step and every forward pass run under the mesh (`jax.set_mesh`), so the model's activation
  sharding constraints apply. Any `objectives.Objective` can be trained; `forward(fn)` jits a
  read-only pass (π_old or reference log-probs, values) in the same micro-batches as the update.

  With `lora` (a `lora.LoraConfig`), params are an adapted tree (`lora.adapt`: a frozen, possibly
  int8 base and adapters): gradients and AdamW state exist for the adapters alone, the step never
  donates or rewrites the base, and `reference_params` is the base with its adapters off. The
  update's forward drops adapter inputs with probability `lora.dropout` (masks from `seed` and
  the update count); `forward` passes never do.
  """

  def __init__(self, model_cfg: model_lib.ModelConfig, optim_cfg: optim.OptimConfig, mesh: Mesh,
               objective: Objective, *, num_microbatches: int = 1, microbatch_tokens: int = MICROBATCH_TOKENS,
               param_rules=sharding.PARAM_RULES, lora: lora_lib.LoraConfig | None = None, head: str = "lm",
               seed: int = 0, train_vision: bool = False):
    """`num_microbatches` splits each update's mini-batch for gradient accumulation; 0 picks, for
    each batch shape, the fewest micro-batches of at most `microbatch_tokens` tokens per data shard
    (`auto_microbatches`). `head` is the model's head ("scalar": a reward or value model). `seed`
    seeds the LoRA dropout masks. A vision-language model's tower and projector stay as they are unless
    `train_vision` (its objective then runs the tower on the batch's pixels)."""
    sharding.check_divisible(model_cfg, mesh)
    if lora is not None and model_cfg.moe:
      raise ValueError(f"model.lora.rank={lora.rank}: LoRA adapters on a mixture of experts (model.num_experts="
                       f"{model_cfg.num_experts}) are not supported; train it in full (model.lora.rank=0)")
    if num_microbatches < 0 or (num_microbatches == 0 and microbatch_tokens <= 0):
      raise ValueError(f"num_microbatches={num_microbatches}, microbatch_tokens={microbatch_tokens}: expected a "
                       "count >= 1, or 0 (auto) with a positive token budget")
    self.model_cfg, self.optim_cfg, self.mesh, self.objective = model_cfg, optim_cfg, mesh, objective
    # A frozen vision tower: the image vectors every pass places are computed once, outside the loss.
    frozen = ("vision",) if model_cfg.vision is not None and not train_vision else ()
    self.tx = optim.make(optim_cfg, frozen=frozen)
    self.num_microbatches, self.microbatch_tokens = num_microbatches, microbatch_tokens
    # A scored token's logits, in positions of the budget (a scalar head makes none).
    self.scored_cost = scored_token_positions(model_cfg) if head == "lm" else 0.0
    self.group_size = max(objective.group_size, 1)
    self.lora = lora
    self._control = objective.entropy_control
    dropout = lora.dropout if lora is not None else 0.0

    # Shardings of the whole state from the parameters' logical axes (boxed abstract params:
    # optax's moments inherit the boxes, so they shard like their parameters).
    control = objective.entropy_control
    controls = (lambda: control.init()) if control is not None else (lambda: None)
    if lora is None:
      def boxed_state():
        return TrainState.create(model_lib.init_boxed(model_cfg, jax.random.key(0), head), self.tx, controls=controls())
      logical = nn.get_partition_spec(jax.eval_shape(boxed_state))
    else:
      base_boxed = jax.eval_shape(lambda: model_lib.init_boxed(model_cfg, jax.random.key(0), head))
      self.base_float_sharding = nn.logical_to_mesh_sharding(nn.get_partition_spec(base_boxed), mesh, param_rules)
      logical = nn.get_partition_spec(jax.eval_shape(
          lambda p: TrainState.create(p, self.tx, adapters=True, controls=controls()),
          lora_lib.boxed(model_cfg, lora, base_boxed)))
    self.state_sharding = nn.logical_to_mesh_sharding(logical, mesh, param_rules)
    self.params_sharding = self.state_sharding.params
    self.batch_sharding = NamedSharding(mesh, P(sharding.BATCH_AXES))
    self.replicated = NamedSharding(mesh, P())

    # The micro-batch count is read off each batch's (static) shape when the function is traced.
    def step(state, batch):
      return train_step(state, batch, objective=objective.loss, counts_fn=objective.counts, tx=self.tx,
                        optim_cfg=optim_cfg, num_microbatches=self.microbatches_for(batch),
                        group_size=self.group_size, control=control)
    if lora is None:
      self._step = jax.jit(step, in_shardings=(self.state_sharding, self.batch_sharding),
                           out_shardings=(self.state_sharding, self.replicated), donate_argnums=0)
    else:
      self._setup_adapters(model_cfg, optim_cfg, objective, lora, seed)
    adapters = lora is not None

    def grads(params, mb, counts, update, i):  # Of the adapters alone in LoRA mode.
      loss = adapter_loss(objective.loss, params, adapters, dropout, seed, update)
      return jax.value_and_grad(loss, has_aux=True)(trainable(params, adapters), mb, i, counts)
    grads_sharding = self.params_sharding["lora"] if adapters else self.params_sharding
    self._grads = jax.jit(grads, in_shardings=(self.params_sharding, self.batch_sharding, self.replicated,
                                               self.replicated, self.replicated),
                          out_shardings=((self.replicated, self.replicated), grads_sharding))
    self._counts = jax.jit(objective.counts, in_shardings=(self.batch_sharding,), out_shardings=self.replicated)
    self._with_controls = jax.jit(lambda counts, state: with_controls(counts, state, control))
    # The running sum is donated: accumulating holds two gradient trees, not three.
    self._add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b), donate_argnums=0)
    self._apply = jax.jit(lambda state, loss, metrics, grads, counts: apply_update(
        state, loss, metrics, grads, counts, tx=self.tx, optim_cfg=optim_cfg, adapters=adapters, control=control),
        donate_argnums=() if adapters else (0,))  # A LoRA state's base is read by the reference too.
    self._create = jax.jit(lambda p: TrainState.create(p, self.tx, adapters=lora is not None, controls=controls()),
                           in_shardings=(self.params_sharding,), out_shardings=self.state_sharding)
    self._init_params = jax.jit(lambda rng: model_lib.init_params(model_cfg, rng, head),
                                out_shardings=self.params_sharding if lora is None else self.base_float_sharding)
    self._copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p), in_shardings=(self.params_sharding,),
                         out_shardings=self.params_sharding)

  def _setup_adapters(self, model_cfg, optim_cfg, objective, lora, seed) -> None:
    """The jitted pieces of LoRA mode. The step takes the frozen base as its own argument, which is
    not donated: the reference (`reference_params`) and the sampler keep reading the same arrays."""
    def step(rest, base, batch):
      state = rest.replace(params=dict(rest.params, base=base))
      state, metrics = train_step(state, batch, objective=objective.loss, counts_fn=objective.counts, tx=self.tx,
                                  optim_cfg=optim_cfg, num_microbatches=self.microbatches_for(batch),
                                  group_size=self.group_size, adapters=True, dropout=lora.dropout, seed=seed,
                                  control=objective.entropy_control)
      return _without_base(state), metrics
    rest_sharding = _without_base(self.state_sharding)
    self._step = jax.jit(step, in_shardings=(rest_sharding, self.params_sharding["base"], self.batch_sharding),
                         out_shardings=(rest_sharding, self.replicated), donate_argnums=0)
    self._adapt = jax.jit(lambda p, rng: lora_lib.adapt(model_cfg, lora, p, rng),
                          in_shardings=(self.base_float_sharding, self.replicated), out_shardings=self.params_sharding,
                          donate_argnums=0)
    self._copy_adapters = jax.jit(lambda a: jax.tree.map(jnp.copy, a), in_shardings=(self.params_sharding["lora"],),
                                  out_shardings=self.params_sharding["lora"])

  def step(self, state: TrainState, batch) -> tuple[TrainState, dict]:
    """One optimizer update on a placed mini-batch (see `put_batch`)."""
    with jax.set_mesh(self.mesh):
      if self.lora is None:
        return self._step(state, batch)
      base = state.params["base"]
      rest, metrics = self._step(_without_base(state), base, batch)
      return rest.replace(params=dict(rest.params, base=base)), metrics

  def compiled_step_memory(self, batch):
    """XLA's memory analysis (per device) of the update compiled for `batch`'s shapes and this mesh,
    without running it or allocating the state (full fine-tunes; `launch.plan --compiled` prints it)."""
    if self.lora is not None:
      raise ValueError("compiled_step_memory: full fine-tunes only (a LoRA step takes its base apart)")
    with jax.set_mesh(self.mesh):
      state = jax.eval_shape(lambda: self._create(self._init_params(jax.random.key(0))))
      return self._step.lower(state, batch).compile().memory_analysis()

  def accumulate_step(self, state: TrainState, micro_batches: list) -> tuple[TrainState, dict]:
    """One optimizer update from placed micro-batches of different shapes (e.g. completion axes cut
    to length buckets): gradients accumulate on device, the counts of the whole mini-batch are the
    sum of the micro-batches' (every count is additive), so the token mean stays global."""
    with jax.set_mesh(self.mesh):
      counts = self._counts(micro_batches[0])
      for mb in micro_batches[1:]:
        counts = self._add(counts, self._counts(mb))
      if self._control is not None:
        counts = self._with_controls(counts, state)
      acc = None
      for i, mb in enumerate(micro_batches):
        out = self._grads(state.params, mb, counts, state.step, i)
        acc = out if acc is None else self._add(acc, out)
      (loss, metrics), grads = acc
      return self._apply(state, loss, metrics, grads, counts)

  def updates(self, state: TrainState, minibatches: list[list], epochs: int = 1) -> tuple[TrainState, list[dict]]:
    """`epochs` passes over host `minibatches` (each a list of micro-batches: one is a plain step, several
    accumulate into one update); the metrics of every update, still on device."""
    out = []
    for _ in range(epochs):
      for parts in minibatches:
        placed = [self.put_batch(mb) for mb in parts]
        state, m = self.accumulate_step(state, placed) if len(placed) > 1 else self.step(state, placed[0])
        out.append(m)
    return state, out

  def lower_step(self, state, batch):
    """The step lowered for `state` and `batch` (arrays or `jax.ShapeDtypeStruct`s), as it runs."""
    with jax.set_mesh(self.mesh):
      if self.lora is None:
        return self._step.lower(state, batch)
      return self._step.lower(_without_base(state), state.params["base"], batch)

  def forward(self, fn: Callable) -> Callable:
    """Jits `fn(params, batch) -> [B, ...]` to run sharded like the update, in its micro-batches."""
    jitted = jax.jit(lambda params, batch: microbatched_forward(
        fn, params, batch, self.microbatches_for(batch), self.group_size),
        in_shardings=(self.params_sharding, self.batch_sharding), out_shardings=self.batch_sharding)

    def run(params, batch):
      with jax.set_mesh(self.mesh):
        return jitted(params, batch)
    return run

  def copy_params(self, params):
    """A separate on-device copy of `params`, sharded like them (e.g. a frozen reference model)."""
    return self._copy(params)

  def reference_params(self, params):
    """The frozen reference model of a run starting from `params`: a copy of them; with LoRA, the
    same base with the adapters switched off (only the small adapter tree is copied, since the
    step donates it)."""
    if self.lora is None:
      return self.copy_params(params)
    return dict(lora_lib.adapters_off(params), lora=self._copy_adapters(params["lora"]))

  def microbatches_for(self, batch) -> int:
    """Micro-batches an update (or forward pass) over `batch`, an array tree of [B, T] rows, runs in
    (a packed micro-batch is one)."""
    if getattr(batch, "packed", None) is not None:
      return 1
    if self.num_microbatches:
      return self.num_microbatches
    rows, seq_len = batch.tokens_BT.shape
    shards = sharding.batch_shards(self.mesh.shape)
    prefix = (getattr(batch, "prefix_len", 0), getattr(batch, "suffix_len", 0))
    # Rows without a completion axis (SFT's, DPO's) score every position.
    prompt_len = seq_len - batch.loss_mask_BC.shape[1] if hasattr(batch, "loss_mask_BC") else 0
    return auto_microbatches(rows, seq_len, group_size=self.group_size, shards=shards,
                             max_tokens=self.microbatch_tokens, prefix=prefix, prompt_len=prompt_len,
                             scored=self.scored_cost)

  def init(self, rng: jax.Array | None = None, params=None) -> TrainState:
    """A fresh state from given params (e.g. `hf.load`) or from random ones. With LoRA, plain params
    become the frozen base of fresh adapters (drawn from `rng`, default key 0); an adapted tree
    (`lora.adapt`, e.g. with `peft_format.load_peft`'s adapters) is kept as it is."""
    return self._create(self.place(params, rng))

  def place(self, params=None, rng: jax.Array | None = None):
    """`params` (random ones from `rng` if None) on the mesh as the state holds them: with LoRA,
    plain params become the frozen base of fresh adapters (drawn from `rng`, default key 0)."""
    if self.lora is None:
      return self._init_params(rng) if params is None else sharding.put(params, self.params_sharding)
    rng = jax.random.key(0) if rng is None else rng
    if params is None:
      params = self._init_params(rng)
    if lora_lib.is_adapted(params):
      return sharding.put(params, self.params_sharding)
    return self._adapt(sharding.put(params, self.base_float_sharding), jax.random.fold_in(rng, 1))

  def put_batch(self, batch):
    """Places a host batch (the same global rows on every process) on the mesh, split by rows."""
    return sharding.put(batch, self.batch_sharding)


def _without_base(state: TrainState) -> TrainState:
  """A LoRA train state without its frozen base (what the step donates and returns)."""
  return state.replace(params={k: v for k, v in state.params.items() if k != "base"})


def length_buckets(max_new_tokens: int, count: int = 8) -> tuple[int, ...]:
  """Completion lengths a length-bucketed update compiles for: `count` steps up to C (rounded up
  to multiples of 8), e.g. C=512 -> 64, 128, ..., 512."""
  step = -(-max_new_tokens // count)
  step = -(-step // 8) * 8
  return tuple(sorted({min(step * i, max_new_tokens) for i in range(1, count + 1)}))


def shared_prefix_layout(batch: RLBatch, group_size: int, multiple: int) -> RLBatch:
  """`batch` (host) marked for the shared-prefix layout when its prompts begin with the same
  `multiple` real tokens or more (a system prompt, few-shot examples): the model then runs that
  prefix once per batch rather than once per group (`RLBatch.prefix_len`). Prefix and rest are
  multiples of `multiple`, so a run compiles few shapes. `multiple` 0: unchanged."""
  if not (multiple and group_size) or batch.images_BMD is not None:  # Images: each prompt runs whole.
    return batch
  C = batch.loss_mask_BC.shape[1]
  P = batch.tokens_BT.shape[1] - C
  prompts, masks = np.asarray(batch.tokens_BT[::group_size, :P]), np.asarray(batch.mask_BT[::group_size, :P])
  reals = [p[m] for p, m in zip(prompts, masks)]
  N = model_lib.shared_prefix_len(reals, multiple)
  if not N:
    return batch
  rest = max(len(r) for r in reals) - N
  return batch.replace(prefix_len=N, suffix_len=min(P - N, -(-rest // multiple) * multiple))


def bucketed_microbatches(batch: RLBatch, num_microbatches: int, group_size: int, buckets: Sequence[int], *,
                          max_tokens: int = 0, shards: int = 1, scored: float = 0.0) -> list[RLBatch]:
  """A mini-batch's micro-batches with their completion axis cut to a length bucket (host, pure).

  Groups (`group_size` consecutive rows, never split) are sorted by their longest response. With
  `num_microbatches` they are dealt into that many micro-batches of consecutive groups. With 0, each
  bucket's micro-batches take as many groups per data shard as fit in `max_tokens` tokens per shard
  at that bucket's length (short rows go many to a micro-batch, long ones few: one shape per bucket);
  a bucket's leftover groups join the next bucket's, and the last bucket's leftovers form micro-batches
  of power-of-two sizes: a few compiled shapes. Otherwise each micro-batch is cut to the smallest
  bucket that holds its longest row. Rows keep all their tokens. A batch in the shared-prefix layout
  (`shared_prefix_layout`) keeps it in every micro-batch, and its groups cost what that layout
  computes (`group_tokens`); `scored` counts the completion positions' logits (`group_tokens`).
  """
  B, C = batch.loss_mask_BC.shape
  P = batch.tokens_BT.shape[1] - C
  G = max(group_size, 1)
  length_B = batch.mask_BT[:, P:].sum(1)
  longest_n = length_B.reshape(-1, G).max(1)
  order_n = np.argsort(longest_n, kind="stable")
  edges = sorted({b for b in buckets if b < C} | {C})
  bucket = lambda n: next(b for b in edges if b >= n)  # The shortest that holds n tokens.
  if not num_microbatches and len(order_n) % shards:
    num_microbatches = 1  # Groups that do not split over the shards: one micro-batch (as auto does).
  if num_microbatches:
    per_mb = len(order_n) // num_microbatches
    chunks = [order_n[m * per_mb:(m + 1) * per_mb] for m in range(num_microbatches)]
    chunks = [(groups, bucket(int(longest_n[groups].max()))) for groups in chunks]
  else:
    chunks = _token_budget_chunks(order_n, longest_n[order_n], edges, P, G, max_tokens, shards,
                                  (batch.prefix_len, batch.suffix_len), scored)
  out = []
  for groups, Cb in chunks:
    idx = (groups[:, None] * G + np.arange(G)[None]).reshape(-1)
    out.append(RLBatch(tokens_BT=batch.tokens_BT[idx, :P + Cb], mask_BT=batch.mask_BT[idx, :P + Cb],
                       loss_mask_BC=batch.loss_mask_BC[idx, :Cb], old_logp_BC=batch.old_logp_BC[idx, :Cb],
                       adv_B=batch.adv_B[idx], ref_logp_BC=batch.ref_logp_BC[idx, :Cb],
                       behaviour_B=None if batch.behaviour_B is None else batch.behaviour_B[idx],
                       adv_BC=None if batch.adv_BC is None else batch.adv_BC[idx, :Cb],
                       rollout_logp_BC=None if batch.rollout_logp_BC is None else batch.rollout_logp_BC[idx, :Cb],
                       images_BMD=None if batch.images_BMD is None else batch.images_BMD[idx],
                       pixels_BICSS=None if batch.pixels_BICSS is None else batch.pixels_BICSS[idx],
                       grids_BI2=None if batch.grids_BI2 is None else batch.grids_BI2[idx],
                       routes_BCLk=None if batch.routes_BCLk is None else batch.routes_BCLk[idx, :Cb],
                       prefix_len=batch.prefix_len, suffix_len=batch.suffix_len))
  return out


def _token_budget_chunks(sorted_n: np.ndarray, longest_sorted_n: np.ndarray, edges: Sequence[int],
                         P: int, G: int, max_tokens: int, shards: int,
                         prefix: tuple[int, int] = (0, 0), scored: float = 0.0) -> list[tuple[np.ndarray, int]]:
  """(group indices, completion length) of micro-batches of whole groups per shard that fit
  `max_tokens` per shard at their bucket's length; see `bucketed_microbatches`."""
  chunks, pending, lo = [], sorted_n[:0], 0
  for Cb in edges:
    hi = int(np.searchsorted(longest_sorted_n, Cb, side="right"))
    pending = np.concatenate([pending, sorted_n[lo:hi]])
    lo = hi
    per_mb = max(1, int((max_tokens - prefix[0]) // group_tokens(G, P, Cb, prefix, scored))) * shards
    full = len(pending) // per_mb * per_mb
    chunks += [(pending[i:i + per_mb], Cb) for i in range(0, full, per_mb)]
    pending = pending[full:]
  size = 1 << max(len(pending) // shards, 1).bit_length()
  while len(pending):  # Leftovers at the longest bucket: a few power-of-two shapes, largest first.
    size //= 2
    if len(pending) >= size * shards:
      chunks.append((pending[:size * shards], edges[-1]))
      pending = pending[size * shards:]
  return chunks
