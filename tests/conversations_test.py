"""SFT conversations: row schemas, assistant-only loss masks, packing with per-document attention."""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax import loss, rlhf_objectives, testing
from dapo_jax.data import conversations as conv_lib
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.data.prompts import DataError
from dapo_jax.model import transformer as model_lib

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "Answer: 5"}, {"role": "user", "content": "And 4+4?"},
        {"role": "assistant", "content": "Answer: 8"}]


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
  return tokenizer_lib.load(tiny_tokenizer_dir)


def write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_rows_in_both_schemas_and_formats(tmp_path):
  rows = [{"messages": CHAT}, {"prompt": "What is 1+1?", "completion": "Answer: 2"},
          {"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "assistant", "content": "Yo"}]}]
  convs = conv_lib.load_conversations(write_jsonl(tmp_path / "sft.jsonl", rows))
  assert convs[0].messages == tuple(CHAT)
  assert convs[1].messages == ({"role": "user", "content": "What is 1+1?"},
                               {"role": "assistant", "content": "Answer: 2"})
  assert convs[2].messages[-1] == {"role": "assistant", "content": "Yo"} and convs[2].index == 2
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.Table.from_pylist(rows[1:2]), str(tmp_path / "sft.parquet"))
  assert conv_lib.load_conversations(str(tmp_path / "sft.parquet"))[0].messages == convs[1].messages


@pytest.mark.parametrize("row, needle", [
    ({"prompt": "x"}, "row 1: no field 'messages' and no field 'completion'"),
    ({"completion": "x"}, "row 1: no field 'messages' and no field 'prompt'"),
    ({"messages": [{"role": "user", "content": "x"}]}, "row 1: field 'messages' has no assistant turn"),
    ({"messages": "x"}, "row 1: field 'messages' must be"),
    ({"messages": [{"role": "user"}]}, "row 1: field 'messages' must be"),
])
def test_bad_rows_name_file_and_row(tmp_path, row, needle):
  path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": CHAT}, row])
  with pytest.raises(DataError, match="bad.jsonl: " + needle.replace("(", r"\(")):
    conv_lib.load_conversations(path)


def test_heldout_split_keeps_prompts_on_one_side():
  convs = [conv_lib.Conversation(({"role": "user", "content": f"q{i % 50}"}, {"role": "assistant", "content": str(i)}))
           for i in range(400)]
  train, held = conv_lib.split_heldout(convs, 0.2)
  assert len(train) + len(held) == 400 and 0.05 < len(held) / 400 < 0.4
  assert not {c.messages[0]["content"] for c in train} & {c.messages[0]["content"] for c in held}


def test_loss_mask_covers_assistant_turns_and_their_end_token(tok):
  doc = conv_lib.encode(tok, conv_lib.Conversation(tuple(CHAT)), chat_template=True)
  # The ids are the template's rendering of the whole chat.
  assert tok.decode(doc.ids) == tok.apply_chat_template(CHAT, tokenize=False)
  targets = tok.decode(doc.ids[doc.loss_mask])
  assert targets == "Answer: 5<|im_end|>Answer: 8<|im_end|>"
  # The targets are two contiguous spans.
  assert np.sum(np.diff(doc.loss_mask.astype(int)) == 1) == 2
  everything = conv_lib.encode(tok, conv_lib.Conversation(tuple(CHAT)), assistant_only=False)
  assert everything.loss_mask.all() and np.array_equal(everything.ids, doc.ids)


def test_plain_text_mask_ends_assistant_turns_with_eos(tok):
  c = conv_lib.Conversation(({"role": "user", "content": "What is 1+1?"},
                             {"role": "assistant", "content": "Answer: 2"}))
  doc = conv_lib.encode(tok, c, chat_template=False)
  assert tok.decode(doc.ids) == "What is 1+1?\nAnswer: 2<|im_end|>"
  assert tok.decode(doc.ids[doc.loss_mask]) == "Answer: 2<|im_end|>"


def test_template_that_is_not_prefix_stable_fails_naming_the_row(tok):
  class Rewriting:  # A template that drops earlier assistant turns (as some "thinking" templates do).
    chat_template, eos_token = "x", "<|im_end|>"

    def apply_chat_template(self, msgs, add_generation_prompt, tokenize):
      return "|".join(m["content"] for m in msgs if m["role"] != "assistant" or m is msgs[-1])

  with pytest.raises(DataError, match="data.jsonl: row 7: the chat template does not render turn 3"):
    conv_lib.encode(Rewriting(), conv_lib.Conversation(tuple(CHAT), index=7), source="data.jsonl")


def doc(n, start=10, mask_from=0):
  ids = np.arange(start, start + n, dtype=np.int32)
  return conv_lib.Document(ids, np.arange(n) >= mask_from)


def test_pack_layout():
  docs = [doc(5, 10), doc(3, 20), doc(4, 30), doc(9, 40), doc(2, 50)]
  b = conv_lib.pack(docs, seq_len=8, pad_id=1)
  # The 9-token document is cut to 8; the rest fit first-fit by decreasing length: [5, 3], [4, 2].
  assert b.tokens_BT.shape == (3, 8)
  np.testing.assert_array_equal(b.tokens_BT[0], np.arange(40, 48))
  np.testing.assert_array_equal(b.segment_ids_BT[1], [1, 1, 1, 1, 1, 2, 2, 2])
  np.testing.assert_array_equal(b.positions_BT[1], [0, 1, 2, 3, 4, 0, 1, 2])
  np.testing.assert_array_equal(b.tokens_BT[2], [30, 31, 32, 33, 50, 51, 1, 1])
  np.testing.assert_array_equal(b.segment_ids_BT[2], [1, 1, 1, 1, 2, 2, 0, 0])
  assert not b.loss_mask_BT[2, 6:].any()
  # Every document's tokens appear exactly once.
  assert sorted(b.tokens_BT[b.segment_ids_BT > 0].tolist()) == sorted(
      np.concatenate([d.ids[:8] for d in docs]).tolist())
  assert conv_lib.pack(docs, 8, num_rows=5).tokens_BT.shape == (5, 8)
  with pytest.raises(ValueError, match="need 3 rows"):
    conv_lib.pack(docs, 8, num_rows=2)


def test_packed_attention_mask_against_loop():
  seg = np.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
  m = np.asarray(model_lib.packed_attention_mask(seg))
  ref = np.array([[[seg[b, s] == seg[b, t] and seg[b, s] > 0 and s <= t for s in range(6)] for t in range(6)]
                  for b in range(2)])
  np.testing.assert_array_equal(m, ref)
  tm = rlhf_objectives.target_mask(np.ones((1, 6), bool), seg[:1])
  np.testing.assert_array_equal(tm, [[True, False, True, True, False]])


@functools.partial(jax.jit, static_argnums=0)
def nll_sum(cfg, params, tokens_BT, pos_BT, mask_BTS, target_BT):
  logits_BTV = model_lib.forward(cfg, params, jnp.asarray(tokens_BT), jnp.asarray(pos_BT), jnp.asarray(mask_BTS))
  logp_BT = loss.token_logprobs(logits_BTV[:, :-1], jnp.asarray(tokens_BT)[:, 1:])
  return -jnp.sum(jnp.where(target_BT, logp_BT, 0.0)), jnp.sum(target_BT)


def test_packed_loss_equals_unpacked_loss(tok):
  convs = [conv_lib.Conversation(tuple(CHAT)),
           conv_lib.Conversation(({"role": "user", "content": "What is 12+30?"},
                                  {"role": "assistant", "content": "2+0=2, 1+3=4. Answer: 42"})),
           conv_lib.Conversation(({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "7"})),
           conv_lib.Conversation(({"role": "user", "content": "What is 999+1?"},
                                  {"role": "assistant", "content": "Answer: 1000"}))]
  docs = [conv_lib.encode(tok, c) for c in convs]
  lengths = [len(d.ids) for d in docs]
  cfg = testing.tiny_model_config(vocab_size=len(tok) + 4)
  params = model_lib.init_params(cfg, jax.random.key(0))
  seq_len = max(lengths) + 12
  packed = conv_lib.pack(docs, seq_len, pad_id=tok.pad_token_id)
  assert packed.tokens_BT.shape[0] < len(docs)   # Something really was packed together.
  p_sum, p_n = nll_sum(cfg, params, packed.tokens_BT, packed.positions_BT,
                       model_lib.packed_attention_mask(packed.segment_ids_BT),
                       rlhf_objectives.target_mask(packed.loss_mask_BT, packed.segment_ids_BT))
  # Unpacked: one right-padded row per document, positions 0.., causal attention over real tokens.
  T = max(lengths)
  tokens = np.full((len(docs), T), tok.pad_token_id, np.int32)
  real, lm = np.zeros((len(docs), T), bool), np.zeros((len(docs), T), bool)
  for i, d in enumerate(docs):
    tokens[i, :len(d.ids)], real[i, :len(d.ids)], lm[i, :len(d.ids)] = d.ids, True, d.loss_mask
  mask_BTS = np.tril(np.ones((T, T), bool))[None] & real[:, None, :]
  u_sum, u_n = nll_sum(cfg, params, tokens, np.tile(np.arange(T), (len(docs), 1)), mask_BTS, lm[:, 1:] & real[:, 1:])
  assert int(p_n) == int(u_n) == sum(int(d.loss_mask[1:].sum()) for d in docs)
  np.testing.assert_allclose(p_sum / p_n, u_sum / u_n, rtol=1e-5, atol=1e-5)
