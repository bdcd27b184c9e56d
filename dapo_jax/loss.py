"""Policy-gradient losses: DAPO's decoupled clip with token-level aggregation, and the baselines.

DAPO has no KL term and needs no reference model; the KL penalty here exists only for the
GRPO-style baseline configs, and when it is off no reference forward pass runs at all.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def token_logprobs(logits_BTV: jax.Array, tokens_BT: jax.Array) -> jax.Array:
  """log softmax(logits)[token] per position, in fp32."""
  logits_BTV = logits_BTV.astype(jnp.float32)
  picked_BT = jnp.take_along_axis(logits_BTV, tokens_BT[..., None], axis=-1)[..., 0]
  return picked_BT - jax.nn.logsumexp(logits_BTV, axis=-1)
