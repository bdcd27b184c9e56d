"""An observation's tokens, appended after the policy's turn: token-in/token-out.

The episode so far is never re-rendered or re-tokenised (the tokens the policy sampled stay exactly
as sampled); only the text the chat template puts after an assistant turn is rendered: the end of
that turn (past the end-of-turn token the policy itself emitted), the observation's messages in
their roles (a tool result in the template's tool role), and the header of the next assistant turn.
"""
from __future__ import annotations

from typing import Sequence

_MARK = "\u2063dapo-turn\u2063"  # Text no template changes, to find where the assistant turn's content ends.


def observation_text(tok, messages: Sequence[dict], *, ended_with: str | Sequence[str] = "", tools=None) -> str:
  """The template's text from the end of an assistant turn through the next assistant header.

  `ended_with` is the text of the token that ended the policy's turn (its EOS, e.g. "<|im_end|>"), or
  the texts of every token that ends a turn (the sampler's EOS ids): the policy already ended its
  turn, so the template's own end-of-turn is not appended when it is one of them (a turn ended on
  <|endoftext|> gets no second end-of-turn <|im_end|>). "" (a turn cut at its budget, or ended on a
  tool call's closing tag): the template's end-of-turn comes first."""
  convo = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}, *messages]
  kw = {"tools": tools} if tools else {}
  full = tok.apply_chat_template(convo, add_generation_prompt=True, tokenize=False, **kw)
  at = full.find(_MARK)
  if at < 0:
    raise ValueError("the chat template does not render an assistant message's content as given; "
                     "episodes need a template that does")
  rest = full[at + len(_MARK):]
  ends = (ended_with,) if isinstance(ended_with, str) else tuple(ended_with)
  end = max((e for e in ends if e and rest.startswith(e)), key=len, default="")
  return rest[len(end):]


def observation_tokens(tok, messages: Sequence[dict], *, ended_with: str | Sequence[str] = "",
                       tools=None) -> list[int]:
  return list(tok(observation_text(tok, messages, ended_with=ended_with, tools=tools),
                  add_special_tokens=False)["input_ids"])


def check_messages(observation) -> list[dict]:
  """An environment's observation as chat messages, or a ValueError saying what is wrong with it."""
  if not isinstance(observation, (list, tuple)) or not observation:
    raise ValueError(f"observation must be a non-empty list of messages, got {type(observation).__name__}")
  for m in observation:
    if isinstance(m, dict) and isinstance(m.get("content"), (list, tuple)):
      raise ValueError(f"observation message {m!r:.80} has content parts: observations carry text only "
                       "(an image in an observation is not supported; images enter through the prompt)")
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
      raise ValueError(f"observation message {m!r:.80} is not {{'role': str, 'content': str}}")
  return list(observation)
