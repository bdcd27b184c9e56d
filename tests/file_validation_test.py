"""Every file we read is checked first: safetensors, sharded indexes, GGUF, tokenizer directories."""
import json
import os
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest

from configs import common
from dapo_jax import builders, testing
from dapo_jax.data import tokenizer
from dapo_jax.hf import convert as hf
from dapo_jax.hf import gguf
from dapo_jax.model import transformer as model


def small_model_dir(path, tok_dir=None):
  cfg = testing.tiny_model_config(vocab_size=128)
  import jax
  params = jax.device_get(model.init_params(cfg, jax.random.key(0)))
  hf.save(str(path), cfg, params)
  if tok_dir:
    for f in os.listdir(tok_dir):
      shutil.copy(os.path.join(tok_dir, f), path)
  return cfg, params


def write_raw(path, header, data=b"", header_len=None):
  raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)


@pytest.mark.parametrize("header,data,header_len,message", [
    (b"", b"", None, r"0 bytes, too short for a safetensors file"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"", 10**9,
     r"header length 1000000000 does not fit in the file's"),
    (b"{not json", b"", None, r"header is not valid JSON"),
    (b"[1, 2]", b"", None, r"header is a JSON list, expected an object"),
    ({"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, None, r"tensor 'w': header entry needs dtype"),
    ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, None,
     r"shape \[-2\] is not a list of non-negative integers"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, None,
     r"data_offsets \[8, 0\] is not \[begin, end\]"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, None,
     r"tensor 'w': data ends at byte 16, past the 8 data bytes of the file \(truncated\?\)"),
    ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None,
     r"shape \[3\] of F32 needs 12 bytes, but data_offsets \[0, 8\] span 8"),
])
def test_malformed_safetensors_named_in_one_line(tmp_path, header, data, header_len, message):
  path = str(tmp_path / "x.safetensors")
  if header == b"":
    open(path, "wb").close()
  else:
    write_raw(path, header, data, header_len)
  with pytest.raises(hf.CheckpointError, match=message) as e:
    hf.read_safetensors(path)
  assert str(e.value).startswith(path) and "\n" not in str(e.value)


def test_what_only_the_package_refuses_is_one_line_with_its_reason(tmp_path):
  # Bytes past the last tensor: our checks find nothing wrong, the safetensors package refuses the file.
  path = str(tmp_path / "x.safetensors")
  write_raw(path, {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8)
  with pytest.raises(hf.CheckpointError, match=r"^" + path + r": incomplete metadata, file not fully covered$"):
    hf.read_safetensors(path)


def test_bfloat16_written_by_torch_reads_exactly(tmp_path):
  torch = pytest.importorskip("torch")
  from safetensors.torch import save_file
  path = str(tmp_path / "t.safetensors")
  w = torch.randn(3, 5).to(torch.bfloat16)
  save_file({"w": w, "i": torch.arange(4)}, path)
  got = hf.read_safetensors(path)
  assert got["w"].dtype == ml_dtypes.bfloat16 and got["i"].dtype == np.int64
  np.testing.assert_array_equal(got["w"].astype(np.float32), w.float().numpy())
  hf.write_safetensors(str(tmp_path / "back.safetensors"), got)  # And back, read by torch's own reader.
  from safetensors.torch import load_file
  assert torch.equal(load_file(str(tmp_path / "back.safetensors"))["w"], w)


def test_valid_safetensors_round_trip(tmp_path):
  path = str(tmp_path / "ok.safetensors")
  ts = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros((0, 4), np.int32)}
  hf.write_safetensors(path, ts)
  got = hf.read_safetensors(path)
  np.testing.assert_array_equal(got["a"], ts["a"])
  assert got["b"].shape == (0, 4)


def test_truncated_model_file_names_the_file(tmp_path):
  small_model_dir(tmp_path)
  path = tmp_path / "model.safetensors"
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) * 2 // 3)
  with pytest.raises(hf.CheckpointError, match=rf"{path}: tensor '.*': data ends at byte \d+, past the"):
    hf.load(str(tmp_path))


