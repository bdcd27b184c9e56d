"""Tokenizers from a local directory: chat template, left padding, decoding, EOS ids."""
import os

import numpy as np
import pytest

from dapo_jax import testing
from dapo_jax.data import tokenizer


def test_chat_template_and_left_padding(tiny_tokenizer_dir):
  tok = tokenizer.load(tiny_tokenizer_dir)
  text = tokenizer.render(tok, [{"role": "user", "content": "What is 12 + 7?"}])
  assert text == "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n"
  ids = tok(text, add_special_tokens=False)["input_ids"]
  tokens, mask = tokenizer.encode_left_padded(tok, [text, "7"], 40)
  assert tokens.shape == (2, 40) and mask[0].sum() == len(ids) and mask[1].sum() == 1
  np.testing.assert_array_equal(tokens[0, 40 - len(ids):], ids)
  assert not mask[0, : 40 - len(ids)].any() and (tokens[0, : 40 - len(ids)] == tok.pad_token_id).all()
  # Over-long prompts keep their end (the question and the assistant header).
  short, smask = tokenizer.encode_left_padded(tok, [text], 5)
  np.testing.assert_array_equal(short[0], ids[-5:])
  assert smask.all()


def test_decode_skips_special_tokens_and_masked_positions(tiny_tokenizer_dir):
  tok = tokenizer.load(tiny_tokenizer_dir)
  ids = tok("Answer: 19", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
  tokens = np.array([ids + [tok.pad_token_id] * 3])
  mask = np.array([[True] * len(ids) + [False] * 3])
  assert tokenizer.decode(tok, tokens, mask) == ["Answer: 19"]
  im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
  assert set(tokenizer.eos_ids(tok)) == {im_end, eot}


def test_missing_chat_template_is_a_clear_error(tmp_path):
  testing.build_tokenizer(str(tmp_path), chat_template=False)
  tok = tokenizer.load(str(tmp_path))
  with pytest.raises(tokenizer.TokenizerError, match="has no chat template.*chat_template=False"):
    tokenizer.render(tok, [{"role": "user", "content": "hi"}])
  assert tokenizer.render(tok, [{"role": "user", "content": "hi"}], use_chat_template=False) == "hi"


def test_missing_directory():
  with pytest.raises(tokenizer.TokenizerError, match="does not exist"):
    tokenizer.load("/nonexistent/tokenizer")


def test_buckets():
  assert tokenizer.bucket(30, [64, 32, 128]) == 32
  assert tokenizer.bucket(33, [64, 32, 128]) == 64
  assert tokenizer.bucket(500, [64, 32, 128]) == 128


def model_dir_with(tmp_path, tok_dir, **files):
  """A copy of the tiny tokenizer plus the given JSON files (name without .json -> content)."""
  import json
  import shutil
  d = tmp_path / "model"
  shutil.copytree(tok_dir, d)
  for name, content in files.items():
    (d / f"{name}.json").write_text(json.dumps(content))
  return str(d)


def test_stop_ids_from_generation_config(tiny_tokenizer_dir, tmp_path):
  tok = tokenizer.load(tiny_tokenizer_dir)
  vocab = tok.get_vocab()
  im_end, eot = vocab["<|im_end|>"], vocab["<|endoftext|>"]
  assert "<|eot_id|>" not in vocab and tok.eos_token_id == im_end
  # A base model: generation_config.json ends on <|endoftext|> alone (verl stops and masks there only).
  d = model_dir_with(tmp_path, tiny_tokenizer_dir, generation_config={"eos_token_id": eot},
                     config={"eos_token_id": 7})
  assert tokenizer.stop_ids(tok, d, "generation_config") == (eot,)
  assert tokenizer.stop_ids(tok, d, "chat") == (eot, im_end)    # + the template's end of turn


def test_stop_ids_list_and_fallbacks(tiny_tokenizer_dir, tmp_path):
  tok = tokenizer.load(tiny_tokenizer_dir)
  vocab = tok.get_vocab()
  im_end, eot = vocab["<|im_end|>"], vocab["<|endoftext|>"]
  d = model_dir_with(tmp_path, tiny_tokenizer_dir, generation_config={"eos_token_id": [5, im_end, 5]})
  assert tokenizer.stop_ids(tok, d, "generation_config") == (5, im_end)
  assert tokenizer.stop_ids(tok, d, "chat") == (5, im_end, eot)
  # No generation_config.json: config.json's eos_token_id, as GenerationConfig.from_model_config.
  os.remove(os.path.join(d, "generation_config.json"))
  with open(os.path.join(d, "config.json"), "w") as f:
    f.write('{"eos_token_id": 9}')
  assert tokenizer.stop_ids(tok, d, "generation_config") == (9,)
  # Neither file, or no model directory: the tokenizer's EOS.
  os.remove(os.path.join(d, "config.json"))
  assert tokenizer.stop_ids(tok, d, "generation_config") == (im_end,)
  assert tokenizer.stop_ids(tok, "", "generation_config") == (im_end,)
  assert tokenizer.stop_ids(tok, "", "chat") == tokenizer.eos_ids(tok) == (im_end, eot)


def test_stop_ids_errors_name_the_field_or_file(tiny_tokenizer_dir, tmp_path):
  tok = tokenizer.load(tiny_tokenizer_dir)
  with pytest.raises(tokenizer.TokenizerError, match="rollout.stop='eos'"):
    tokenizer.stop_ids(tok, "", "eos")
  d = model_dir_with(tmp_path, tiny_tokenizer_dir, generation_config={"eos_token_id": "</s>"})
  with pytest.raises(tokenizer.TokenizerError, match="generation_config.json: eos_token_id='</s>'"):
    tokenizer.stop_ids(tok, d, "chat")
  with open(os.path.join(d, "generation_config.json"), "w") as f:
    f.write("{not json")
  with pytest.raises(tokenizer.TokenizerError, match="generation_config.json: cannot read"):
    tokenizer.stop_ids(tok, d, "chat")
