"""One sample's text as its tokens arrive, for the OpenAI API: incremental decoding, stop strings,
what a stream may send yet, and the tokens (with their log-probs) the answer is made of."""
from __future__ import annotations

import numpy as np

from dapo_jax.serve import scheduler as scheduler_lib


class SampleText:
  """One sample's text as its tokens arrive: incremental decoding, stop strings, what may be sent."""

  def __init__(self, tok, stops: list[str], eos_ids: tuple[int, ...]):
    self.tok, self.stops, self.eos = tok, stops, set(eos_ids)
    self.tokens: np.ndarray = np.zeros(0, np.int32)
    self.logp: np.ndarray = np.zeros(0, np.float32)
    self.text, self.sent = "", 0
    self.finish: str | None = None
    self.cut_at: int | None = None     # the text ends at a stop string
    self.stop_len = 0                  # the length of the stop string found there
    self.reported = False              # a stream has sent its finish_reason

  def update(self, tokens: np.ndarray, logp: np.ndarray) -> bool:
    """Takes the tokens drawn so far; True when a stop string ended the sample."""
    if self.finish is not None:
      return False
    self.tokens, self.logp = tokens, logp
    self.text = self.tok.decode(self._content_tokens(), skip_special_tokens=True)
    hits = [(i, len(s)) for s, i in ((s, self.text.find(s)) for s in self.stops) if i >= 0]
    if hits:
      self.cut_at, self.stop_len = min(hits)
      self.text, self.finish = self.text[:self.cut_at], "stop"
      return True
    return False

  def end(self, ended: scheduler_lib.Ended) -> None:
    if self.update(ended.tokens, ended.logp) or self.finish is not None:
      return
    self.finish = "length" if ended.truncated else "stop"

  def answer_tokens(self) -> list[int]:
    """The tokens the answer is made of: up to a stop string, or all of them with their stop token."""
    if self.cut_at is None:
      return self.tokens.tolist()
    return self._content_tokens()[:len(self.token_logprobs())].tolist()

  def completion_tokens(self) -> int:
    """The tokens the sample generated, as vLLM counts them: up to the one that completes a stop string
    (those drawn while its cancel was on the way are not), or all of them, an EOS included."""
    if self.cut_at is None:
      return len(self.tokens)
    content = self._content_tokens()
    pieces = [self.tok.decode([int(t)], skip_special_tokens=False) for t in content]
    return self._tokens_before(content, pieces, self.cut_at + self.stop_len)

  def _content_tokens(self) -> np.ndarray:
    n = len(self.tokens)
    return self.tokens[:n - 1] if n and int(self.tokens[-1]) in self.eos else self.tokens

  def settled_text(self) -> str:
    """The text so far that no stop string can still claim (and no half-decoded character)."""
    end = len(self.text)
    if self.finish is None:
      end -= max((len(s) - 1 for s in self.stops), default=0)
      while end > 0 and self.text[end - 1] == "\ufffd":
        end -= 1
    return self.text[:max(end, 0)]

  def delta(self) -> str:
    """Text not yet sent that no stop string can still claim (and no half-decoded character)."""
    end = max(self.sent, len(self.settled_text()))
    out, self.sent = self.text[self.sent:end], end
    return out

  def _pieces(self, content: np.ndarray) -> list[str]:
    """Each content token's own text; the tokens only grow, so each is decoded once."""
    self._piece_cache = getattr(self, "_piece_cache", [])
    self._piece_cache += [self.tok.decode([int(t)], skip_special_tokens=False)
                          for t in content[len(self._piece_cache):]]
    return self._piece_cache[:len(content)]

  def token_logprobs(self, settled: bool = False) -> list[tuple[str, float]]:
    """(token text, log-prob) of the content's tokens (up to a stop string; the EOS left out); `settled`:
    only those whose text a stop string can no longer claim (what a stream may send)."""
    content = self._content_tokens()
    pieces = self._pieces(content)
    kept = len(content) if self.cut_at is None else self._tokens_before(content, pieces, self.cut_at)
    if settled and self.finish is None and len(settled_text := self.settled_text()) < len(self.text):
      kept = min(kept, self._tokens_before(content, pieces, len(settled_text) + 1) - 1)
    return [(pieces[i], float(self.logp[i])) for i in range(kept)]

  def _tokens_before(self, content: np.ndarray, pieces: list[str], cut_at: int) -> int:
    """How many tokens start before character `cut_at` of the text: the first k < len(content) whose
    prefix `content[:k]` decodes to `cut_at` characters or more, else len(content). The pieces'
    running length guesses k; a gallop from the guess, then a bisection, finds it with whole-prefix
    decodes (a prefix's text grows with k). The guess is right, two decodes, whenever each token
    decodes to whole characters: linear work, where testing every prefix was quadratic."""
    n, known = len(content), {}

    def reaches(k: int) -> bool:
      if k not in known:
        known[k] = k >= n or len(self.tok.decode(content[:k], skip_special_tokens=True)) >= cut_at
      return known[k]

    running = np.cumsum([0] + [len(p) for p in pieces])
    hi = min(int(np.searchsorted(running, cut_at)), n)
    step = 1
    if reaches(hi):
      while hi - step >= 0 and reaches(hi - step):
        hi, step = hi - step, step * 2
      lo = max(hi - step, -1)
    else:
      lo = hi
      while lo + step < n and not reaches(lo + step):
        lo, step = lo + step, step * 2
      hi = min(lo + step, n)
    while hi - lo > 1:  # reaches(lo) is false (or lo is -1), reaches(hi) true.
      mid = (lo + hi) // 2
      lo, hi = (lo, mid) if reaches(mid) else (mid, hi)
    return hi
