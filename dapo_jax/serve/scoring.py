"""Teacher-forced scoring for the OpenAI API: each token's log-prob under the model and the likeliest
alternatives at each position, as vLLM returns them for `echo` and `logprobs=N`.

The log-probs are the model's own distribution (temperature 1, the whole vocabulary: vLLM's default
`logprobs_mode`, what log-likelihood evaluations such as lm-evaluation-harness's read), and a token's
value and its alternatives come from the same array, so "the token is the argmax" is an equality.
Rows are left-padded to a power of two of positions and batched to a power of two of rows: a server
compiles few shapes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dapo_jax.model import transformer as model_lib

TOP = 20  # alternatives computed at each position (a request takes its first N)


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def score_rows(cfg: model_lib.ModelConfig, params, tokens_BT, mask_BT, top: int, chunk: int):
  """Left-padded rows [B, T] -> (logp_BT: log p(token t+1 | tokens up to t) at position t (0 at the
  last), top_logp_BTK and top_ids_BTK: the K = `top` likeliest next tokens at each position, in
  descending order). fp32 log-softmax of the logits, made `chunk` positions at a time."""
  x_BTD = model_lib.forward(cfg, params, tokens_BT, model_lib.positions(mask_BT), model_lib.causal_mask(mask_BT),
                            head="hidden")
  next_BT = jnp.concatenate([tokens_BT[:, 1:], jnp.zeros_like(tokens_BT[:, :1])], axis=1)
  B, T, D = x_BTD.shape
  n = -(-T // chunk)
  pad = n * chunk - T
  x_NBcD = jnp.pad(x_BTD, ((0, 0), (0, pad), (0, 0))).reshape(B, n, chunk, D).swapaxes(0, 1)
  t_NBc = jnp.pad(next_BT, ((0, 0), (0, pad))).reshape(B, n, chunk).swapaxes(0, 1)

  def one(args):
    x_BcD, t_Bc = args
    logp_BcV = jax.nn.log_softmax(model_lib.unembed(cfg, params, x_BcD).astype(jnp.float32), axis=-1)
    chosen_Bc = jnp.take_along_axis(logp_BcV, t_Bc[..., None], axis=-1)[..., 0]
    top_logp_BcK, top_ids_BcK = jax.lax.top_k(logp_BcV, top)
    return chosen_Bc, top_logp_BcK, top_ids_BcK

  chosen, top_logp, top_ids = jax.lax.map(one, (x_NBcD, t_NBc))
  unchunk = lambda y: y.swapaxes(0, 1).reshape(B, n * chunk, *y.shape[3:])[:, :T]
  return unchunk(chosen), unchunk(top_logp), unchunk(top_ids)


@dataclasses.dataclass(frozen=True)
class Scores:
  """One row's scores: `logp[j]` = log p(token j | tokens before it) for j >= 1 (logp[0] is NaN: the
  first token has no context), `top_logp[j]` / `top_ids[j]` the likeliest alternatives at token j
  (row j = len(row): those of the token after the row)."""
  logp: np.ndarray        # [n] fp32
  top_logp: np.ndarray    # [n + 1, K] fp32
  top_ids: np.ndarray     # [n + 1, K] int32


class Scorer:
  """Scores token rows of up to `max_len` tokens with `params`, at most `max_tokens` positions a call."""

  def __init__(self, model_cfg: model_lib.ModelConfig, max_len: int, *, mesh=None, max_tokens: int = 8192,
               chunk: int = 128, smallest: int = 32):
    self.cfg, self.max_len, self.max_tokens, self.chunk, self.mesh = model_cfg, max_len, max_tokens, chunk, mesh
    self.top = min(TOP, model_cfg.vocab_size)
    self.lengths = [smallest << i for i in range(max(max_len - 1, 1).bit_length()) if smallest << i < max_len]
    self.lengths.append(max_len)

  def __call__(self, params, rows: list[list[int]]) -> list[Scores]:
    out: list[Scores | None] = [None] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    while order:  # Shortest first: a batch's rows share its longest row's length bucket.
      T = next(t for t in self.lengths if t >= len(rows[order[0]]))
      fits = [i for i in order if len(rows[i]) <= T][:max(self.max_tokens // T, 1)]
      B = 1 << max(len(fits) - 1, 0).bit_length()
      tokens, mask = np.zeros((B, T), np.int32), np.zeros((B, T), bool)
      mask[:, -1] = True  # Padding rows hold one token (no row is all padding).
      for r, i in enumerate(fits):
        n = len(rows[i])
        tokens[r, T - n:], mask[r, T - n:] = rows[i], True
      # An MoE model's expert dispatch reads the mesh (as the rollout's forward does).
      with jax.set_mesh(self.mesh) if self.mesh is not None and self.cfg.moe else contextlib.nullcontext():
        out_B = score_rows(self.cfg, params, tokens, mask, self.top, self.chunk)
      chosen, top_logp, top_ids = jax.device_get(out_B)
      for r, i in enumerate(fits):
        n = len(rows[i])
        logp = np.concatenate([[np.nan], chosen[r, T - n:T - 1]]).astype(np.float32)
        # Position T - n - 1 + j predicts token j, and the last one (T - 1) the token after the row.
        out[i] = Scores(logp=logp, top_logp=np.concatenate([np.full((1, self.top), np.nan, np.float32),
                                                            top_logp[r, T - n:]]),
                        top_ids=np.concatenate([np.zeros((1, self.top), np.int32), top_ids[r, T - n:]]))
      done = set(fits)
      order = [i for i in order if i not in done]
    return out
