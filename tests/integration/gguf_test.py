"""SmolLM2-135M-Instruct from its GGUF file against transformers loading the same file (torch)."""
import os

import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax.hf import gguf
from dapo_jax.model import transformer as model

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

STRINGS = ["Hello world", "What is 47 + 38?\nAnswer: 85", "  two  spaces\n\nand newlines\t", "1234567890",
           "x=3.14159; y = -2e10", "naïve café, 東京"]


@pytest.fixture(scope="module")
def path():
  try:
    p = gguf.smollm2_path()
  except gguf.GGUFError as e:
    pytest.skip(str(e))
  return p


@pytest.mark.slow
def test_tokenizer_matches_transformers(path):
  from transformers import AutoTokenizer
  ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
  ours = gguf.tokenizer(path)
  for s in STRINGS:
    assert ours(s, add_special_tokens=False)["input_ids"] == ref(s, add_special_tokens=False)["input_ids"], s
  chat = [{"role": "user", "content": "What is 12 + 7?"}]
  a = ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
  b = ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
  assert a == b and "<|im_start|>assistant" in a
  assert ours(a, add_special_tokens=False)["input_ids"] == ref(b, add_special_tokens=False)["input_ids"]
  assert ours.eos_token_id == 2 and ours.eos_token == "<|im_end|>"


@pytest.mark.slow
def test_logits_match_transformers(path, tmp_path):
  from transformers import AutoModelForCausalLM
  cfg, params = gguf.load(path)
  assert (cfg.num_layers, cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim,
          cfg.vocab_size, cfg.rope_theta, cfg.tie_embeddings) == (30, 576, 9, 3, 64, 1536, 49152, 1e5, True)
  ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                             dtype=torch.float32).eval()
  tok = gguf.tokenizer(path)
  texts = ["The capital of France is", "What is 47 + 38? Answer:", "def fib(n):\n    return"]
  ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
  T = max(map(len, ids))
  tokens = np.zeros((len(ids), T), np.int64)
  mask = np.zeros((len(ids), T), np.int64)
  for b, row in enumerate(ids):  # left padding
    tokens[b, T - len(row):], mask[b, T - len(row):] = row, 1
  ours = np.asarray(model.logits(cfg, params, jnp.asarray(tokens), jnp.asarray(mask)))
  pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
  with torch.no_grad():
    theirs = ref(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                 position_ids=torch.tensor(pos)).logits.numpy()
  m = mask.astype(bool)
  # Logits here reach |20| after 30 fp32 layers: 1e-4 absolute plus 1e-5 relative (fp32 rounding
  # of the two implementations' different summation orders; the worst case seen is 1.1e-4 at 15.7).
  np.testing.assert_allclose(ours[m], theirs[m], atol=1e-4, rtol=1e-5)
  # And the HF directory we write loads back to the same logits.
  gguf.to_hf_dir(path, str(tmp_path / "smollm2"))
  from dapo_jax.hf import convert as hf
  cfg2, params2 = hf.load(str(tmp_path / "smollm2"))
  again = np.asarray(model.logits(cfg2, params2, jnp.asarray(tokens), jnp.asarray(mask)))
  np.testing.assert_allclose(again[m], ours[m], atol=1e-6)
