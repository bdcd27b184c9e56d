"""SFT data on conversations: rows -> token ids with a loss mask -> packed rows with per-document attention.

Row schemas (jsonl or parquet, one conversation a row; TRL's names):
  {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
  {"prompt": str | messages, "completion": str | messages}
Packing puts several documents in one row of T tokens; `segment_ids_BT` (1, 2, ... per document,
0 = padding) keep attention inside a document and `positions_BT` restart at 0 for each, so a
packed row computes exactly what its documents would compute one by one. Host-side NumPy.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import numpy as np

from dapo_jax.data import prompts as data_lib
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.data.prompts import DataError


@dataclasses.dataclass(frozen=True)
class Conversation:
  messages: tuple[dict, ...]   # role/content turns; for prompt/completion rows the completion is the last
  index: int = 0               # row number in its file


@dataclasses.dataclass(frozen=True)
class Document:
  ids: np.ndarray        # int32 [n]
  loss_mask: np.ndarray  # bool [n]: tokens that are targets of the loss


@dataclasses.dataclass(frozen=True)
class PackedBatch:
  tokens_BT: np.ndarray       # int32
  loss_mask_BT: np.ndarray    # bool: tokens that are targets of the loss
  positions_BT: np.ndarray    # int32, 0 at each document's first token
  segment_ids_BT: np.ndarray  # int32, 1.. per document in a row, 0 = padding


# --- rows ---------------------------------------------------------------------------------------

def _messages(value, field: str, path: str, i: int, default_role: str, allow_str: bool = True) -> tuple[dict, ...]:
  if isinstance(value, str) and allow_str:
    return ({"role": default_role, "content": value},)
  if (isinstance(value, (list, tuple)) and value
      and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in value)):
    return tuple({"role": m.get("role") or default_role, "content": m["content"]} for m in value)
  raise DataError(f"{path}: row {i}: field {field!r} must be {'a string or ' if allow_str else ''}a non-empty list of "
                  f"{{'role', 'content'}} messages, got {type(value).__name__}")


def parse_row(row: dict, path: str, i: int) -> Conversation:
  """One SFT row in the messages or prompt/completion schema -> Conversation."""
  if not isinstance(row, dict):
    raise DataError(f"{path}: row {i}: expected an object, got {type(row).__name__}")
  if "messages" in row:
    msgs = _messages(row["messages"], "messages", path, i, "user", allow_str=False)
    if not any(m["role"] == "assistant" for m in msgs):
      raise DataError(f"{path}: row {i}: field 'messages' has no assistant turn to learn from")
    return Conversation(msgs, i)
  missing = [f for f in ("prompt", "completion") if row.get(f) is None]
  if missing:
    raise DataError(f"{path}: row {i}: no field 'messages' and no field {missing[0]!r} "
                    "(SFT rows need 'messages', or 'prompt' and 'completion')")
  prompt = _messages(row["prompt"], "prompt", path, i, "user")
  completion = _messages(row["completion"], "completion", path, i, "assistant")
  return Conversation(prompt + completion, i)


def load_conversations(path: str) -> list[Conversation]:
  """Every conversation of a jsonl/parquet file; a bad row fails naming the file and row."""
  rows = data_lib.read_rows(path)
  if not rows:
    raise DataError(f"dataset file {path!r} has no rows")
  return [parse_row(row, path, i) for i, row in enumerate(rows)]


def split_heldout(convs: Sequence[Conversation], fraction: float) -> tuple[list[Conversation], list[Conversation]]:
  """(train, held-out) by a hash of each conversation's turns before the first assistant reply, so a
  prompt never lands on both sides (`data.in_heldout`, the rule of the arithmetic task)."""
  train, held = [], []
  for c in convs:
    k = next((j for j, m in enumerate(c.messages) if m["role"] == "assistant"), len(c.messages))
    key = "\n".join(m["content"] for m in c.messages[:k])
    (held if data_lib.in_heldout(key, fraction) else train).append(c)
  return train, held


# --- tokens -------------------------------------------------------------------------------------

def _chat_prefix(tok, messages, generation_prompt: bool) -> str:
  if not messages:
    return ""
  return tok.apply_chat_template(list(messages), add_generation_prompt=generation_prompt, tokenize=False)


def encode(tok, conv: Conversation, chat_template: bool = True, assistant_only: bool = True,
           source: str = "") -> Document:
  """Token ids of one conversation and its loss mask (assistant turns only, or every token).

  With a chat template the text is the template's rendering of the whole chat, cut at turn
  boundaries: each assistant turn's content and end-of-turn marker are targets, its header
  ("<|im_start|>assistant\\n") and every other turn are context. Without one, turns are joined with
  newlines and each assistant turn ends with the EOS token. A template that rewrites earlier turns
  when later ones are added (so a prefix does not render as a prefix) fails naming the row.
  """
  msgs = conv.messages
  pieces: list[tuple[str, bool]] = []   # (text, is a target)
  if chat_template:
    if not getattr(tok, "chat_template", None):
      tokenizer_lib.render(tok, msgs, True, source)  # Raises the project's missing-template error.
    done = ""
    for k, m in enumerate(msgs):
      if m["role"] == "assistant":
        header = _chat_prefix(tok, msgs[:k], True) if k else ""
        steps = [(header, False), (_chat_prefix(tok, msgs[:k + 1], False), True)]
      else:
        steps = [(_chat_prefix(tok, msgs[:k + 1], False), False)]
      for text, target in steps:
        if not text.startswith(done):
          raise DataError(f"{source}: row {conv.index}: the chat template does not render turn {k} as an "
                          "extension of the turns before it; set data.chat_template=False for plain text")
        piece, done = text[len(done):], text
        if target:
          # Targets end with the turn's end-of-turn token; what the template adds after it (a newline)
          # is never generated, so it is context.
          end = piece.find(m["content"]) + len(m["content"]) if m["content"] in piece else len(piece)
          if tok.eos_token and piece[end:].startswith(tok.eos_token):
            end += len(tok.eos_token)
          pieces += [(piece[:end], True), (piece[end:], False)]
        else:
          pieces.append((piece, False))
  else:
    for k, m in enumerate(msgs):
      sep = "\n" if k else ""
      if m["role"] == "assistant":
        pieces += [(sep, False), (m["content"], True), (None, True)]  # None: the EOS token
      else:
        pieces.append((sep + m["content"], False))
  ids, mask = [], []
  for text, target in pieces:
    t = [tok.eos_token_id] if text is None else tok(text, add_special_tokens=False)["input_ids"] if text else []
    ids += t
    mask += [target] * len(t)
  bos = tokenizer_lib.bos_prefix(tok)  # A row begins a sequence: the tokenizer's BOS once, as context.
  if bos and ids[:len(bos)] != bos:
    ids, mask = bos + ids, [False] * len(bos) + mask
  loss_mask = np.asarray(mask, bool) if assistant_only else np.ones(len(ids), bool)
  return Document(np.asarray(ids, np.int32), loss_mask)


# --- packing ------------------------------------------------------------------------------------

def pack(docs: Sequence[Document], seq_len: int, pad_id: int = 0, num_rows: int | None = None) -> PackedBatch:
  """First-fit packing of whole documents into rows of `seq_len` tokens, in order of length.

  A document longer than `seq_len` is cut to its first `seq_len` tokens (counted in the log).
  num_rows: pad with empty rows (or fail if more are needed) to get a static batch size.
  """
  if seq_len < 2:
    raise ValueError(f"seq_len={seq_len} must be >= 2")
  rows: list[list[Document]] = []
  room: list[int] = []
  cut = 0
  order = sorted(range(len(docs)), key=lambda j: -len(docs[j].ids))
  for j in order:
    d = docs[j]
    if len(d.ids) > seq_len:
      cut += 1
      d = Document(d.ids[:seq_len], d.loss_mask[:seq_len])
    if not len(d.ids):
      continue
    for r, free in enumerate(room):
      if free >= len(d.ids):
        rows[r].append(d)
        room[r] -= len(d.ids)
        break
    else:
      rows.append([d])
      room.append(seq_len - len(d.ids))
  if cut:
    logging.warning("packing: %d of %d documents longer than %d tokens were truncated", cut, len(docs), seq_len)
  B = len(rows) if num_rows is None else num_rows
  if len(rows) > B:
    raise ValueError(f"{len(docs)} documents need {len(rows)} rows of {seq_len} tokens; num_rows={num_rows}")
  tokens = np.full((B, seq_len), pad_id, np.int32)
  loss_mask = np.zeros((B, seq_len), bool)
  positions = np.zeros((B, seq_len), np.int32)
  segments = np.zeros((B, seq_len), np.int32)
  for b, row in enumerate(rows):
    t = 0
    for s, d in enumerate(row, start=1):
      n = len(d.ids)
      tokens[b, t:t + n], loss_mask[b, t:t + n] = d.ids, d.loss_mask
      positions[b, t:t + n], segments[b, t:t + n] = np.arange(n), s
      t += n
  return PackedBatch(tokens, loss_mask, positions, segments)

