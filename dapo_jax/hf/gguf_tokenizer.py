"""A GGUF's SentencePiece vocabulary (`tokenizer.ggml.model = "llama"`, as Gemma's) -> a `transformers`
fast tokenizer: a BPE with byte fallback, spaces spelt "▁", and merges rebuilt from the vocabulary.

A GGUF stores no merges for a SentencePiece vocabulary, only the pieces in rank order. Every split of a
piece into two pieces of the vocabulary is a merge, ranked by the piece it makes (earlier in the file:
merged first); this is how SentencePiece's BPE ranks its merges and what llama.cpp's tokenizer runs.
Pieces of whitespace alone are stored with real spaces and get their "▁" spelling back. Control tokens
(llama.cpp type 3) are special tokens and user-defined ones (type 4) are added tokens, both matched
whole. A base model's file has no chat template; Gemma's (text turns) is supplied for `gemma3`.
"""
from __future__ import annotations

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

# Gemma 3's chat template (google/gemma-3-*-it, text turns): a system message prefixes the first user turn.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")
CHAT_TEMPLATES = {"gemma3": GEMMA3_CHAT_TEMPLATE}


def spm_merges(tokens: list[str]) -> list[tuple[str, str]]:
  """Every (left, right) split of a piece into two pieces, ordered by the merged piece's rank, then by
  the ids of its parts."""
  vocab = {t: i for i, t in enumerate(tokens)}
  merges = []
  for rank, piece in enumerate(tokens):
    local = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
    local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
    merges += [(rank, len(l), len(r), l, r) for l, r in local]
  merges.sort(key=lambda m: m[:3])  # Stable: ties keep the id order above.
  return [(l, r) for _, _, _, l, r in merges]


def sentencepiece_tokenizer(tokens: list[str], types: list[int], *, bos: str | None, eos: str | None,
                            unk: str | None, pad: str | None, add_bos: bool = True, chat_template: str | None = None):
  """A `transformers.PreTrainedTokenizerFast` of a SentencePiece vocabulary given as GGUF metadata."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

  from dapo_jax.data import tokenizer as tokenizer_lib
  tokenizer_lib.quiet_transformers()
  from transformers import PreTrainedTokenizerFast
  tokens = ["▁" * len(t) if t and not t.strip(" ") else t for t in tokens]  # "  " -> "▁▁"
  tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=spm_merges(tokens),
                             unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None))
  tok.normalizer = normalizers.Replace(" ", "▁")
  tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
  tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
  if add_bos and bos is not None:
    bos_id = tokens.index(bos)
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, bos_id)])
  tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                          for t, ty in zip(tokens, types) if ty == _CONTROL])
  tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
  hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token=unk,
                                   pad_token=pad, clean_up_tokenization_spaces=False, padding_side="left")
  if chat_template:
    hf_tok.chat_template = chat_template
  return hf_tok
