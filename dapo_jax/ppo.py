"""The token-level estimators' part of a rollout step (REINFORCE++, and PPO with its value model).

After the rollout: the log-probs of the sampling policy and of the frozen reference, the KL-shaped
token rewards (`advantages.kl_shaped_rewards`, β from the KL controller), the value model's values
and GAE give per-token advantages and returns (`token_advantages`); the value model then trains on
the returns (`Critic.update`: epochs x mini-batches of the clipped value loss), beside the policy.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from dapo_jax import advantages as adv_lib
from dapo_jax import correction, sharding, train_step
from dapo_jax import metrics as metrics_lib
from dapo_jax.datatypes import Groups, RLBatch, ValueBatch


class Critic:
  """PPO's value model: a `train_step.Trainer` of `rlhf_objectives.value_model` (head="scalar", its own
  optimizer and learning rate, on the policy's mesh), its jitted values pass
  (`trainer.forward(rlhf_objectives.completion_values(...))`) and its train state."""

  def __init__(self, trainer: train_step.Trainer, values: Callable, params: Any):
    self.trainer, self._values = trainer, values
    self.state = trainer.init(params=params)

  def values(self, placed_batch) -> np.ndarray:
    """Values of a placed batch's completion tokens [B, C] (fp32, on the host)."""
    return sharding.fetch(self._values(self.state.params, placed_batch))

  def update(self, minibatches: list, epochs: int) -> dict:
    """Epochs x mini-batches of value-model updates (each a `ValueBatch`, or a list of micro-batches:
    packed ones); the mean metrics."""
    self.state, m = self.trainer.updates(self.state, [mb if isinstance(mb, list) else [mb] for mb in minibatches],
                                         epochs)
    return metrics_lib.mean_updates(sharding.fetch(m))


def token_advantages(batch: RLBatch, groups: Groups, *, estimator: str, logprobs: Callable, trainer, params,
                     ref_params, critic: Critic | None, kl_ctrl, Q: int, G: int, gamma: float,
                     lam: float, teacher=None, pack: Callable | None = None,
                     logprobs_sum_pi_squared: Callable | None = None,
                     logprobs_experts: Callable | None = None,
                     rollout_correction=None) -> tuple[RLBatch, ValueBatch | None, dict]:
  """Log-probs of the sampling policy and the reference, the KL-shaped token rewards, values (GAE),
  per-token advantages and returns of `batch` (Q groups of G rows). Returns the batch with its
  log-probs and `adv_BC` set, the value model's batch (None without one) and the step's metrics;
  updates the adaptive KL controller. "distill": `teacher` = (its log-prob function, its params).
  `pack` (`packing.packed_pass` with the run's budget): every pass runs on the rows packed.
  "optimal_token_baseline": `logprobs_sum_pi_squared` (`objectives.completion_logprobs_and_sum_pi_squared`)
  replaces `logprobs`, in the same one pass; with `rollout_correction` (`objectives.RolloutCorrection`)
  setting `rollout_is`, its importance weights between that pass and the sampler scale the baseline's
  path variance (verl's rollout_is_weights). Routing replay R2: `logprobs_experts`
  (`objectives.completion_logprobs_and_experts`) is the π_old pass, and the batch carries the experts
  it chose (`routes_BCLk`) for the updates to replay."""
  rows = batch.replace(behaviour_B=None)  # Forward passes read no flags.
  if pack is None:
    placed = trainer.put_batch(rows)
    run = lambda fn: jax.tree.map(np.asarray, sharding.fetch(fn(placed)))
  else:
    run = lambda fn: pack(fn, rows)
  sum_pi_sq_BC, routes_BCLk = None, None
  if estimator == "optimal_token_baseline":
    both_BC2 = run(lambda b: logprobs_sum_pi_squared(params, b))
    logp_BC, sum_pi_sq_BC = both_BC2[..., 0], both_BC2[..., 1]
  elif logprobs_experts is not None:  # A packed pass also gives the packed records: the update packs anew.
    logp_BC, routes_BCLk = run(lambda b: logprobs_experts(params, b)[:2])
  else:
    logp_BC = run(lambda b: logprobs(params, b))
  if logprobs_experts is not None and routes_BCLk is None:  # The optimal token baseline's pass has no experts.
    routes_BCLk = run(lambda b: logprobs_experts(params, b)[1])
  ref_BC = run(lambda b: logprobs(ref_params, b)) if ref_params is not None else logp_BC
  values_BC = run(critic.values) if critic is not None else None
  mask_BC = batch.loss_mask_BC
  # As `to_train_batch` completes a short step: groups repeated cyclically (their loss mask is empty).
  score_B = np.resize(groups.score_QG, (Q, G)).reshape(-1)
  beta = kl_ctrl.value if kl_ctrl is not None else 0.0
  teacher_BC = None
  if estimator == "distill":
    if teacher is None:
      raise ValueError("dapo.adv_estimator='distill' needs a teacher (dapo.teacher_dir)")
    teacher_logprobs, teacher_params = teacher
    teacher_BC = run(lambda b: teacher_logprobs(teacher_params, b))
  is_weights_BC = None
  rc = rollout_correction
  if sum_pi_sq_BC is not None and rc is not None and rc.rollout_is and batch.rollout_logp_BC is not None:
    weights_only = {k: v for k, v in rc.options().items() if k.startswith("rollout_is")}  # Rejection: the loss's.
    is_weights_BC, _, _ = correction.rollout_correction(logp_BC, batch.rollout_logp_BC, mask_BC, **weights_only)
  rewards_BC, adv_BC, returns_BC = sharding.fetch(adv_lib.token_advantages(
      estimator, score_B, logp_BC, ref_BC, mask_BC, values_BC, beta=np.float32(beta), gamma=gamma, lam=lam,
      teacher_logp_BC=teacher_BC, sum_pi_sq_BC=sum_pi_sq_BC, group_size=G, is_weights_BC=is_weights_BC))
  own_rows = groups.score_QG.size  # The rows after them repeat groups to fill a short step.
  kl = adv_lib.sequence_kl(logp_BC, ref_BC, mask_BC, num_rows=own_rows)
  metrics = metrics_lib.token_level(rewards_BC, returns_BC, values_BC, mask_BC, kl=kl, beta=beta)
  if teacher_BC is not None:  # What distillation minimises: the per-token reverse KL to the teacher (k1).
    n = max(float(mask_BC.sum()), 1.0)
    metrics["distill/reverse_kl"] = float(((logp_BC - teacher_BC) * mask_BC).sum() / n)
  if kl_ctrl is not None:
    kl_ctrl.update(kl, n_steps=own_rows)  # verl: n_steps = the batch size.
  # The ratio's π_old is the sampling policy's log-probs computed here (the update need not repeat
  # them); carried rows keep their sampling policy's log-probs.
  old_BC = logp_BC if batch.behaviour_B is None else np.where(batch.behaviour_B[:, None], batch.old_logp_BC, logp_BC)
  batch = batch.replace(old_logp_BC=old_BC, ref_logp_BC=ref_BC, adv_BC=np.asarray(adv_BC, np.float32))
  if routes_BCLk is not None:
    batch = batch.replace(routes_BCLk=routes_BCLk)
  value_batch = None
  if critic is not None:
    value_batch = ValueBatch(tokens_BT=batch.tokens_BT, mask_BT=batch.mask_BT, loss_mask_BC=mask_BC,
                             old_values_BC=values_BC, returns_BC=np.asarray(returns_BC, np.float32),
                             images_BMD=batch.images_BMD)
  return batch, value_batch, metrics
