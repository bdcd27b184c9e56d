"""The RLHF pipelines' objectives, built like the policy gradient's (`objectives.Objective`): packed
SFT on conversations, the pairwise reward model, DPO / IPO / RPO, and PPO's value model; with the
forward functions that only read their models (reward scores, response log-probs, values)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from dapo_jax import loss as loss_lib
from dapo_jax.datatypes import PackedLMBatch, PreferenceBatch, ValueBatch
from dapo_jax.model import transformer as model_lib
from dapo_jax.model.packed_attention import Segments
from dapo_jax.objectives import (
  Objective,
  _at_scored,
  _images,
  _to_rows,
  completion_logits,
  packed_images,
  rope_positions,
)

# --- Packed SFT, the reward model, DPO ------------------------------------------------------------

def target_mask(loss_mask_BT, segment_ids_BT):
  """[B, T-1]: token t+1 is a target of the prediction at t (loss mask, same document, not padding).

  Keeps the last token of one document from being trained to predict the first of the next.
  """
  seg = segment_ids_BT
  return loss_mask_BT[:, 1:] & (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)


def _packed_logprobs(model_cfg: model_lib.ModelConfig, params, mb: PackedLMBatch):
  """(log p of each next token [B, T-1], its logits, the target mask [B, T-1]) of packed rows."""
  seg_BT = mb.segment_ids_BT
  logits_BTV = model_lib.forward(model_cfg, params, mb.tokens_BT[:, :-1], mb.positions_BT[:, :-1],
                                 model_lib.packed_attention_mask(seg_BT[:, :-1]))
  target_BT = target_mask(mb.loss_mask_BT, seg_BT)
  return loss_lib.token_logprobs(logits_BTV, mb.tokens_BT[:, 1:]), logits_BTV, target_BT


def packed_language_model(model_cfg: model_lib.ModelConfig) -> Objective:
  """Next-token cross-entropy on packed rows (`datatypes.PackedLMBatch`): attention and positions per
  document, targets only inside a document, token mean over the whole mini-batch. Equals
  `language_model` on the same documents one per row."""
  def counts(batch: PackedLMBatch) -> dict:
    return {"num_tokens": jnp.sum(target_mask(batch.loss_mask_BT, batch.segment_ids_BT)
                                  .astype(jnp.float32))}

  def loss(params, mb: PackedLMBatch, counts: dict):
    logp_BT, logits_BTV, mask = _packed_logprobs(model_cfg, params, mb)
    nll = -loss_lib.masked_mean(logp_BT, mask, counts["num_tokens"])
    correct = (jnp.argmax(logits_BTV, -1) == mb.tokens_BT[:, 1:]).astype(jnp.float32)
    return nll, {"lm_loss": nll, "token_acc": loss_lib.masked_mean(correct, mask, counts["num_tokens"])}

  return Objective(loss=loss, counts=counts, group_size=1)


def packed_nll(model_cfg: model_lib.ModelConfig) -> Callable:
  """(params, packed batch) -> [B, 2]: each row's summed target NLL and its number of targets (held-out loss)."""
  def fn(params, mb: PackedLMBatch) -> jax.Array:
    logp_BT, _, mask = _packed_logprobs(model_cfg, params, mb)
    m = mask.astype(jnp.float32)
    return jnp.stack([-jnp.sum(logp_BT * m, axis=1), jnp.sum(m, axis=1)], axis=1)
  return fn


