"""A reward model as a reward: scoring (prompt, response) pairs on the accelerator, for the RM server
(`launch.serve_rm`, `scorer`) and `reward.fn=rm:DIR` (`RMReward`, in the training process).

    score_fn = rewards.model.scorer("runs/rm/rm_model")   # score_fn(prompts, responses) -> [float]
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.hf import convert as hf
from dapo_jax.model import transformer as model_lib


def _bucket(n: int, lo: int = 16) -> int:
  """The power of two >= n (at least lo): few compiled shapes."""
  return max(lo, 1 << max(n - 1, 0).bit_length())


class Scorer:
  """Scores (prompt, response) pairs with a reward model on the accelerator, in the calling process.

  A prompt is the user's message (rendered with the tokenizer's chat template when it has one, as
  in training); the response is followed by EOS, as `preference.pair_batch` writes it. Batches are
  padded to power-of-two shapes so few programs compile.
  """

  def __init__(self, model_dir: str, max_prompt_len: int = 512, max_response_len: int = 1024,
               batch_size: int = 64, chat_template: bool | None = None, dtype: str = "float32"):
    self.model_cfg, params = hf.load_scalar(model_dir, param_dtype=dtype, dtype=dtype)
    self.tok = tokenizer_lib.load(model_dir)
    tokenizer_lib.check_vocab(self.tok, self.model_cfg.vocab_size, f"{model_dir}/config.json")
    self.chat_template = bool(getattr(self.tok, "chat_template", None)) if chat_template is None else chat_template
    self.max_prompt_len, self.max_response_len, self.batch_size = max_prompt_len, max_response_len, batch_size
    self.params = jax.device_put(params)
    cfg = self.model_cfg
    self._score = jax.jit(lambda p, t, m: model_lib.last_token_scores(cfg, p, t, m))

  def encode(self, prompts: Sequence[str], responses: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """[left-padded prompt | response + EOS, right-padded] tokens and mask, bucketed lengths."""
    texts = [tokenizer_lib.render(self.tok, [{"role": "user", "content": p}], self.chat_template) for p in prompts]
    p_ids = tokenizer_lib.encode_prompts(self.tok, texts)
    r_ids = self.tok(list(responses), add_special_tokens=False)["input_ids"]
    p_ids = [row[-self.max_prompt_len:] for row in p_ids]
    r_ids = [(list(row) + [self.tok.eos_token_id])[: self.max_response_len] for row in r_ids]
    P = _bucket(max(len(r) for r in p_ids))
    C = _bucket(max(len(r) for r in r_ids))
    tokens = np.full((len(texts), P + C), self.tok.pad_token_id, np.int32)
    mask = np.zeros((len(texts), P + C), bool)
    for b, (p, r) in enumerate(zip(p_ids, r_ids)):
      tokens[b, P - len(p):P + len(r)] = list(p) + list(r)
      mask[b, P - len(p):P + len(r)] = True
    return tokens, mask

  def __call__(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
    if len(prompts) != len(responses):
      raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
    out: list[float] = []
    for i in range(0, len(responses), self.batch_size):
      tokens, mask = self.encode(prompts[i:i + self.batch_size], responses[i:i + self.batch_size])
      n = len(tokens)
      rows = min(_bucket(n, 1), self.batch_size) if n < self.batch_size else n
      pad = rows - n
      if pad:  # Pad the batch to a power of two with copies of its last row.
        tokens, mask = np.concatenate([tokens, np.repeat(tokens[-1:], pad, 0)]), np.concatenate(
            [mask, np.repeat(mask[-1:], pad, 0)])
      out += [float(s) for s in np.asarray(self._score(self.params, jnp.asarray(tokens), jnp.asarray(mask)))[:n]]
    return out


def scorer(model_dir: str) -> Callable[[Sequence[str], Sequence[str]], list[float]]:
  """The RM server's factory (`launch.serve_rm --scorer=dapo_jax.rewards.model:scorer`): score_fn(prompts, responses)."""
  if not model_dir:
    raise hf.CheckpointError("the reward-model scorer needs --model_dir (a directory written by launch.rm)")
  return Scorer(model_dir)


class RMReward:
  """`reward.fn=rm:DIR`: a reward model scoring rollouts in the training process, batched on the
  accelerator; the interface of `rewards.RewardPool` plus the prompts (`needs_prompts`).

  acc is score > acc_threshold; `errors` / `timeouts` stay 0 (a failing model is a bug, not a flaky
  service, and raises).
  """
  needs_prompts = True

  def __init__(self, model_dir: str, batch_size: int = 64, acc_threshold: float = 0.0, **scorer_kw):
    self.scorer = Scorer(model_dir, batch_size=batch_size, **scorer_kw)
    self.model_dir, self.acc_threshold = model_dir, acc_threshold
    self.errors = self.timeouts = 0
    self._warned = False

  def close(self) -> None:
    pass

  def __call__(self, responses: Sequence[str], ground_truths: Sequence[str],
               prompts: Sequence[str] | None = None) -> list[dict]:
    del ground_truths  # The model judges the response against the prompt alone.
    if prompts is None:
      if not self._warned:
        logging.warning("reward model %s is called without prompts; scoring responses alone", self.model_dir)
        self._warned = True
      prompts = [""] * len(responses)
    scores = self.scorer(list(prompts), list(responses))
    return [{"score": s, "acc": s > self.acc_threshold, "pred": f"{s:.4g}"} for s in scores]
