"""AdamW with global-norm clipping; constant learning rate after a linear warm-up over rollout steps."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  lr: float = 1e-6             # peak learning rate
  warmup_steps: int = 10       # rollout steps of linear warm-up (the first rollout step trains at 0)
  weight_decay: float = 0.1    # decoupled (AdamW), applied to every parameter as torch does
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  grad_clip: float = 1.0       # global-norm clip; <= 0 disables


def lr_at(cfg: OptimConfig, rollout_step):
  """lr · min(1, s / max(1, warmup)) for 0-based rollout step s: stepped once per rollout step (§1.8)."""
  return cfg.lr * jnp.minimum(1.0, jnp.asarray(rollout_step, jnp.float32) / max(1, cfg.warmup_steps))


def make(cfg: OptimConfig, frozen: tuple[str, ...] = ()) -> optax.GradientTransformation:
  """The optimizer; its learning rate is a hyper-parameter that the train step sets per rollout step.
  The `frozen` subtrees of the params (a vision tower) never change and hold no optimizer state."""
  def chain(learning_rate):
    parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    parts.append(optax.adamw(learning_rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay))
    if not frozen:
      return optax.chain(*parts)
    label = lambda params: {k: "frozen" if k in frozen else "train" for k in params}  # A prefix of the tree.
    return optax.multi_transform({"train": optax.chain(*parts), "frozen": optax.set_to_zero()}, label)
  return optax.inject_hyperparams(chain)(learning_rate=cfg.lr)


def with_lr(opt_state, lr):
  hp = dict(opt_state.hyperparams)
  hp["learning_rate"] = jnp.asarray(lr, dtype=opt_state.hyperparams["learning_rate"].dtype)
  return opt_state._replace(hyperparams=hp)