def _pair_weight(mb: PreferenceBatch, counts: dict) -> jax.Array:
  """This micro-batch's share of the mini-batch's pairs: per-micro-batch means then add up to the mean."""
  return (mb.tokens_BT.shape[0] // 2) / counts["num_pairs"]


def _pair_counts(batch: PreferenceBatch) -> dict:
  return {"num_pairs": jnp.asarray(batch.tokens_BT.shape[0] // 2, jnp.float32)}


def reward_model(model_cfg: model_lib.ModelConfig, margin: float = 0.0) -> Objective:
  """The pairwise reward-model loss mean(-log σ(r_c - r_r - margin)) (`loss.pairwise_rm_loss`) on
  `PreferenceBatch` rows, r = the scalar head at the last real token; pairs stay in one micro-batch."""
  def loss(params, mb: PreferenceBatch, counts: dict):
    r_B = model_lib.last_token_scores(model_cfg, params, mb.tokens_BT, mb.mask_BT)
    margin_B = jnp.full(r_B[0::2].shape, margin, jnp.float32) if margin else None
    value, metrics = loss_lib.pairwise_rm_loss(r_B[0::2], r_B[1::2], margin_B)
    w = _pair_weight(mb, counts)
    return value * w, jax.tree.map(lambda m: m * w, metrics)

  return Objective(loss=loss, counts=_pair_counts, group_size=2)


def reward_scores(model_cfg: model_lib.ModelConfig) -> Callable:
  """(params, PreferenceBatch or any batch with tokens_BT / mask_BT) -> scores [B]."""
  return lambda params, mb: model_lib.last_token_scores(model_cfg, params, mb.tokens_BT, mb.mask_BT)


def response_logprobs(model_cfg: model_lib.ModelConfig, share_prompt: bool = True) -> Callable:
  """(params, PreferenceBatch) -> Σ log π(response token) [B] (fp32). With `share_prompt`, each
  pair's prompt runs through the model once (rows 2i and 2i+1 share it)."""
  def fn(params, mb: PreferenceBatch) -> jax.Array:
    P = mb.tokens_BT.shape[1] - mb.loss_mask_BC.shape[1]
    z_BCV = completion_logits(model_cfg, 2 if share_prompt else 0, params, mb)
    logp_BC = loss_lib.token_logprobs(z_BCV, mb.tokens_BT[:, P:])
    return jnp.sum(jnp.where(mb.loss_mask_BC, logp_BC, 0.0), axis=1)
  return fn


@dataclasses.dataclass(frozen=True)
class DPOConfig:
  """Static settings of the DPO objective (`loss.dpo_loss`)."""
  beta: float = 0.1
  loss_type: str = "sigmoid"      # sigmoid (DPO) | ipo (length-averaged log-probs, as TRL)
  label_smoothing: float = 0.0    # ε of the conservative DPO (sigmoid only)
  rpo_alpha: float = 0.0          # α of RPO's NLL term on the chosen responses (0 = plain DPO)
  share_prompt: bool = True       # a pair's prompt runs through the model once


def dpo(model_cfg: model_lib.ModelConfig, cfg: DPOConfig) -> Objective:
  """DPO / IPO on `PreferenceBatch` rows against the reference log-probs stored in the batch
  (`ref_logp_B`, sums over the response, computed once by the frozen reference).

  With `rpo_alpha` = α > 0, RPO (Pang et al. 2024; TRL's `rpo_alpha`): the loss adds α times the
  chosen responses' NLL, a token mean over the mini-batch's chosen tokens,
      L = mean_pairs(DPO) + α · (-Σ log π(y_c tokens) / #chosen tokens),
  which keeps the chosen answers' likelihood from falling with the rejected ones'.
  """
  logprobs = response_logprobs(model_cfg, cfg.share_prompt)

  def counts(batch: PreferenceBatch) -> dict:
    out = _pair_counts(batch)
    if cfg.rpo_alpha:
      out["num_chosen_tokens"] = jnp.sum(batch.loss_mask_BC[0::2].astype(jnp.float32))
    return out

  def loss(params, mb: PreferenceBatch, counts: dict):
    sum_B = logprobs(params, mb)
    logp_B, ref_B = sum_B, mb.ref_logp_B
    if cfg.loss_type == "ipo":  # IPO compares length-averaged log-probs.
      n_B = jnp.maximum(jnp.sum(mb.loss_mask_BC, axis=1), 1).astype(jnp.float32)
      logp_B, ref_B = logp_B / n_B, ref_B / n_B
    value, metrics = loss_lib.dpo_loss(logp_B[0::2], logp_B[1::2], ref_B[0::2], ref_B[1::2], cfg.beta,
                                       cfg.loss_type, cfg.label_smoothing)
    metrics = dict(metrics, dpo_loss=value, **{"logps/chosen": jnp.mean(logp_B[0::2]),
                                               "logps/rejected": jnp.mean(logp_B[1::2])})
    w = _pair_weight(mb, counts)
    value, metrics = value * w, jax.tree.map(lambda m: m * w, metrics)
    if cfg.rpo_alpha:  # Over the whole mini-batch's chosen tokens, so micro-batches add up to it.
      nll = -jnp.sum(sum_B[0::2]) / jnp.maximum(counts["num_chosen_tokens"], 1.0)
      value, metrics = value + cfg.rpo_alpha * nll, dict(metrics, nll_loss=nll)
    return value, metrics

  return Objective(loss=loss, counts=counts, group_size=2)


# --- PPO's critic ---------------------------------------------------------------------------------

def completion_values(model_cfg: model_lib.ModelConfig, group_size: int = 0) -> Callable:
  """(params of a scalar-head model, batch) -> V(s_t) [B, C] fp32: the value at the position that
  predicts completion token t (verl's critic reads values[:, P-1:T-1] the same way); a packed batch's
  values are read at its scored tokens' sources, as `completion_stats` reads log-probs. A
  vision-language policy's rows place their image vectors, as every pass that scores them does."""
  def fn(params, mb) -> jax.Array:
    if getattr(mb, "packed", None) is not None:
      pk = mb.packed
      values_MT = model_lib.forward(model_cfg, params, pk.tokens_MT, rope_positions(pk), Segments.of(pk), head="scalar",
                                    images_BMD=packed_images(mb))
      return _to_rows(pk, _at_scored(pk, values_MT), mb.loss_mask_BC.shape)
    C = mb.loss_mask_BC.shape[1]
    P = mb.tokens_BT.shape[1] - C
    if group_size:
      return model_lib.completion_logits(model_cfg, params, mb.tokens_BT[::group_size, :P],
                                         mb.mask_BT[::group_size, :P], mb.tokens_BT[:, P:], mb.mask_BT[:, P:],
                                         head="scalar", images_QMD=_images(mb, group_size))
    tokens_BT, mask_BT = mb.tokens_BT[:, :-1], mb.mask_BT[:, :-1]
    return model_lib.forward(model_cfg, params, tokens_BT, model_lib.positions(mask_BT),
                             model_lib.attention_mask(model_cfg, tokens_BT, mask_BT), logits_from=P - 1,
                             head="scalar", images_BMD=_images(mb))
  return fn


def value_model(model_cfg: model_lib.ModelConfig, clip_range: float, group_size: int = 0) -> Objective:
  """PPO's clipped value loss (`loss.value_loss`) on `ValueBatch` rows, token mean over the mini-batch."""
  values = completion_values(model_cfg, group_size)

  def counts(batch: ValueBatch) -> dict:
    return {"num_tokens": jnp.sum(batch.loss_mask_BC.astype(jnp.float32))}

  def loss(params, mb: ValueBatch, counts: dict):
    return loss_lib.value_loss(values(params, mb), mb.old_values_BC, mb.returns_BC, mb.loss_mask_BC, clip_range,
                               num_tokens=counts["num_tokens"])

  return Objective(loss=loss, counts=counts, group_size=group_size)

