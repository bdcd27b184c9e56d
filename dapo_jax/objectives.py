"""What a `train_step.Trainer` optimises: one function per pipeline, built from `loss`.

An `Objective` is (loss of one micro-batch given counts over the whole mini-batch, those counts,
the rows that must stay together in a micro-batch). The Trainer knows no objective by name: the
policy gradient (DAPO / GRPO), language modelling (SFT) and the RLHF objectives are values of
this one type. Forward functions for the passes that only read the model (π_old, the reference)
live here too, next to the objective whose inputs they compute.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from dapo_jax import loss as loss_lib
from dapo_jax import model as model_lib
from dapo_jax.datatypes import LMBatch, RLBatch


@dataclasses.dataclass(frozen=True)
class Objective:
  """loss(params, micro_batch, counts) -> (scalar loss, metrics); counts(batch) -> global
  denominators of a mini-batch; `group_size` consecutive rows are never split (0 or 1: any)."""
  loss: Callable
  counts: Callable
  group_size: int = 1


@dataclasses.dataclass(frozen=True)
class PGConfig:
  """Static settings of the policy-gradient objective."""
  eps_low: float = 0.2
  eps_high: float = 0.28
  clip_ratio_c: float | None = 10.0         # dual clip for A < 0; None = off
  loss_agg: str = "token_mean"
  verl_microbatch_weighting: bool = False   # per-micro-batch token mean weighted by its share of rows
  temperature: float = 1.0                  # rollout temperature; log-probs use scaled logits
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  old_is_current: bool = False              # π_old = π_θ (one update per rollout step): ratio is 1
  group_size: int = 0                       # >0: rows come in groups of G sharing one prompt, which
                                            # then runs through the model once per group


def completion_logits(model_cfg: model_lib.ModelConfig, group_size: int, params, mb: RLBatch) -> jax.Array:
  """Logits [B, C, V] predicting each completion token of a batch of RL rows."""
  C = mb.loss_mask_BC.shape[1]
  P = mb.tokens_BT.shape[1] - C
  if group_size:
    return model_lib.completion_logits(model_cfg, params, mb.tokens_BT[::group_size, :P],
                                       mb.mask_BT[::group_size, :P], mb.tokens_BT[:, P:], mb.mask_BT[:, P:])
  # Logits at position P-1+t predict completion token t.
  return model_lib.logits(model_cfg, params, mb.tokens_BT[:, :-1], mb.mask_BT[:, :-1], logits_from=P - 1)


def completion_logprobs(model_cfg: model_lib.ModelConfig, temperature: float, group_size: int = 0) -> Callable:
  """(params, batch) -> log π(completion token) [B, C] fp32, from temperature-scaled logits."""
  def fn(params, mb: RLBatch) -> jax.Array:
    P = mb.tokens_BT.shape[1] - mb.loss_mask_BC.shape[1]
    z_BCV = completion_logits(model_cfg, group_size, params, mb) / temperature
    return loss_lib.token_logprobs(z_BCV, mb.tokens_BT[:, P:])
  return fn


def policy_gradient(model_cfg: model_lib.ModelConfig, cfg: PGConfig) -> Objective:
  """The clipped policy-gradient loss (DAPO_SPEC §1.3) with a global token mean over micro-batches."""
  def counts(batch: RLBatch) -> dict:
    return {"num_tokens": jnp.sum(batch.loss_mask_BC.astype(jnp.float32)),
            "num_seqs": loss_lib.num_seqs_with_tokens(batch.loss_mask_BC),
            "num_rows": jnp.asarray(batch.adv_B.shape[0], jnp.float32)}

  def loss(params, mb: RLBatch, counts: dict):
    P = mb.tokens_BT.shape[1] - mb.loss_mask_BC.shape[1]
    z_BCV = completion_logits(model_cfg, cfg.group_size, params, mb) / cfg.temperature
    logp_BC = loss_lib.token_logprobs(z_BCV, mb.tokens_BT[:, P:])
    old_logp_BC = jax.lax.stop_gradient(logp_BC) if cfg.old_is_current else mb.old_logp_BC
    if cfg.verl_microbatch_weighting:
      # verl: token mean inside the micro-batch, weighted by its share of the mini-batch's rows.
      denoms = dict(num_tokens=None, num_seqs=None)
      weight = mb.adv_B.shape[0] / counts["num_rows"]
    else:
      denoms = dict(num_tokens=counts["num_tokens"], num_seqs=counts["num_seqs"])
      weight = 1.0
    value, metrics = loss_lib.policy_loss(
        logp_BC, old_logp_BC, mb.adv_B, mb.loss_mask_BC, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
        clip_ratio_c=cfg.clip_ratio_c, agg=cfg.loss_agg, ref_logp_BC=mb.ref_logp_BC, kl_coef=cfg.kl_coef,
        kl_estimator=cfg.kl_estimator, **denoms)
    metrics = jax.tree.map(lambda m: m * weight, metrics)
    metrics["entropy"] = loss_lib.masked_mean(loss_lib.entropy(jax.lax.stop_gradient(z_BCV)),
                                              mb.loss_mask_BC, denoms["num_tokens"]) * weight
    return value * weight, metrics

  return Objective(loss=loss, counts=counts, group_size=cfg.group_size)


def language_model(model_cfg: model_lib.ModelConfig) -> Objective:
  """Next-token cross-entropy on `loss_mask_BT[:, 1:]`, token mean over the whole mini-batch."""
  def counts(batch: LMBatch) -> dict:
    return {"num_tokens": jnp.sum(batch.loss_mask_BT[:, 1:].astype(jnp.float32))}

  def loss(params, mb: LMBatch, counts: dict):
    logits_BTV = model_lib.logits(model_cfg, params, mb.tokens_BT[:, :-1], mb.mask_BT[:, :-1])
    logp_BT = loss_lib.token_logprobs(logits_BTV, mb.tokens_BT[:, 1:])
    mask = mb.loss_mask_BT[:, 1:]
    nll = -loss_lib.masked_mean(logp_BT, mask, counts["num_tokens"])
    correct = (jnp.argmax(logits_BTV, -1) == mb.tokens_BT[:, 1:]).astype(jnp.float32)
    return nll, {"lm_loss": nll, "token_acc": loss_lib.masked_mean(correct, mask, counts["num_tokens"])}

  return Objective(loss=loss, counts=counts, group_size=1)
