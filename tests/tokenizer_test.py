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


# --- BOS: by the tokenizer's own rule, exactly once ------------------------------------------------

def _family_tokenizer_dir(path, family: str) -> str:
  """A byte-level BPE saved as a directory, with a real family's special tokens and how it adds BOS:
  Llama 3 by a post-processor (<|begin_of_text|>), Llama 2 by `add_bos_token` (<s>), Qwen not at all."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  from transformers import LlamaTokenizerFast, PreTrainedTokenizerFast
  bos, eos = {"llama3": ("<|begin_of_text|>", "<|eot_id|>"), "llama2": ("<s>", "</s>"),
              "qwen": (None, "<|im_end|>")}[family]
  specials = [t for t in (bos, eos, "<|im_start|>", "<|endoftext|>") if t]
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(["The capital of France is Paris. What is 38+46?"] * 4, trainers.BpeTrainer(
      vocab_size=300, special_tokens=specials, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  if family == "llama3":  # As Llama 3's own tokenizer.json: BOS written by the post-processor.
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
  if family == "llama2":
    hf = LlamaTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, add_bos_token=True)
  else:
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
  with open(os.path.join(os.path.dirname(__file__), "data", "templates",
                         {"llama3": "llama3_1", "llama2": "llama3_1", "qwen": "qwen2_5"}[family] + ".jinja")) as f:
    hf.chat_template = f.read()
  hf.save_pretrained(str(path))
  return str(path)


@pytest.mark.parametrize("family", ["llama3", "llama2", "qwen"])
def test_a_plain_prompt_gets_bos_as_transformers_adds_it(tmp_path, family):
  from transformers import AutoTokenizer
  path = _family_tokenizer_dir(tmp_path, family)
  ref = AutoTokenizer.from_pretrained(path)   # transformers' own defaults for this directory
  tok = tokenizer.load(path)
  text = "The capital of France is"
  want = ref(text)["input_ids"]
  assert (want[0] == ref.bos_token_id) == (family != "qwen")   # the families differ, as real ones do
  assert tokenizer.encode_prompts(tok, [text]) == [want]
  tokens, mask = tokenizer.encode_left_padded(tok, [text], 16)
  assert tokens[0][mask[0]].tolist() == want
  # A text that already begins with the BOS (a rendered template, or typed) gets no second one.
  if family != "qwen":
    assert tokenizer.encode_prompts(tok, [ref.bos_token + text]) == [want]


@pytest.mark.parametrize("family", ["llama3", "qwen"])
def test_a_rendered_template_keeps_its_one_bos(tmp_path, family):
  from transformers import AutoTokenizer
  path = _family_tokenizer_dir(tmp_path, family)
  ref = AutoTokenizer.from_pretrained(path)
  messages = [{"role": "user", "content": "What is 38+46?"}]
  want = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  want = list(want["input_ids"] if hasattr(want, "keys") else want)
  text = tokenizer.render(tokenizer.load(path), messages)
  got = tokenizer.encode_prompts(tokenizer.load(path), [text])[0]
  assert got == want
  assert got.count(ref.bos_token_id) == (1 if family == "llama3" else 0)


@pytest.mark.parametrize("chat_template", [True, False])
def test_training_rows_begin_with_one_bos_as_context(tmp_path, chat_template):
  # Chat SFT and the arithmetic warm start see their prompts as generation does: one BOS, never a target.
  from transformers import AutoTokenizer

  from dapo_jax.data import conversations
  from dapo_jax.data import prompts as data_lib
  from dapo_jax.pipelines import sft
  path = _family_tokenizer_dir(tmp_path, "llama3")
  bos = AutoTokenizer.from_pretrained(path).bos_token_id
  tok = tokenizer.load(path)
  doc = conversations.encode(tok, conversations.Conversation(
      ({"role": "user", "content": "What is 38+46?"}, {"role": "assistant", "content": "84"})), chat_template)
  assert doc.ids[0] == bos and (doc.ids == bos).sum() == 1 and not doc.loss_mask[0]
  ex = data_lib.Example(messages=({"role": "user", "content": "What is 38+46?"},), ground_truth="84")
  (ids, mask), = sft.sft_rows(tok, [ex], chat_template, "direct")
  assert ids[0] == bos and ids.count(bos) == 1 and not mask[0]
