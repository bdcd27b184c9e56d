"""Log-probs in the layouts of the OpenAI API as vLLM serves it: completions' (tokens, token_logprobs,
top_logprobs dicts, text_offset) and chat's (content entries with their top_logprobs), from a sample's
own log-probs or from a teacher-forced `scoring.Scores` of prompt + answer."""
from __future__ import annotations

import numpy as np

from dapo_jax.serve import scoring
from dapo_jax.serve.sample_text import SampleText

FLOOR = -9999.0  # vLLM's floor for a log-prob (-inf is not JSON).


def _value(x) -> float:
  return max(float(x), FLOOR)


def _piece(tok, t) -> str:
  return tok.decode([int(t)], skip_special_tokens=False)


def completion_sampled(s: SampleText) -> dict:
  """`logprobs=0` without echo: the sampled tokens' own log-probs, as the sampler recorded them."""
  pairs = s.token_logprobs()
  offsets = np.cumsum([0] + [len(t) for t, _ in pairs])[:-1].tolist()
  return {"tokens": [t for t, _ in pairs], "token_logprobs": [lp for _, lp in pairs],
          "top_logprobs": None, "text_offset": offsets}


def completion_scored(tok, prompt: list[int], answer: list[int], scores: scoring.Scores, top: int,
                      echo: bool) -> dict:
  """vLLM's completion log-probs of the answer (and with `echo` the prompt before it, its first token
  null): each token's log-prob and a dict of it and the `top` likeliest tokens at its position."""
  start = 0 if echo else len(prompt)
  ids = (prompt + answer)[start:]
  tokens = [_piece(tok, t) for t in ids]
  token_logprobs, tops = [], []
  for j, _ in enumerate(ids, start):
    if j == 0:
      token_logprobs.append(None)
      tops.append(None)
      continue
    alternatives = {tokens[j - start]: _value(scores.logp[j])}
    for lp, alt in zip(scores.top_logp[j][:top], scores.top_ids[j][:top]):
      key = _piece(tok, alt)
      alternatives[key] = max(alternatives.get(key, -float("inf")), _value(lp))
    token_logprobs.append(_value(scores.logp[j]))
    tops.append(alternatives)
  offsets = np.cumsum([0] + [len(t) for t in tokens])[:-1].tolist()
  return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_sampled(pairs) -> dict:
  """Chat's `logprobs` of (token text, log-prob) pairs, without alternatives."""
  return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                      for t, lp in pairs]}


def chat_scored(tok, pairs, prompt_len: int, scores: scoring.Scores, top: int, start: int = 0) -> dict:
  """`top_logprobs` > 0: each answer token's log-prob and its position's `top` likeliest, from a
  teacher-forced pass (the model's own distribution, as completions' `logprobs=N`), for the answer's
  (token text, log-prob) `pairs` from token `start` on."""
  entry = lambda t, lp: {"token": t, "logprob": _value(lp), "bytes": list(t.encode())}
  content = []
  for k, (t, _) in enumerate(pairs):
    if k < start:
      continue
    j = prompt_len + k
    alternatives = [entry(_piece(tok, i), lp) for lp, i in zip(scores.top_logp[j][:top], scores.top_ids[j][:top])]
    content.append(dict(entry(t, scores.logp[j]), top_logprobs=alternatives))
  return {"content": content}
