"""Tokenizers from local directories (no hub), chat templates, left-padded batches."""
from __future__ import annotations

import json
import logging
import os
from typing import Sequence

import numpy as np

from dapo_jax import errors
from dapo_jax.paths import outside


class TokenizerError(errors.UserError, ValueError):
  pass


class _NoTorchNotice(logging.Filter):
  """Drops the notice transformers logs on import when PyTorch is absent ("PyTorch was not found.
  Models won't be available..."; older versions: "None of PyTorch, TensorFlow ... have been
  found"): only its tokenizers and config utilities are used here, which need no torch. Every
  other transformers message passes."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "Models won't be available and only tokenizers" not in str(record.msg)


def quiet_transformers() -> None:
  """Installs the filter on the logger that notice is logged to; call before importing transformers."""
  logger = logging.getLogger("transformers")
  if not any(isinstance(f, _NoTorchNotice) for f in logger.filters):
    logger.addFilter(_NoTorchNotice())


quiet_transformers()  # Every transformers import of the library follows an import of this module.


def load(path: str):
  """`transformers.AutoTokenizer` from a local directory; never touches the network."""
  check_dir(path)
  from transformers import AutoTokenizer  # Slow import; keep it off the module import path.
  try:
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
  except Exception as e:  # transformers raises many types for malformed files.
    raise TokenizerError(f"tokenizer directory {path!r} cannot be loaded ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''})") from None
  if len(tok) < 2:
    raise TokenizerError(f"tokenizer directory {path!r} loads as {len(tok)} token(s); its vocabulary files "
                         "are empty or damaged")
  if tok.pad_token_id is None:
    tok.pad_token = tok.eos_token  # Padding is always masked; any id will do.
  return tok


# A directory holds a usable vocabulary when it has one of these sets of files.
VOCAB_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"), ("vocab.txt",))


# Files of a tokenizer directory that transformers may read; none may point outside the directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
                   "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json", "config.json")


def check_dir(path: str) -> None:
  """Fails naming the directory when it has no vocabulary files or a tokenizer.json that is not JSON,
  and naming the file and the path when one of its files, or a `*_file` field of its
  tokenizer_config.json, points outside it (an absolute path, '..', a symlink out)."""
  if not os.path.isdir(path):
    raise TokenizerError(f"tokenizer directory {path!r} does not exist")
  for fn in TOKENIZER_FILES:
    why = outside(path, fn)
    if why:
      raise TokenizerError(f"tokenizer directory {path!r}: {why}")
  if not any(all(os.path.isfile(os.path.join(path, f)) for f in files) for files in VOCAB_FILES):
    raise TokenizerError(f"tokenizer directory {path!r} has no vocabulary: expected tokenizer.json, "
                         "tokenizer.model, vocab.json with merges.txt, or vocab.txt")
  for fn in ("tokenizer.json", "tokenizer_config.json"):
    p = os.path.join(path, fn)
    if os.path.isfile(p):
      try:
        with open(p, encoding="utf-8") as f:
          content = json.load(f)
      except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{p}: not valid JSON ({e})") from None
      # transformers opens a `vocab_file`, `merges_file`, `tokenizer_file`... named here, wherever it is.
      for key, value in (content.items() if fn == "tokenizer_config.json" and isinstance(content, dict) else ()):
        if key.endswith("_file") and isinstance(value, str) and value:
          why = outside(path, value)
          if why or not os.path.exists(os.path.join(path, value)):
            raise TokenizerError(f"{p}: field {key!r} names {why or f'{value!r}, which is not in {path}'}")


def check_vocab(tok, vocab_size: int, model_source: str) -> None:
  """A tokenizer must not produce ids past the model's embedding rows."""
  if len(tok) > vocab_size:
    raise TokenizerError(f"tokenizer {tok.name_or_path!r} has {len(tok)} tokens, more than the {vocab_size} "
                         f"embedding rows of the model ({model_source}); use the model's own tokenizer")