def test_sharded_index_is_checked(tmp_path):
  cfg, params = small_model_dir(tmp_path)
  tensors = hf.read_safetensors(str(tmp_path / "model.safetensors"))
  names = sorted(tensors)
  half = len(names) // 2
  os.remove(tmp_path / "model.safetensors")
  hf.write_safetensors(str(tmp_path / "a.safetensors"), {n: np.array(tensors[n]) for n in names[:half]})
  hf.write_safetensors(str(tmp_path / "b.safetensors"), {n: np.array(tensors[n]) for n in names[half:]})
  index = tmp_path / "model.safetensors.index.json"
  good = {n: ("a.safetensors" if i < half else "b.safetensors") for i, n in enumerate(names)}
  index.write_text(json.dumps({"weight_map": good}))
  _, loaded = hf.load(str(tmp_path))
  np.testing.assert_array_equal(np.asarray(loaded["embed_VD"]), np.asarray(params["embed_VD"]))
  for wm, message in [
      (dict(good, **{names[0]: "c.safetensors"}), r"lists 'c.safetensors', which is not in"),
      (dict(good, **{names[0]: "b.safetensors"}), rf"tensor '{names[0]}' is mapped to 'b.safetensors', which "
                                                  "does not hold it"),
      (dict(good, **{names[0]: "../x.safetensors"}), r"weight_map names '../x.safetensors'"),
      ({}, r"field 'weight_map' must map tensor names to file names")]:
    index.write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(hf.CheckpointError, match=message):
      hf.load(str(tmp_path))
  index.write_text("{broken")
  with pytest.raises(hf.CheckpointError, match=rf"{index}: not a JSON object"):
    hf.load(str(tmp_path))


def test_config_json_of_the_wrong_kind(tmp_path):
  small_model_dir(tmp_path)
  cfg = json.load(open(tmp_path / "config.json"))
  (tmp_path / "config.json").write_text(json.dumps([cfg]))
  with pytest.raises(hf.CheckpointError, match=r"config.json: a JSON list, expected an object"):
    hf.load(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps(dict(cfg, num_key_value_heads=3)))
  with pytest.raises(hf.CheckpointError, match=r"config.json: num_heads=4 must be a multiple of num_kv_heads=3"):
    hf.load(str(tmp_path))


def test_gguf_files_are_checked(tmp_path):
  pytest.importorskip("gguf")
  for content, message in [(b"", r"empty"), (b"GGUF\x03\0\0\0", r"truncated"), (b"NOTGGUF" + b"\0" * 40,
                                                                                  r"not a GGUF file")]:
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    with pytest.raises(gguf.GGUFError, match=message) as e:
      gguf.load(str(path))
    assert str(path) in str(e.value)
  path.write_bytes(b"GGUF" + struct.pack("<I", 99) + b"\0" * 16)
  with pytest.raises(gguf.GGUFError, match=r"GGUF version 99"):
    gguf.load(str(path))


def test_tokenizer_directory_without_vocabulary(tmp_path, tiny_tokenizer_dir):
  small_model_dir(tmp_path)  # A model directory with no tokenizer files.
  with pytest.raises(tokenizer.TokenizerError, match=r"has no vocabulary: expected tokenizer.json"):
    tokenizer.load(str(tmp_path))
  shutil.copytree(tiny_tokenizer_dir, tmp_path / "tok")
  (tmp_path / "tok" / "tokenizer.json").write_text("{\"truncated")
  with pytest.raises(tokenizer.TokenizerError, match=r"tokenizer.json: not valid JSON"):
    tokenizer.load(str(tmp_path / "tok"))


def test_tokenizer_larger_than_embedding_is_named(tmp_path, tiny_tokenizer_dir):
  tok = tokenizer.load(tiny_tokenizer_dir)
  small_model_dir(tmp_path / "m", tiny_tokenizer_dir)
  c = common.base()
  c.model.update(init="hf", hf_dir=str(tmp_path / "m"))
  with pytest.raises(tokenizer.TokenizerError, match=rf"has {len(tok)} tokens, more than the 128 embedding rows "
                                                     rf"of the model \({tmp_path}/m/config.json\)"):
    builders.initial_model(c, str(tmp_path), tok, None, [])
  c.model.update(init="random", vocab_size=64)
  with pytest.raises(tokenizer.TokenizerError, match=r"more than the 64 embedding rows of the model "
                                                     r"\(model.vocab_size=64\)"):
    builders.initial_model(c, str(tmp_path), tok, None, [])


def test_file_task_trains_its_tokenizer_on_the_file(tmp_path):
  rows = [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": f"Find x if x - {i} = 7."}],
           "reward_model": {"ground_truth": str(i + 7), "style": "rule"}} for i in range(60)]
  path = tmp_path / "train.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  c = common.base()
  c.data.update(task="file", train_files=(str(path),))
  c.tokenizer.vocab_size = 300
  train, _ = builders.datasets(c)
  tok = builders.tokenizer(c, str(tmp_path / "work"), train)
  text = "Find x if x - 12 = 7."
  ids = tok(text, add_special_tokens=False)["input_ids"]
  assert 1 < len(ids) < len(text) and tok.decode(ids) == text  # Merges learnt from the file's text.
  assert tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id


# --- files that point outside their directory -----------------------------------------------------

