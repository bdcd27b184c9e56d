"""What a `train_step.Trainer` optimises: one function per pipeline, built from `loss`.

An `Objective` is (loss of one micro-batch given counts over the whole mini-batch, those counts,
the rows that must stay together in a micro-batch). The Trainer knows no objective by name: the
policy gradient (DAPO / GRPO), language modelling (SFT) and the RLHF objectives are values of
this one type. Forward functions for the passes that only read the model (π_old, the reference)
live here too, next to the objective whose inputs they compute.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from dapo_jax import loss as loss_lib
from dapo_jax.datatypes import LMBatch, RLBatch
from dapo_jax.model import transformer as model_lib
from dapo_jax.model import vision as vision_lib
from dapo_jax.model.packed_attention import Segments


@dataclasses.dataclass(frozen=True)
class Objective:
  """loss(params, micro_batch, counts) -> (scalar loss, metrics); counts(batch) -> global
  denominators of a mini-batch; `group_size` consecutive rows are never split (0 or 1: any).
  `entropy_control`: a coefficient the train state carries and each update adjusts (`EntropyControl`)."""
  loss: Callable
  counts: Callable
  group_size: int = 1
  entropy_control: "EntropyControl | None" = None


@dataclasses.dataclass(frozen=True)
class EntropyControl:
  """Adaptive entropy control (Skywork-OR1, arXiv 2505.22312; TRL's `use_adaptive_entropy`): the
  entropy bonus's coefficient lives in the train state and moves after every optimizer update by
  `delta`, up while the update's mean per-token entropy (over its loss tokens) is at or below `target`,
  down otherwise, within [coef_min, coef_max]; an update applies the coefficient only when the
  previous update's entropy was at or below `target` (the first applies none)."""
  target: float
  delta: float
  coef_min: float
  coef_max: float
  initial: float

  def init(self) -> dict:
    return {"entropy_coef": jnp.asarray(self.initial, jnp.float32), "last_entropy": jnp.asarray(jnp.inf, jnp.float32)}

  def applied(self, controls: dict) -> jax.Array:
    """The coefficient an update applies."""
    return jnp.where(controls["last_entropy"] <= self.target, controls["entropy_coef"], 0.0)

  def update(self, controls: dict, entropy: jax.Array) -> dict:
    up = entropy <= self.target
    coef = jnp.where(up, jnp.minimum(controls["entropy_coef"] + self.delta, self.coef_max),
                     jnp.maximum(controls["entropy_coef"] - self.delta, self.coef_min))
    return {"entropy_coef": coef.astype(jnp.float32), "last_entropy": jnp.asarray(entropy, jnp.float32)}


@dataclasses.dataclass(frozen=True)
class RolloutCorrection:
  """`dapo.rollout_correction`: verl's algorithm.rollout_correction fields ("" = verl's null).

  rollout_is / rollout_is_threshold / rollout_is_batch_normalize / rollout_rs / rollout_rs_threshold:
  `loss.rollout_correction`'s options, between π_old and the sampler's log-probs. bypass_mode: π_old
  is the sampler's log-probs (verl's bypass mode; the correction then reads the current policy), with
  loss_type "ppo_clip" (the ratio to the sampler is clipped; no weights) or "reinforce" (-A·log π·w).
  """
  rollout_is: str = ""
  rollout_is_threshold: str = "2.0"   # a number (TIS) or "lower_upper" (IcePop)
  rollout_is_batch_normalize: bool = False
  rollout_rs: str = ""
  rollout_rs_threshold: str = ""
  bypass_mode: bool = False
  loss_type: str = "ppo_clip"

  def __post_init__(self):
    if self.loss_type not in ("ppo_clip", "reinforce"):
      raise ValueError(f"dapo.rollout_correction.loss_type={self.loss_type!r}: expected 'ppo_clip' or 'reinforce'")
    try:  # Every option string is parsed at start, so a bad one names its field there.
      loss_lib.check_rollout_correction(**self.options())
      self.mismatch_threshold()
    except ValueError as e:
      raise ValueError(f"dapo.rollout_correction: {e}") from None

  @property
  def active(self) -> bool:
    return bool(self.rollout_is or self.rollout_rs)

  def options(self) -> dict:
    """Keyword arguments of `loss.rollout_correction`."""
    return dict(rollout_is=self.rollout_is or None, rollout_is_threshold=self.rollout_is_threshold,
                rollout_is_batch_normalize=self.rollout_is_batch_normalize, rollout_rs=self.rollout_rs or None,
                rollout_rs_threshold=self.rollout_rs_threshold or None)

  def mismatch_threshold(self) -> float:
    """The ratio bound the always-logged mismatch metrics count against (rollout_is_threshold's upper)."""
    return loss_lib.threshold_bounds(self.rollout_is_threshold, "rollout_is_threshold")[0]


@dataclasses.dataclass(frozen=True)
class PGConfig:
  """Static settings of the policy-gradient objective."""
  eps_low: float = 0.2
  eps_high: float = 0.28
  clip_ratio_c: float | None = 10.0         # dual clip for A < 0; None = off
  loss_agg: str = "token_mean"
  policy_loss: str = "vanilla"              # loss.POLICY_LOSSES (verl's registry names)
  # The modes' knobs, verl's names and defaults (loss.policy_loss); dro_beta 0 = unset.
  tau_pos: float = 1.0
  tau_neg: float = 1.05
  clip_cov_ratio: float = 0.0002
  clip_cov_lb: float = 1.0
  clip_cov_ub: float = 5.0
  kl_cov_ratio: float = 0.0002
  ppo_kl_coef: float = 0.1
  dro_beta: float = 0.0
  rollout_correction: RolloutCorrection = RolloutCorrection()
  norm_len: int = 0                         # C of the *_token_sum_norm aggregations: the completion
                                            # budget (rollout.max_new_tokens), never a length bucket's
                                            # width; 0 = each micro-batch's padded length
  verl_microbatch_weighting: bool = False   # per-micro-batch token mean weighted by its share of rows
  temperature: float = 1.0                  # rollout temperature; log-probs use scaled logits
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  entropy_coeff: float = 0.0                # verl's actor.entropy_coeff: minus this x the entropy, aggregated
                                            # as the loss is (0 = off: the entropy is a metric only)
  # Adaptive entropy control (`EntropyControl`, TRL's names): entropy_coeff is then the initial coefficient.
  use_adaptive_entropy: bool = False
  entropy_target: float = 0.2               # mean per-token entropy (nats) the controller holds the policy above
  entropy_coef_delta: float = 0.005         # the coefficient's step per update
  entropy_coef_min: float = 0.0
  entropy_coef_max: float = 1.0
  old_is_current: bool = False              # π_old = π_θ (one update per rollout step): ratio is 1
                                            # (rows flagged in `behaviour_B` keep their old_logp_BC)
  group_size: int = 0                       # >0: rows come in groups of G sharing one prompt, which
                                            # then runs through the model once per group

  def __post_init__(self):
    if self.policy_loss not in loss_lib.POLICY_LOSSES:
      raise ValueError(f"dapo.policy_loss={self.policy_loss!r}: expected one of {loss_lib.POLICY_LOSSES}")
    if self.policy_loss == "dro" and self.dro_beta <= 0:
      raise ValueError(f"dapo.dro_beta={self.dro_beta}: policy_loss='dro' needs dro_beta > 0")
    if self.tau_pos <= 0 or self.tau_neg <= 0:
      raise ValueError(f"dapo.tau_pos={self.tau_pos}, dapo.tau_neg={self.tau_neg}: expected > 0")
    for name in ("clip_cov_ratio", "kl_cov_ratio"):
      if not 0 < getattr(self, name) <= 1:
        raise ValueError(f"dapo.{name}={getattr(self, name)}: expected in (0, 1]")

  def entropy_control(self) -> EntropyControl | None:
    if not self.use_adaptive_entropy:
      return None
    return EntropyControl(target=self.entropy_target, delta=self.entropy_coef_delta, coef_min=self.entropy_coef_min,
                          coef_max=self.entropy_coef_max, initial=self.entropy_coeff)

  def loss_knobs(self) -> dict:
    """The mode knobs of `loss.policy_loss`."""
    return dict(tau_pos=self.tau_pos, tau_neg=self.tau_neg, clip_cov_ratio=self.clip_cov_ratio,
                clip_cov_lb=self.clip_cov_lb, clip_cov_ub=self.clip_cov_ub, kl_cov_ratio=self.kl_cov_ratio,
                ppo_kl_coef=self.ppo_kl_coef, dro_beta=self.dro_beta or None)


# `dapo.<knob>` fields that go to PGConfig as they are.
PG_KNOBS = ("tau_pos", "tau_neg", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef",
            "dro_beta")


def mismatch(train_logp_BC, rollout_logp_BC, mask_BC, threshold: float, num_tokens=None) -> dict:
  """The sampler-vs-trainer mismatch, always logged: KL(π_rollout || π_train) as k1 and k3, and the
  fractions of tokens whose ratio π_train/π_rollout a `threshold` (and 1/threshold) would clip.
  Token means over the loss tokens (micro-batches sum to the mini-batch's)."""
  log_r = jnp.clip(jax.lax.stop_gradient(train_logp_BC) - rollout_logp_BC, -20.0, 20.0)
  mean = lambda x: loss_lib.masked_mean(x.astype(jnp.float32), mask_BC, num_tokens)
  return {"mismatch/k1": mean(-log_r), "mismatch/k3": mean(jnp.expm1(log_r) - log_r),
          "mismatch/ratio_frac_high": mean(log_r > math.log(threshold)),
          "mismatch/ratio_frac_low": mean(log_r < -math.log(threshold))}


def completion_logits(model_cfg: model_lib.ModelConfig, group_size: int, params, mb: RLBatch,
                      with_router: bool = False, emit_experts: bool = False) -> jax.Array:
  """Logits [B, C, V] predicting each completion token of a batch of RL rows (`with_router`: and
  the routing statistics of an MoE model, `model.routing`)."""
  C = mb.loss_mask_BC.shape[1]
  P = mb.tokens_BT.shape[1] - C
  if group_size:
    return _shared_prompt_outputs(model_cfg, group_size, params, mb, P, "lm", with_router, emit_experts)
  # Logits at position P-1+t predict completion token t.
  return model_lib.logits(model_cfg, params, mb.tokens_BT[:, :-1], mb.mask_BT[:, :-1], logits_from=P - 1,
                          with_router=with_router, images_BMD=_images(mb, 1, model_cfg, params),
                          emit_experts=emit_experts, **_row_routes(model_cfg, mb, P))


def _replay(model_cfg: model_lib.ModelConfig) -> bool:
  return model_cfg.router_replay in ("R2", "R3")


def _row_routes(model_cfg: model_lib.ModelConfig, mb, P: int) -> dict:
  """Routing replay's arguments of a forward over rows [prompt | completion] less their last token: the
  completion tokens' recorded experts (the prompt's: none, it routes as the sampler's prefill did)."""
  routes_BCLk = getattr(mb, "routes_BCLk", None)
  if routes_BCLk is None:
    return {}
  B, _, L, k = routes_BCLk.shape
  routes_BTLk = jnp.concatenate([jnp.full((B, P, L, k), -1, jnp.int32), routes_BCLk[:, :-1]], axis=1)
  return dict(routes_BTLk=routes_BTLk, replay=_replay(model_cfg))


def _segment_routes(model_cfg: model_lib.ModelConfig, mb) -> dict:
  routes_BCLk = getattr(mb, "routes_BCLk", None)
  return {} if routes_BCLk is None else dict(routes_BCLk=routes_BCLk, replay=_replay(model_cfg))


def _images(mb, group_size: int = 1, model_cfg: model_lib.ModelConfig | None = None, params=None):
  """A batch's image vectors, one row per group with `group_size`: with pixels (`RLBatch.pixels_BICSS`: the
  tower trains), those of `params`' own tower, run here (each pass, π_old's and the reference's too, sees
  its own tower); else `RLBatch.images_BMD`; None: no images."""
  pixels = getattr(mb, "pixels_BICSS", None)
  if pixels is not None and params is not None:
    grids = getattr(mb, "grids_BI2", None)
    return vision_lib.image_features(model_cfg.vision, vision_lib.tower_params(params), pixels[::group_size],
                                     None if grids is None else grids[::group_size])
  images = getattr(mb, "images_BMD", None)
  return None if images is None else images[::group_size]


def _shared_prompt_outputs(model_cfg: model_lib.ModelConfig, group_size: int, params, mb, P: int, head: str,
                           with_router: bool, emit_experts: bool = False):
  """The `head` outputs predicting each completion token when each group's prompt runs once, and
  an RLBatch in the shared-prefix layout runs its common prefix once too (other batches, e.g. DPO's
  preference pairs, have no such layout)."""
  completion = (mb.tokens_BT[:, P:], mb.mask_BT[:, P:])
  if getattr(mb, "prefix_len", 0):
    return model_lib.completion_logits_after_prefix(model_cfg, params, *_prefix_and_rest(mb, group_size, P),
                                                    *completion, head=head, with_router=with_router,
                                                    emit_experts=emit_experts, **_segment_routes(model_cfg, mb))
  return model_lib.completion_logits(model_cfg, params, mb.tokens_BT[::group_size, :P], mb.mask_BT[::group_size, :P],
                                     *completion, head=head, with_router=with_router, emit_experts=emit_experts,
                                     images_QMD=_images(mb, group_size, model_cfg, params),
                                     **_segment_routes(model_cfg, mb))


def _prefix_and_rest(mb: RLBatch, group_size: int, P: int):
  """(the prefix every prompt begins with [1, N], the prompts' rest [Q, W] and its mask) of a batch
  in the shared-prefix layout (`RLBatch.prefix_len`). Prompts are left-padded, so prompt q's rest is
  its last L_q - N columns, real where its whole-prompt mask is real N columns further left."""
  N, W = mb.prefix_len, mb.suffix_len
  prompt_QP, mask_QP = mb.tokens_BT[::group_size, :P], mb.mask_BT[::group_size, :P]
  start = P - jnp.sum(mask_QP[0], dtype=jnp.int32)  # Prompt 0's first real token.
  prefix_1N = jax.lax.dynamic_slice_in_dim(prompt_QP[0], start, N)[None]
  return prefix_1N, prompt_QP[:, P - W:], mask_QP[:, P - W - N:P - N]


def _completion_hidden(model_cfg: model_lib.ModelConfig, group_size: int, params, mb: RLBatch,
                       with_router: bool = False):
  """`completion_logits`' final hidden states [B, C, D] (head "hidden"), before the unembedding."""
  C = mb.loss_mask_BC.shape[1]
  P = mb.tokens_BT.shape[1] - C
  if group_size:
    return _shared_prompt_outputs(model_cfg, group_size, params, mb, P, "hidden", with_router)
  tokens_BT, mask_BT = mb.tokens_BT[:, :-1], mb.mask_BT[:, :-1]
  return model_lib.forward(model_cfg, params, tokens_BT, model_lib.positions(mask_BT),
                           model_lib.attention_mask(model_cfg, tokens_BT, mask_BT), logits_from=P - 1, head="hidden",
                           with_router=with_router, images_BMD=_images(mb, 1, model_cfg, params),
                           **_row_routes(model_cfg, mb, P))


def completion_stats(model_cfg: model_lib.ModelConfig, group_size: int, params, mb: RLBatch, temperature: float,
                     with_router: bool = False, entropy_grad: bool = False, spread: str = "entropy"):
  """(log π of each completion token [B, C], the entropy of its temperature-scaled distribution
  [B, C] (differentiable with `entropy_grad`, else not; `spread="sum_pi_squared"`: Σ_v π_v² instead,
  which the optimal token baseline reads), the routing statistics or None). With
  `model.logits_chunk` the logits are made `logits_chunk` positions at a time and remade in the
  backward pass (`jax.checkpoint`), so at most B x logits_chunk x V of them exist at once; the values
  are those of the whole tensor."""
  if getattr(mb, "packed", None) is not None:
    return _packed_stats(model_cfg, params, mb, temperature, with_router, entropy_grad, spread)
  P = mb.tokens_BT.shape[1] - mb.loss_mask_BC.shape[1]
  targets_BC = mb.tokens_BT[:, P:]
  if not model_cfg.logits_chunk:
    out = completion_logits(model_cfg, group_size, params, mb, with_router=with_router)
    z_BCV, routing = out if with_router else (out, None)
    return (*_logprobs_and_entropy(z_BCV / temperature, targets_BC, entropy_grad, spread), routing)
  out = _completion_hidden(model_cfg, group_size, params, mb, with_router=with_router)
  x_BCD, routing = out if with_router else (out, None)
  return (*_chunked_stats(model_cfg, params, x_BCD, targets_BC, temperature, entropy_grad, spread), routing)


def _logprobs_and_entropy(z_BCV, targets_BC, entropy_grad: bool = False, spread: str = "entropy"):
  z_for_entropy = z_BCV if entropy_grad else jax.lax.stop_gradient(z_BCV)
  if spread == "sum_pi_squared":
    return loss_lib.token_logprobs(z_BCV, targets_BC), loss_lib.sum_pi_squared(z_for_entropy)
  return loss_lib.token_logprobs(z_BCV, targets_BC), loss_lib.entropy(z_for_entropy)


def _packed_stats(model_cfg: model_lib.ModelConfig, params, mb: RLBatch, temperature: float, with_router: bool,
                  entropy_grad: bool = False, spread: str = "entropy"):
  """`completion_stats` of a packed micro-batch (`datatypes.PackedRows`): the model runs on the packed
  sequences, each scored token takes the final hidden state of the position that predicts it, and the
  lm head runs on those alone (a prompt's positions and a row's padding make no logits); the results
  go to their [B, C] places, the padded layout's."""
  pk = mb.packed
  replay = {} if pk.routes_MTLk is None else dict(routes_BTLk=pk.routes_MTLk, replay=_replay(model_cfg))
  out = model_lib.forward(model_cfg, params, pk.tokens_MT, rope_positions(pk), Segments.of(pk), head="hidden",
                          with_router=with_router, images_BMD=packed_images(mb, model_cfg, params), **replay)
  h_MTD, routing = out if with_router else (out, None)
  x_SKD = _at_scored(pk, h_MTD)
  targets_SK = pk.target_K.reshape(pk.shards, -1)
  if model_cfg.logits_chunk:
    logp_SK, entropy_SK = _chunked_stats(model_cfg, params, x_SKD, targets_SK, temperature, entropy_grad, spread)
  else:
    z_SKV = model_lib.unembed(model_cfg, params, x_SKD)
    logp_SK, entropy_SK = _logprobs_and_entropy(z_SKV / temperature, targets_SK, entropy_grad, spread)
  shape = mb.loss_mask_BC.shape
  return _to_rows(pk, logp_SK, shape), _to_rows(pk, entropy_SK, shape), routing


def rope_positions(pk):
  """What a packed micro-batch's tokens rotate by: their rows' positions, or their M-RoPE positions [M, T, 3]."""
  return pk.positions_MT if pk.mrope_MT3 is None else pk.mrope_MT3


def packed_images(mb, model_cfg: model_lib.ModelConfig | None = None, params=None):
  """A packed micro-batch's image vectors per sequence, [M, N, D], the n-th for its n-th placeholder
  (`PackedRows.image_source_MN`, gathered within each shard); its rows' vectors as `_images` gives them;
  None: no images."""
  pk = mb.packed
  if pk.image_source_MN is None:
    return None
  rows_BMD = _images(mb, 1, model_cfg, params)
  vectors = rows_BMD.reshape(pk.shards, -1, rows_BMD.shape[-1])
  source = pk.image_source_MN.reshape(pk.shards, -1)
  return jnp.take_along_axis(vectors, source[..., None], axis=1).reshape(*pk.image_source_MN.shape, -1)


def _at_scored(pk, y_MT):
  """[shards, K, ...]: `y_MT` [M, T, ...] at each scored token's source, each shard's sequences end to end."""
  y = y_MT.reshape(pk.shards, -1, *y_MT.shape[2:])
  idx = pk.source_K.reshape(pk.shards, -1)
  return jnp.take_along_axis(y, idx.reshape(idx.shape + (1,) * (y.ndim - 2)), axis=1)


def _to_rows(pk, y_SK, shape_BC):
  """Scored tokens' values [shards, K] in their [B, C] places (0 elsewhere)."""
  B, C = shape_BC
  return jnp.zeros((B * C,), y_SK.dtype).at[pk.place_K].set(y_SK.reshape(-1), mode="drop").reshape(B, C)


def _chunked_stats(model_cfg: model_lib.ModelConfig, params, x_BCD, targets_BC, temperature: float,
                   entropy_grad: bool = False, spread: str = "entropy"):
  """Log-probs and entropies [B, C] of the lm head on final hidden states [B, C, D], `model.logits_chunk`
  positions at a time, each chunk's logits remade in the backward pass."""
  chunk = model_cfg.logits_chunk
  B, C, D = x_BCD.shape
  n = -(-C // chunk)
  pad = n * chunk - C  # The last chunk is padded; its extra positions are dropped.
  x_NBcD = jnp.pad(x_BCD, ((0, 0), (0, pad), (0, 0))).reshape(B, n, chunk, D).swapaxes(0, 1)
  t_NBc = jnp.pad(targets_BC, ((0, 0), (0, pad))).reshape(B, n, chunk).swapaxes(0, 1)

  @jax.checkpoint
  def one(args):
    x_BcD, t_Bc = args
    return _logprobs_and_entropy(model_lib.unembed(model_cfg, params, x_BcD) / temperature, t_Bc, entropy_grad,
                                 spread)

  logp_NBc, ent_NBc = jax.lax.map(one, (x_NBcD, t_NBc))
  unchunk = lambda y_NBc: y_NBc.swapaxes(0, 1).reshape(B, n * chunk)[:, :C]
  return unchunk(logp_NBc), unchunk(ent_NBc)


def completion_logprobs(model_cfg: model_lib.ModelConfig, temperature: float, group_size: int = 0) -> Callable:
  """(params, batch) -> log π(completion token) [B, C] fp32, from temperature-scaled logits."""
  def fn(params, mb: RLBatch) -> jax.Array:
    return completion_stats(model_cfg, group_size, params, mb, temperature)[0]
  return fn


def completion_logprobs_and_experts(model_cfg: model_lib.ModelConfig, temperature: float,
                                    group_size: int = 0) -> Callable:
  """(params, batch) -> (log π(completion token) [B, C] fp32, the experts each completion token went
  to in every expert layer [B, C, L_moe, k] int32, -1 for the last column, which no forward feeds):
  the π_old pass of routing replay R2."""
  def fn(params, mb: RLBatch):
    if getattr(mb, "packed", None) is not None:
      return _packed_logprobs_and_experts(model_cfg, temperature, params, mb)
    if model_cfg.logits_chunk:
      raise ValueError("model.router_replay='R2' records π_old's experts from whole logits: model.logits_chunk=0")
    C = mb.loss_mask_BC.shape[1]
    P = mb.tokens_BT.shape[1] - C
    z_BCV, routing = completion_logits(model_cfg, group_size, params, mb, with_router=True, emit_experts=True)
    experts = routing["experts"]
    if isinstance(experts, tuple):  # Segments: the completions' are the last.
      experts_BCLk = experts[-1]
    else:  # Rows less their last token: completion token c at column P + c.
      experts_BCLk = jnp.pad(experts[:, P:], ((0, 0), (0, 1), (0, 0), (0, 0)), constant_values=-1)
    last_BC = jnp.arange(C)[None, :] == C - 1
    experts_BCLk = jnp.where(last_BC[:, :, None, None], -1, experts_BCLk)
    return loss_lib.token_logprobs(z_BCV / temperature, mb.tokens_BT[:, P:]), experts_BCLk
  return fn


def _packed_logprobs_and_experts(model_cfg: model_lib.ModelConfig, temperature: float, params, mb: RLBatch):
  """The R2 pass over a packed micro-batch: (log π [B, C], each completion token's experts [B, C, L_moe, k]
  as `completion_logprobs_and_experts` gives them, and the same records at their packed positions
  [M, T, L_moe, k], -1 at every other token, for the updates to replay: `PackedRows.routes_MTLk`)."""
  pk = mb.packed
  h_MTD, routing = model_lib.forward(model_cfg, params, pk.tokens_MT, rope_positions(pk), Segments.of(pk),
                                     head="hidden", with_router=True, emit_experts=True,
                                     images_BMD=packed_images(mb, model_cfg, params))
  z_SKV = model_lib.unembed(model_cfg, params, _at_scored(pk, h_MTD))
  logp_SK = loss_lib.token_logprobs(z_SKV / temperature, pk.target_K.reshape(pk.shards, -1))
  # Completion token c sits right after the position that predicts it, in the same run, where it is fed
  # (a row's last column is not: the next position then begins another run).
  M, T = pk.tokens_MT.shape
  at = pk.source_K.reshape(pk.shards, -1) + 1
  ids = [x.reshape(pk.shards, -1) for x in (pk.segments_MT, pk.prompts_MT, pk.branches_MT, pk.positions_MT)]
  nxt = lambda x: jnp.take_along_axis(jnp.pad(x, ((0, 0), (0, 1))), at, axis=1)
  now = lambda x: jnp.take_along_axis(x, at - 1, axis=1)
  B, C = mb.loss_mask_BC.shape
  fed_SK = (pk.place_K.reshape(pk.shards, -1) < B * C) & (nxt(ids[0]) > 0) & (nxt(ids[3]) == now(ids[3]) + 1)
  for x in ids[:3]:
    fed_SK &= nxt(x) == now(x)
  experts_SNLk = routing["experts"].reshape(pk.shards, M // pk.shards * T, *routing["experts"].shape[2:])
  experts_SNLk = jnp.pad(experts_SNLk, ((0, 0), (0, 1), (0, 0), (0, 0)), constant_values=-1)
  experts_SKLk = jnp.where(fed_SK[..., None, None], jnp.take_along_axis(experts_SNLk, at[..., None, None], axis=1), -1)
  L, k = experts_SKLk.shape[2:]
  experts_BCLk = jnp.full((B * C, L, k), -1, jnp.int32).at[pk.place_K].set(
      experts_SKLk.reshape(-1, L, k), mode="drop").reshape(B, C, L, k)
  records_SNLk = jax.vmap(lambda r, i, e: r.at[i].set(e, mode="drop"))(
      jnp.full_like(experts_SNLk, -1), jnp.where(fed_SK, at, experts_SNLk.shape[1]), experts_SKLk)
  routes_MTLk = records_SNLk[:, :-1].reshape(M, T, L, k)
  return _to_rows(pk, logp_SK, (B, C)), experts_BCLk, routes_MTLk


def completion_logprobs_and_sum_pi_squared(model_cfg: model_lib.ModelConfig, temperature: float,
                                           group_size: int = 0) -> Callable:
  """(params, batch) -> [B, C, 2] fp32: log π(completion token) and Σ_v π_v² of its distribution, what
  the optimal token baseline reads (`advantages.optimal_token_baseline`)."""
  def fn(params, mb: RLBatch):
    return jnp.stack(completion_stats(model_cfg, group_size, params, mb, temperature, spread="sum_pi_squared")[:2], -1)
  return fn


def num_rows(batch: RLBatch) -> jax.Array:
  """The batch's rows (a packed micro-batch's row slots that hold one)."""
  if batch.packed is not None:
    return jnp.sum(batch.packed.row_B.astype(jnp.float32))
  return jnp.asarray(batch.adv_B.shape[0], jnp.float32)


def policy_gradient(model_cfg: model_lib.ModelConfig, cfg: PGConfig) -> Objective:
  """The clipped policy-gradient loss (verl's compute_policy_loss; paper Eq. 10) with a global token mean
  over micro-batches."""
  def counts(batch: RLBatch) -> dict:
    return {"num_tokens": jnp.sum(batch.loss_mask_BC.astype(jnp.float32)),
            "num_seqs": loss_lib.num_seqs_with_tokens(batch.loss_mask_BC),
            "num_rows": num_rows(batch)}

  def loss(params, mb: RLBatch, counts: dict):
    bonus = bool(cfg.entropy_coeff) or cfg.use_adaptive_entropy
    logp_BC, entropy_BC, routing = completion_stats(model_cfg, cfg.group_size, params, mb, cfg.temperature,
                                                    with_router=bool(model_cfg.moe), entropy_grad=bonus)
    old_logp_BC = mb.old_logp_BC
    if cfg.old_is_current:  # π_old = π_θ, except on rows an earlier policy sampled (carried groups).
      current_BC = jax.lax.stop_gradient(logp_BC)
      old_logp_BC = (current_BC if mb.behaviour_B is None
                     else jnp.where(mb.behaviour_B[:, None], mb.old_logp_BC, current_BC))
    if cfg.verl_microbatch_weighting:
      # verl: token mean inside the micro-batch, weighted by its share of the mini-batch's rows. The
      # rows counted are those with loss tokens: a short step's padding repeats (empty masks) are
      # not rows of verl's batch.
      denoms = dict(num_tokens=None, num_seqs=None)
      weight = loss_lib.num_seqs_with_tokens(mb.loss_mask_BC) / jnp.maximum(counts["num_seqs"], 1.0)
    else:
      denoms = dict(num_tokens=counts["num_tokens"], num_seqs=counts["num_seqs"])
      weight = 1.0
    mask_BC, is_weights_BC, mode, extra = mb.loss_mask_BC, None, cfg.policy_loss, {}
    if mb.rollout_logp_BC is not None:
      rc = cfg.rollout_correction
      # verl's bypass mode: π_old is the sampler; the correction compares it with the current policy.
      train_BC = jax.lax.stop_gradient(logp_BC) if rc.bypass_mode else old_logp_BC
      extra = mismatch(train_BC, mb.rollout_logp_BC, mask_BC, rc.mismatch_threshold(), denoms["num_tokens"])
      if rc.bypass_mode:
        old_logp_BC = mb.rollout_logp_BC
        mode = "reinforce" if rc.loss_type == "reinforce" else mode
      if rc.active:
        # Weights and rejections are per token or per response, so per micro-batch they are the
        # batch's; batch normalisation and the correction's metrics are this micro-batch's,
        # weighted by its share of the loss tokens. The denominators stay those of the unrejected
        # tokens, as in verl's bypass mode.
        w_BC, mask_BC, rc_metrics = loss_lib.rollout_correction(train_BC, mb.rollout_logp_BC, mask_BC,
                                                                **rc.options())
        is_weights_BC = None if (rc.bypass_mode and rc.loss_type == "ppo_clip") else w_BC
        share = jnp.sum(mb.loss_mask_BC.astype(jnp.float32)) / jnp.maximum(counts["num_tokens"], 1.0)
        extra.update({k: v * share for k, v in rc_metrics.items()})
    value, metrics = loss_lib.policy_loss(
        logp_BC, old_logp_BC, mb.adv_B, mask_BC, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
        clip_ratio_c=cfg.clip_ratio_c, agg=cfg.loss_agg, ref_logp_BC=mb.ref_logp_BC, kl_coef=cfg.kl_coef,
        kl_estimator=cfg.kl_estimator, adv_BC=mb.adv_BC, norm_len=cfg.norm_len or None, mode=mode,
        is_weights_BC=is_weights_BC, **cfg.loss_knobs(), **denoms)
    if bonus:  # verl: policy_loss = pg_loss - entropy_coeff x agg_loss(entropy, mask, loss_agg_mode).
      entropy_loss = loss_lib.aggregate(entropy_BC, mb.loss_mask_BC, cfg.loss_agg, norm_len=cfg.norm_len or None,
                                        **denoms)
      value = value - counts.get("entropy_coef", cfg.entropy_coeff) * entropy_loss
      extra["entropy_loss"] = entropy_loss
    metrics = jax.tree.map(lambda m: m * weight, dict(metrics, **extra))
    metrics["entropy"] = loss_lib.masked_mean(entropy_BC, mb.loss_mask_BC, denoms["num_tokens"]) * weight
    value = value * weight
    if model_cfg.moe:  # This micro-batch's load-balancing loss and router metrics, by its share of rows.
      share = num_rows(mb) / counts["num_rows"]
      aux, router_metrics = loss_lib.router_aux_loss(routing)
      if model_cfg.router_aux_coef:
        value = value + model_cfg.router_aux_coef * aux * share
      metrics.update(jax.tree.map(lambda m: m * share, router_metrics))
    return value, metrics

  return Objective(loss=loss, counts=counts, group_size=cfg.group_size, entropy_control=cfg.entropy_control())


def language_model(model_cfg: model_lib.ModelConfig) -> Objective:
  """Next-token cross-entropy on `loss_mask_BT[:, 1:]`, token mean over the whole mini-batch."""
  def counts(batch: LMBatch) -> dict:
    return {"num_tokens": jnp.sum(batch.loss_mask_BT[:, 1:].astype(jnp.float32))}

  def loss(params, mb: LMBatch, counts: dict):
    images = _images(mb, 1, model_cfg, params)  # With pixels the tower trains: its vectors, in the loss.
    logits_BTV = model_lib.logits(model_cfg, params, mb.tokens_BT[:, :-1], mb.mask_BT[:, :-1], images_BMD=images)
    logp_BT = loss_lib.token_logprobs(logits_BTV, mb.tokens_BT[:, 1:])
    mask = mb.loss_mask_BT[:, 1:]
    nll = -loss_lib.masked_mean(logp_BT, mask, counts["num_tokens"])
    correct = (jnp.argmax(logits_BTV, -1) == mb.tokens_BT[:, 1:]).astype(jnp.float32)
    return nll, {"lm_loss": nll, "token_acc": loss_lib.masked_mean(correct, mask, counts["num_tokens"])}

  return Objective(loss=loss, counts=counts, group_size=1)