def render(tok, messages: Sequence[dict], use_chat_template: bool = True, source: str = "", tools=None) -> str:
  """The text the model sees for one conversation, ending where the assistant starts."""
  if not use_chat_template:
    return "\n".join(m["content"] for m in messages)
  if not getattr(tok, "chat_template", None):
    raise TokenizerError(f"tokenizer {tok.name_or_path or source!r} has no chat template, but "
                         "data.chat_template=True; set --config.data.chat_template=False to use plain text")
  kw = {"tools": tools} if tools else {}  # JSON schemas the template renders (an environment's tools).
  return tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False, **kw)


def render_template(template: str, messages: Sequence[dict], tools=None) -> str:
  """A chat template rendered without a tokenizer (for the corpus a tokenizer is trained on)."""
  import jinja2  # noqa: PLC0415
  env = jinja2.Environment()
  env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
  return env.from_string(template).render(messages=list(messages), tools=tools, add_generation_prompt=True)


def bos_prefix(tok) -> list[int]:
  """The ids a tokenizer puts before any text of its own accord (its BOS, by `add_bos_token` or its
  post-processor, as `tok(text)` adds it); [] for a tokenizer that adds none (Qwen, GPT-2)."""
  probe = "a"
  plain = tok(probe, add_special_tokens=False)["input_ids"]
  full = tok(probe, add_special_tokens=True)["input_ids"]
  for i in range(len(full) - len(plain) + 1):
    if full[i:i + len(plain)] == plain:
      return list(full[:i])
  return []


def encode_prompts(tok, texts: Sequence[str]) -> list[list[int]]:
  """The ids of texts that begin a sequence (a prompt, plain or rendered by a chat template; a
  training row): the text's own tokens behind the tokenizer's BOS exactly once. A plain text gets the
  BOS `tok(text)` would add; a rendered template that already begins with it (Gemma's, Llama 3's)
  gets no second one; a tokenizer that adds none gets none. Continuations (a completion, an
  observation in an episode) are tokenised with `add_special_tokens=False` instead."""
  prefix = bos_prefix(tok)
  ids = tok(list(texts), add_special_tokens=False)["input_ids"]
  if not prefix:
    return [list(row) for row in ids]
  return [list(row) if list(row[:len(prefix)]) == prefix else prefix + list(row) for row in ids]


def encode_left_padded(tok, texts: Sequence[str], length: int) -> tuple[np.ndarray, np.ndarray]:
  """[B, length] ids and mask of prompts (`encode_prompts`: BOS once, by the tokenizer's rule),
  left-padded; over-long prompts keep their last `length` tokens."""
  ids = encode_prompts(tok, texts)
  tokens_BP = np.full((len(ids), length), tok.pad_token_id, np.int32)
  mask_BP = np.zeros((len(ids), length), bool)
  for b, row in enumerate(ids):
    row = row[-length:]
    if row:
      tokens_BP[b, length - len(row):] = row
      mask_BP[b, length - len(row):] = True
  return tokens_BP, mask_BP


def bucket(length: int, buckets: Sequence[int]) -> int:
  """Smallest bucket that holds `length` tokens (prompt lengths are padded to few sizes)."""
  for b in sorted(buckets):
    if length <= b:
      return b
  return max(buckets)


def decode(tok, tokens_BC: np.ndarray, mask_BC: np.ndarray) -> list[str]:
  """Completion texts with special tokens skipped (so a trailing EOS never reaches a scorer)."""
  return [tok.decode([int(t) for t, m in zip(row, mrow) if m], skip_special_tokens=True)
          for row, mrow in zip(np.asarray(tokens_BC), np.asarray(mask_BC))]


STOP_MODES = ("chat", "generation_config")
# End-of-turn tokens of the common chat templates (ChatML, Llama 3) and Qwen's end of document.
END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")