def sharded_dir(path):
  """A model directory whose tensors are in two shards, a.safetensors and b.safetensors, with an index."""
  small_model_dir(path)
  tensors = hf.read_safetensors(str(path / "model.safetensors"))
  names = sorted(tensors)
  os.remove(path / "model.safetensors")
  hf.write_safetensors(str(path / "a.safetensors"), {n: tensors[n] for n in names[:3]})
  hf.write_safetensors(str(path / "b.safetensors"), {n: tensors[n] for n in names[3:]})
  weight_map = {n: "a.safetensors" if i < 3 else "b.safetensors" for i, n in enumerate(names)}
  (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  return weight_map


@pytest.mark.parametrize("target", ["/abs/b.safetensors", "../b.safetensors", "sub/../../b.safetensors"])
def test_sharded_index_naming_a_path_outside_is_refused(tmp_path, target):
  weight_map = sharded_dir(tmp_path / "m")
  index = tmp_path / "m" / "model.safetensors.index.json"
  index.write_text(json.dumps({"weight_map": {n: target if f == "b.safetensors" else f
                                              for n, f in weight_map.items()}}))
  with pytest.raises(hf.CheckpointError, match=rf"^{index}: weight_map names '{target}' is a path outside "):
    hf.load(str(tmp_path / "m"))


def test_shard_symlinked_out_of_the_directory_is_refused(tmp_path):
  sharded_dir(tmp_path / "m")
  os.rename(tmp_path / "m" / "b.safetensors", tmp_path / "elsewhere.safetensors")
  os.symlink(tmp_path / "elsewhere.safetensors", tmp_path / "m" / "b.safetensors")
  index = tmp_path / "m" / "model.safetensors.index.json"
  with pytest.raises(hf.CheckpointError, match=rf"^{index}: weight_map names 'b.safetensors' is a symlink to "
                                               rf"{tmp_path}/elsewhere.safetensors, outside {tmp_path}/m$"):
    hf.load(str(tmp_path / "m"))
  os.replace(tmp_path / "m" / "config.json", tmp_path / "real.json")  # config.json linked out.
  os.symlink(tmp_path / "real.json", tmp_path / "m" / "config.json")
  with pytest.raises(hf.CheckpointError, match=r"'config.json' is a symlink to .*real.json, outside"):
    hf.load(str(tmp_path / "m"))


def test_symlinks_inside_the_directory_and_the_hf_cache_layout_load(tmp_path):
  """snapshots/REV/FILE -> ../../blobs/HASH is how the Hugging Face cache stores every model."""
  repo = tmp_path / "models--org--tiny"
  snap = repo / "snapshots" / "abc123"
  _, params = small_model_dir(tmp_path / "src")
  os.makedirs(repo / "blobs")
  os.makedirs(snap)
  for i, fn in enumerate(sorted(os.listdir(tmp_path / "src"))):
    shutil.copy(tmp_path / "src" / fn, repo / "blobs" / f"h{i}")
    os.symlink(f"../../blobs/h{i}", snap / fn)
  _, loaded = hf.load(str(snap))
  np.testing.assert_array_equal(np.asarray(loaded["embed_VD"]), np.asarray(params["embed_VD"]))


def test_peft_adapter_files_symlinked_out_are_refused(tmp_path):
  from dapo_jax.hf import peft
  cfg = testing.tiny_model_config(vocab_size=128)
  os.makedirs(tmp_path / "adapter")
  (tmp_path / "secret.json").write_text(json.dumps({"peft_type": "LORA"}))
  os.symlink(tmp_path / "secret.json", tmp_path / "adapter" / "adapter_config.json")
  with pytest.raises(hf.CheckpointError, match=rf"^{tmp_path}/adapter: 'adapter_config.json' is a symlink to "
                                               rf"{tmp_path}/secret.json, outside"):
    peft.load_peft(str(tmp_path / "adapter"), cfg)


def test_tokenizer_files_pointing_outside_are_refused(tmp_path, tiny_tokenizer_dir):
  tok = tmp_path / "tok"
  shutil.copytree(tiny_tokenizer_dir, tok)
  tokenizer.load(str(tok))  # Intact, it loads.
  config = json.loads((tok / "tokenizer_config.json").read_text())
  for value in ("/etc/hostname", "../tokenizer.json"):
    (tok / "tokenizer_config.json").write_text(json.dumps(dict(config, tokenizer_file=value)))
    with pytest.raises(tokenizer.TokenizerError, match=rf"tokenizer_config.json: field 'tokenizer_file' names "
                                                       rf"'{value}' is a path outside"):
      tokenizer.load(str(tok))
  (tok / "tokenizer_config.json").write_text(json.dumps(config))
  os.replace(tok / "tokenizer.json", tmp_path / "vocab_elsewhere.json")
  os.symlink(tmp_path / "vocab_elsewhere.json", tok / "tokenizer.json")
  with pytest.raises(tokenizer.TokenizerError, match=rf"tokenizer directory '{tok}': 'tokenizer.json' is a "
                                                     rf"symlink to {tmp_path}/vocab_elsewhere.json, outside"):
    tokenizer.load(str(tok))