def generation_eos_ids(tok, model_dir: str) -> tuple[int, ...]:
  """The model's EOS ids as verl reads them (`GenerationConfig.from_pretrained`).

  generation_config.json's eos_token_id (int or list); without that file, config.json's; without
  either (or with no eos_token_id in it), the tokenizer's EOS.
  """
  for name in ("generation_config.json", "config.json"):
    path = os.path.join(model_dir, name) if model_dir else ""
    if not path or not os.path.exists(path):
      continue
    try:
      with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as e:
      raise TokenizerError(f"{path}: cannot read eos_token_id ({e})") from e
    if eos is None:
      break  # The file exists but names no EOS; verl's rollout then stops on the tokenizer's.
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
      raise TokenizerError(f"{path}: eos_token_id={eos!r}; expected an int or a list of ints")
    return tuple(dict.fromkeys(ids))
  return (tok.eos_token_id,) if tok.eos_token_id is not None else ()


def stop_ids(tok, model_dir: str, mode: str = "chat") -> tuple[int, ...]:
  """The ids that end a completion (`rollout.stop`); model_dir "" = the tokenizer's EOS alone.

  "generation_config": the model's EOS ids as verl stops and masks on them (`generation_eos_ids`);
  for a base model that can be <|endoftext|> alone. "chat": those plus the chat templates' end-of-turn
  tokens (END_OF_TURN) present in the vocabulary, so an instruct model stops where its turn ends.
  """
  if mode not in STOP_MODES:
    raise TokenizerError(f"rollout.stop={mode!r}; expected one of {STOP_MODES}")
  ids = list(generation_eos_ids(tok, model_dir))
  if mode == "chat":
    vocab = tok.get_vocab()
    ids += [vocab[t] for t in END_OF_TURN if t in vocab]
  return tuple(dict.fromkeys(ids))


def eos_ids(tok, extra: Sequence[int] = ()) -> tuple[int, ...]:
  """stop_ids(tok, "", "chat") and `extra`: the tokenizer's EOS and the end-of-turn tokens."""
  return tuple(dict.fromkeys((*stop_ids(tok, "", "chat"), *extra)))


SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# ChatML with tools, in the Qwen2.5 convention (envs.tool_formats "qwen"): the tools listed in a system
# turn, calls as <tool_call> JSON in the assistant's turn, results in <tool_response> in a user turn.
# Compact, for the small models trained here; without tools it renders as CHATML_TEMPLATE.
CHATML_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n"
    "{% for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}"
    "{{ f.name }}({{ f.parameters.properties.keys() | join(', ') }}): {{ f.description }}\n{% endfor %}"
    "Call a tool as <tool_call>\n{\"name\": ..., \"arguments\": {...}}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% if message.content %}{{ message.content }}\n{% endif %}"
    "{% for call in message.tool_calls %}{% set c = call.function if call.function is defined else call %}"
    "<tool_call>\n{\"name\": \"{{ c.name }}\", \"arguments\": "
    "{% if c.arguments is string %}{{ c.arguments }}{% else %}{{ c.arguments | tojson }}{% endif %}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen2's pre-tokenizer: digits are split one by one, which arithmetic needs.
_QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def train_bpe(path: str, texts: Sequence[str], vocab_size: int = 512, chat_template: bool | str = True,
              extra_special: Sequence[str] = ()):
  """Trains a byte-level BPE tokenizer on `texts` (offline) and saves it as a HF tokenizer dir;
  `extra_special`: more tokens it keeps whole (a vision model's image tokens)."""
  from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                special_tokens=list(SPECIAL_TOKENS) + list(extra_special),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(list(texts), trainer=trainer, length=len(texts))
  hf_tok = PreTrainedTokenizerFast(
      tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
      additional_special_tokens=["<|im_start|>", "<|endoftext|>", *extra_special], padding_side="left",
      clean_up_tokenization_spaces=False)
  if chat_template:  # True: CHATML_TEMPLATE; a string: that template.
    hf_tok.chat_template = chat_template if isinstance(chat_template, str) else CHATML_TEMPLATE
  os.makedirs(path, exist_ok=True)
  hf_tok.save_pretrained(path)
  return hf_tok
