"""The entry points, run as a user runs them (subprocesses) on tiny models, checked by value:
`plan` against memory.plan, `prepare gguf` and `sft` and `export` against transformers loading
what they wrote, `bench train`'s JSON, and a restore with another seed refused in one line."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from dapo_jax import testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNLOCAL = f"--config={ROOT}/configs/dapo_qwen2_5_32b.py:runlocal"


def launch(verb, *args, timeout=600, devices=1):
  xla_flags = testing.FAST_COMPILE_XLA_FLAGS
  if devices > 1:
    xla_flags += f" --xla_force_host_platform_device_count={devices}"
  env = dict(os.environ, XLA_FLAGS=xla_flags, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  out = subprocess.run([sys.executable, "-m", f"launch.{verb}", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=timeout)
  return out


def ok(out):
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return out.stdout


def transformers_logits(model_dir, ids_BT):
  torch = pytest.importorskip("torch")
  from transformers import AutoModelForCausalLM
  m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
  with torch.no_grad():
    return m(torch.as_tensor(ids_BT)).logits.numpy()


def our_logits(model_dir, ids_BT):
  import jax.numpy as jnp

  from dapo_jax.hf import convert as hf
  from dapo_jax.model import transformer as model
  cfg, params = hf.load(model_dir)
  return np.asarray(model.logits(cfg, params, jnp.asarray(ids_BT), jnp.ones(ids_BT.shape, bool)))


def test_plan_prints_the_numbers_of_memory_plan():
  from configs import dapo_qwen2_5_32b
  from dapo_jax import builders, train_step
  from dapo_jax.model import memory
  stdout = ok(launch("plan", f"--config={ROOT}/configs/dapo_qwen2_5_32b.py:mesh=gpu16x8"))
  cfg = dapo_qwen2_5_32b.get_config("mesh=gpu16x8")
  mc = builders.model_config(cfg, cfg.model.vocab_size or 1024)
  shape = dict(cfg.mesh)
  assert -1 not in shape.values()
  rows = cfg.dapo.prompts_per_step * cfg.rollout.group_size // cfg.train.minibatches
  T = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
  m = cfg.train.num_microbatches or train_step.auto_microbatches(
      rows, T, group_size=cfg.rollout.group_size if cfg.train.share_prompt else 1,
      shards=shape["data"] * shape["fsdp"], max_tokens=cfg.train.microbatch_tokens)
  p = memory.plan(mc, shape, rows_per_update=rows, num_microbatches=m, prompt_len=cfg.data.max_prompt_len,
                  completion_len=cfg.rollout.max_new_tokens,
                  gen_rows=cfg.rollout.rows_per_call or cfg.dapo.gen_prompts * cfg.rollout.group_size)
  printed = {k.strip(): float(v) for k, v in re.findall(r"^  ([a-zA-Z ,=()]+?)\s+([\d.]+) GB$", stdout, re.M)}
  want = {"parameters": p.params, "optimizer state (AdamW)": p.optimizer, "gradients": p.gradients,
          "activations, no remat": p.activations_no_remat, "activations, remat=full": p.activations_remat,
          "activations, remat=dots": p.activations_dots, "KV cache (sampling)": p.kv_cache,
          "peak (train or sample)": p.peak}
  assert printed.keys() == want.keys(), stdout
  for k, v in want.items():
    assert printed[k] == pytest.approx(v / 1e9, abs=0.006), k
  assert f"{mc.num_params / 1e9:.2f}B parameters" in stdout and f"{rows} rows x {T} tokens" in stdout
  # 32B parameters over 128 devices (fsdp x tensor shard them): 4 bytes x 32.8e9 / 128 = ~1 GB.
  assert printed["parameters"] == pytest.approx(4 * mc.num_params / 128 / 1e9, abs=0.006)


def test_plan_works_on_every_recipe_and_mesh_as_written():
  # Each recipe's `launch.plan --config=...:mesh=M` as its docstring writes it: the devices are the mesh's own.
  script = (
      "import importlib, re, sys\n"
      "sys.argv = ['plan']\n"
      "from launch import plan\n"
      "for name in ('dapo_qwen2_5_32b', 'dapo_qwen3_8b', 'dapo_llama3_1_8b', 'dapo_gemma3_4b', 'dapo_qwen3_30b_a3b'):\n"
      "  mod = importlib.import_module('configs.' + name)\n"
      "  for mesh in mod.MESHES:\n"
      "    text = plan.report(mod.get_config(f'mesh={mesh}'), name=name)\n"
      "    print(name, mesh, re.search(r'\\((\\d+) devices', text).group(1))\n")
  out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT))
  assert out.returncode == 0, out.stderr[-3000:]
  from configs import dapo_qwen3_8b
  printed = dict(((n, m), int(d)) for n, m, d in (line.split() for line in out.stdout.splitlines()))
  assert printed[("dapo_qwen3_8b", "gpu4x8")] == 32 and printed[("dapo_qwen3_8b", "auto")] == 128
  assert len(printed) >= 15 and {m for n, m in printed if n == "dapo_qwen3_8b"} == set(dapo_qwen3_8b.MESHES)
  wrong = launch("plan", f"--config={ROOT}/configs/dapo_qwen3_8b.py:mesh=gpu4x8", "--devices=7")
  assert wrong.returncode == 1 and wrong.stderr.strip().count("\n") == 0 and "7 devices" in wrong.stderr


def test_plan_compiles_a_packed_update_on_the_sequence_axis_gathered_or_by_a_ring():
  """`launch.plan --compiled` with train.packing: each shard's row packed as the update packs it; the
  sequence axis (4 forced devices) cuts the per-device temporaries of a 4,096-token row, gathered or by
  the ring."""
  import jax

  from configs import default
  from launch import plan
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 devices (tests/conftest.py forces 8 host devices)")
  temp = {}
  for sequence, how in ((1, "gather"), (4, "gather"), (4, "ring")):
    cfg = default.get_config("runlocal")
    with cfg.unlocked():
      cfg.train.update(packing=True, num_microbatches=0, packing_block=0)
      cfg.mesh.update(data=1, fsdp=1, sequence=sequence, tensor=1)
      cfg.data.update(max_prompt_len=64, prompt_buckets=(64,))
      cfg.rollout.max_new_tokens = 4032
      cfg.model.update(sequence_attention=how, attn_chunk=512)
    text = plan.compiled(cfg, devices=sequence)
    assert "1 rows x 4096 tokens" in text, text
    temp[sequence, how] = float(re.search(r"temporaries ([\d.]+) GB", text).group(1))
  assert temp[4, "gather"] < 0.5 * temp[1, "gather"] and temp[4, "ring"] < 0.5 * temp[1, "gather"], temp


def test_a_newcomers_mistakes_are_one_line_each(tmp_path):
  def one_line(out, *needles):
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and out.stderr.startswith("error: "), out.stderr
    assert all(n in out.stderr for n in needles), out.stderr

  one_line(launch("train", "--config=configs/nope.py"), "--config=configs/nope.py", "No such file")
  one_line(launch("train", "--config=configs/nope.py", "--config.train.num_steps=2"), "--config=configs/nope.py",
           "No such file")
  one_line(launch("train", "--config=configs/smollm2_135m_arith.py:taks=mul"), "'taks' is unknown", "task")
  one_line(launch("train", "--config.dapo.eps_hihg=0.3"), "--config.dapo.eps_hihg")
  one_line(launch("train", "--dry_run", "--config.rollout.temperature=-1"), "rollout.temperature")
  missing = str(tmp_path / "nowhere")
  one_line(launch("eval", f"--workdir={missing}"), "holds no checkpoint")
  assert not os.path.exists(missing)   # refused before anything was created there
  shim = tmp_path / "shim" / "fastapi"   # a machine without the serve extra
  shim.mkdir(parents=True)
  shim.joinpath("__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'fastapi'\", name='fastapi')\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=f"{tmp_path / 'shim'}:{ROOT}")
  out = subprocess.run([sys.executable, "-m", "launch.serve", "--model_dir=x"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
  one_line(out, "launch.serve needs the package 'fastapi'", "pip install -e '.[serve]'")


def test_help_lists_config_and_dry_run_prints_the_resolved_config():
  helped = launch("train", "--help").stdout   # (absl exits 1 after its help)
  assert "--config: Config file" in helped and "--[no]dry_run" in helped
  shown = ok(launch("train", "--dry_run", "--config=configs/default.py:runlocal", "--config.train.num_steps=3"))
  assert re.search(r"^  num_steps: 3$", shown, re.M) and re.search(r"^  embed_dim: 32$", shown, re.M)
  assert "nothing was run" in shown.splitlines()[-1]


def test_the_installed_package_has_no_generic_top_level_names_and_runs_its_launchers(tmp_path):
  # The wheel holds dapo_jax alone (launch/ and configs/ inside it); its launchers run outside a checkout.
  import glob
  import zipfile
  ok(subprocess.run([sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "--no-build-isolation", "-q", "-w",
                     str(tmp_path / "wheel")], capture_output=True, text=True, timeout=300))
  wheel, = glob.glob(str(tmp_path / "wheel" / "*.whl"))
  names = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
  assert {n for n in names if not n.endswith(".dist-info")} == {"dapo_jax"}, names
  target = tmp_path / "site"
  zipfile.ZipFile(wheel).extractall(target)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(target))
  out = subprocess.run([sys.executable, "-m", "dapo_jax.launch.train", "--dry_run", "--config.train.num_steps=2"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0 and f"{target}/dapo_jax/configs/default.py" in out.stdout, out.stderr[-2000:]
  assert re.search(r"^  num_steps: 2$", out.stdout, re.M)


# --- prepare gguf: a GGUF written here from a transformers Llama ---------------------------------

def _llama_cpp_permute(w, n_head):
  """llama.cpp's convert_hf_to_gguf row order for q/k (its rotary layout)."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _byte_to_unicode():
  """GPT-2's byte -> printable character table (byte-level BPE vocabularies are written in it)."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
  cs, n = bs[:], 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


def test_launchers_run_xla_cpu_without_the_eigen_pool_unless_told():
  from launch import common
  assert common.with_cpu_xla_flags("") == "--xla_cpu_multi_thread_eigen=false"
  assert common.with_cpu_xla_flags("--a=1") == "--a=1 --xla_cpu_multi_thread_eigen=false"
  assert common.with_cpu_xla_flags("--xla_cpu_multi_thread_eigen=true") == "--xla_cpu_multi_thread_eigen=true"
  out = subprocess.run([sys.executable, "-c", "import os, sys; sys.argv = ['x']; from launch import common; "
                        "print(os.environ['XLA_FLAGS'])"], cwd=ROOT, capture_output=True,
                       text=True, env=dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0", PYTHONPATH=ROOT))
  assert out.stdout.strip() == "--xla_backend_optimization_level=0 --xla_cpu_multi_thread_eigen=false", out.stderr


def test_prepare_never_writes_over_a_users_files_unasked(tmp_path):
  """A dataset file that exists, or a directory holding files, is refused in one line and left as it
  was; --overwrite replaces the file (the same rows as a fresh write)."""
  data = tmp_path / "pairs.jsonl"
  data.write_text("my own rows\n")
  res = launch("prepare", "arith_pairs", f"--out={data}", "--num=4")
  assert res.returncode == 1 and res.stderr.strip().splitlines()[-1] == (
      f"error: --out={data} already exists; pass --overwrite to replace it")
  assert data.read_text() == "my own rows\n"
  ok(launch("prepare", "arith_pairs", f"--out={data}", "--num=4", "--overwrite"))
  fresh = tmp_path / "fresh.jsonl"
  ok(launch("prepare", "arith_pairs", f"--out={fresh}", "--num=4"))
  assert data.read_text() == fresh.read_text() and len(fresh.read_text().splitlines()) == 4
  model = tmp_path / "model"
  model.mkdir()
  (model / "notes.txt").write_text("mine")
  res = launch("prepare", "gguf", f"--gguf={tmp_path / 'missing.gguf'}", f"--out={model}")
  assert res.returncode == 1 and res.stderr.strip().splitlines()[-1] == (
      f"error: --out={model} already holds files; pass --overwrite to replace them")
  assert os.listdir(model) == ["notes.txt"]
  res = launch("prepare", "arith_sft", f"--out={model}", "--num=4")
  assert res.returncode == 1 and res.stderr.strip().splitlines()[-1] == (
      f"error: --out={model} is a directory; expected a file")

  # Without the serve extra (fastapi), a user error is still its own line, not an ImportError.
  env = dict(os.environ, XLA_FLAGS=testing.FAST_COMPILE_XLA_FLAGS, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  code = ("import runpy, sys; sys.modules['fastapi'] = None; "
          f"sys.argv = ['prepare', 'arith_sft', '--out={model}', '--num=4']; "
          "runpy.run_module('launch.prepare', run_name='__main__')")
  res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert res.returncode == 1 and res.stderr.strip().splitlines()[-1] == (
      f"error: --out={model} is a directory; expected a file"), res.stderr[-2000:]


@pytest.mark.slow
def test_prepare_gguf_gives_the_model_transformers_had(tmp_path):
  torch = pytest.importorskip("torch")
  gg = pytest.importorskip("gguf")
  from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
  byte_tokens = [_byte_to_unicode()[b] for b in range(256)]
  tokens = byte_tokens + ["ab", "Ġ2", "<|endoftext|>"]
  V, D, F, N, K, H, L = len(tokens), 32, 64, 4, 2, 8, 2
  torch.manual_seed(0)
  ref = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
                                     num_attention_heads=N, num_key_value_heads=K, head_dim=H, rms_norm_eps=1e-5,
                                     rope_theta=10000.0, tie_word_embeddings=False,
                                     max_position_embeddings=64)).eval()
  sd = {k: v.numpy() for k, v in ref.state_dict().items()}
  path = str(tmp_path / "tiny.gguf")
  w = gg.GGUFWriter(path, "llama")
  w.add_block_count(L), w.add_context_length(64), w.add_embedding_length(D), w.add_feed_forward_length(F)
  w.add_head_count(N), w.add_head_count_kv(K), w.add_rope_dimension_count(H), w.add_layer_norm_rms_eps(1e-5)
  w.add_rope_freq_base(10000.0), w.add_vocab_size(V)
  w.add_tokenizer_model("gpt2"), w.add_token_list(tokens), w.add_token_types([1] * (V - 1) + [3])
  w.add_token_merges(["a b", "Ġ 2"]), w.add_bos_token_id(V - 1), w.add_eos_token_id(V - 1)
  w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
  w.add_tensor("output_norm.weight", sd["model.norm.weight"])
  w.add_tensor("output.weight", sd["lm_head.weight"])
  names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
           "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
           "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
  for i in range(L):
    for hf_name, gg_name in names.items():
      arr = sd[f"model.layers.{i}.{hf_name}.weight"]
      if gg_name in ("attn_q", "attn_k"):
        arr = _llama_cpp_permute(arr, N if gg_name == "attn_q" else K)
      w.add_tensor(f"blk.{i}.{gg_name}.weight", np.ascontiguousarray(arr))
  w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()

  out = str(tmp_path / "hf")
  assert f"wrote {out}" in ok(launch("prepare", "gguf", f"--gguf={path}", f"--out={out}"))
  ids = np.random.default_rng(0).integers(0, V, size=(2, 9))
  with torch.no_grad():
    want = ref(torch.as_tensor(ids)).logits.numpy()
  np.testing.assert_allclose(transformers_logits(out, ids), want, atol=1e-4)
  np.testing.assert_allclose(our_logits(out, ids), want, atol=1e-4)
  tok = AutoTokenizer.from_pretrained(out)
  assert tok.encode("ab 2x", add_special_tokens=False) == [256, 257, byte_tokens.index("x")]  # Merged.
  assert tok.eos_token == "<|endoftext|>"


# --- sft, bench ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_sft_writes_a_model_transformers_loads(tmp_path):
  workdir = str(tmp_path / "run")
  stdout = ok(launch("sft", RUNLOCAL, f"--workdir={workdir}", "--config.sft.steps=3", "--config.sft.batch_size=4",
                     "--config.sft.seq_len=32", "--config.sft.num_examples=64", "--config.sft.probe_size=8",
                     "--config.sft.lr=1e-2", "--config.sft.warmup_steps=0"))
  out = os.path.join(workdir, "sft_model")
  assert f"SFT model written to {out}" in stdout
  from transformers import AutoTokenizer
  tok = AutoTokenizer.from_pretrained(out)
  ids = np.asarray([tok.encode("What is 12+34?")] * 2)
  np.testing.assert_allclose(transformers_logits(out, ids), our_logits(out, ids), atol=1e-4)


@pytest.mark.slow
def test_bench_async_measures_a_split_mesh_and_predicts_from_its_phases():
  from dapo_jax import pipelining
  # As the README writes it: no XLA_FLAGS device count (the bench forces 8 host devices on CPU).
  stdout = ok(launch("bench", "async", RUNLOCAL, "--rollout_devices=4", "--runs=3", "--config.mesh.fsdp=-1"))
  result = json.loads(stdout.strip().splitlines()[-1])
  assert (result["bench"], result["rollout_devices"], result["train_devices"]) == ("async", 4, 4)
  r, t = result["runs_rollout_s"], result["runs_train_s"]
  assert len(r) == len(t) == 3 and min(r + t) > 0
  assert result["predicted_step_s"]["0"] == pytest.approx(sum(r + t) / 3, rel=1e-3)
  assert result["predicted_step_s"]["1"] == pytest.approx(pipelining.schedule_seconds(r, t, 1) / 3, rel=1e-3)
  assert result["predicted_speedup"]["4"] >= result["predicted_speedup"]["1"] >= 1


@pytest.mark.slow
def test_bench_train_prints_positive_numbers():
  stdout = ok(launch("bench", "train", RUNLOCAL, "--batch=4", "--seq_len=16", "--runs=2"))
  result = json.loads(stdout.strip().splitlines()[-1])
  assert result["bench"] == "train" and result["microbatches"] >= 1
  for k in ("forward_tokens_per_s", "update_tokens_per_s", "update_median_s", "forward_mfu", "update_mfu"):
    assert result[k] > 0, k
  assert len(result["runs_s"]) == 2 and all(t > 0 for t in result["runs_s"])
  assert result["update_median_s"] == pytest.approx(float(np.median(result["runs_s"])))
  assert result["update_tokens_per_s"] == pytest.approx(4 * 16 / result["update_median_s"], rel=1e-6)
  assert result["update_mfu"] < 1.0


# --- a short run: export, and restore with another seed -------------------------------------------

TRAIN = [RUNLOCAL, "--config.reward.fn=dapo_jax.testing:length_reward", "--config.train.ckpt_every=1",
         "--config.optim.lr=1e-2", "--config.optim.warmup_steps=0", "--config.train.num_steps=2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("run"))
  lines = ok(launch("train", f"--workdir={workdir}", *TRAIN)).splitlines()
  # Where the run writes is said at its start and at its end.
  assert lines[0].startswith(f"writes to {workdir} ") and lines[-1].startswith(f"wrote {workdir} "), lines
  return workdir


@pytest.mark.slow
def test_export_loads_in_transformers_with_our_logits(trained, tmp_path):
  out = str(tmp_path / "exported")
  assert f"wrote rollout step 2 of {trained} to {out}" in ok(launch("export", RUNLOCAL, f"--workdir={trained}",
                                                                      f"--out={out}"))
  from transformers import AutoTokenizer
  tok = AutoTokenizer.from_pretrained(out)
  ids = np.asarray([tok.encode("What is 12+34?"), tok.encode("What is 99+1?!")[:len(tok.encode("What is 12+34?"))]])
  theirs, ours = transformers_logits(out, ids), our_logits(out, ids)
  np.testing.assert_allclose(theirs, ours, atol=1e-4)
  before = sorted(os.listdir(out))
  again = launch("export", RUNLOCAL, f"--workdir={trained}", f"--out={out}")  # No --overwrite: refused, intact.
  assert again.returncode == 1 and again.stderr.strip().splitlines()[-1] == (
      f"error: --out={out} already holds files; pass --overwrite to replace them")
  assert sorted(os.listdir(out)) == before
  # What was exported is the latest checkpoint: without it, the one before (rollout step 0 trains
  # at lr 0, so its parameters are the initial ones) gives other logits.
  import shutil
  older = str(tmp_path / "older")
  shutil.copytree(trained, older)
  shutil.rmtree(os.path.join(older, "checkpoints", "2"))
  out1 = str(tmp_path / "exported1")
  assert "wrote rollout step 1 of" in ok(launch("export", RUNLOCAL, f"--workdir={older}", f"--out={out1}"))
  assert np.abs(our_logits(out1, ids) - ours).max() > 1e-3


@pytest.mark.slow
def test_restore_with_another_seed_is_one_line(trained):
  out = launch("train", f"--workdir={trained}", *TRAIN[:-1], "--config.train.num_steps=3", "--config.seed=1")
  assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
  assert "Traceback" not in out.stderr
  assert out.stderr.strip().splitlines()[-1] == (
      f"error: checkpoint {os.path.join(trained, 'checkpoints')}/2 was written with seed=0, config has seed=1")


@pytest.mark.slow
def test_a_run_recorded_before_newer_settings_still_samples(trained, tmp_path):
  """A run's config.json written before a setting existed: the setting takes its default."""
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text(json.dumps({"prompt": "What is 3+4?"}) + "\n")
  path = os.path.join(trained, "config.json")
  with open(path) as f:
    recorded = f.read()
  older = json.loads(recorded)
  for section, field in (("data", "pan_and_scan"), ("model", "train_vision"), ("model", "sequence_attention")):
    del older[section][field]
  try:
    with open(path, "w") as f:
      json.dump(older, f)
    stdout = ok(launch("sample", f"--workdir={trained}", f"--prompts={prompts}", "--json",
                       "--config.rollout.max_new_tokens=3"))
    assert json.loads(stdout.strip().splitlines()[0])["prompt"].startswith("What is 3+4?")
  finally:
    with open(path, "w") as f:
      f.write(recorded)


def test_sample_eval_export_read_the_runs_own_config(trained, tmp_path):
  """No --config: the run's config.json (a runlocal recipe, not the default job's) is what they use;
  a --config.x=y override still applies on top."""
  with open(os.path.join(trained, "config.json")) as f:
    assert json.load(f)["model"]["embed_dim"] == 32  # runlocal's, not configs/default.py's
  stdout = ok(launch("sample", f"--workdir={trained}", "--prompt=What is 3+4?", "--json", "--k=2",
                     "--config.rollout.max_new_tokens=3"))
  rows = [json.loads(line) for line in stdout.strip().splitlines()]
  assert len(rows) == 2 and rows[0]["prompt"].startswith("What is 3+4?")
  # With an environment a sample is an episode, scored by the environment: one guess of the secret (the
  # ground truth), right (+1) or wrong (-1), read as the last integer the turn wrote.
  stdout = ok(launch("sample", f"--workdir={trained}", "--prompt=Guess my number.", "--ground_truth=7", "--json",
                     "--k=2", "--config.rollout.env=dapo_jax.envs.games:GuessNumberEnv",
                     "--config.rollout.env_args={\"max_guesses\": 1}", "--config.rollout.max_turns=2"))
  rows = [json.loads(line) for line in stdout.strip().splitlines()]
  assert len(rows) == 2 and all(r["ground_truth"] == "7" and r["turns"] == 1 for r in rows), rows
  for r in rows:
    written = re.findall(r"-?\d+", r["completion"])
    assert r["pred"] == (str(int(written[-1])) if written else ""), r
    assert r["score"] == (1.0 if r["pred"] == "7" else -1.0), r
  dump = str(tmp_path / "eval.jsonl.gz")
  out = json.loads(ok(launch("eval", f"--workdir={trained}", "--k=1", f"--dump={dump}")).strip().splitlines()[-1])
  assert out["rollout_step"] == 2 and out["num_prompts"] == 8 and "val/acc/mean@1" in out
  from dapo_jax import dumps
  rows = dumps.read(dump)
  assert len(rows) == 8 and sum(r["acc"] for r in rows) / 8 == out["val/acc/mean@1"]
  assert {r["policy_step"] for r in rows} == {2}
  # With an environment the evaluation runs episodes (as training's does): a wrong guess is answered.
  out = json.loads(ok(launch("eval", f"--workdir={trained}", "--k=1", f"--dump={dump}",
                             "--config.rollout.env=dapo_jax.envs.games:GuessNumberEnv",
                             "--config.rollout.env_args={\"max_guesses\": 2}", "--config.rollout.max_turns=2"))
                   .strip().splitlines()[-1])
  rows = dumps.read(dump)
  assert sum(r["acc"] for r in rows) / 8 == out["val/acc/mean@1"] < 1
  assert all(("higher" in r["response"] or "lower" in r["response"] or "one integer" in r["response"])
             for r in rows if not r["acc"])
  exported = str(tmp_path / "exported")
  assert f"wrote rollout step 2 of {trained} to {exported}" in ok(launch("export", f"--workdir={trained}",
                                                                         f"--out={exported}"))
  with open(os.path.join(exported, "config.json")) as f:
    assert json.load(f)["hidden_size"] == 32


@pytest.mark.slow
def test_a_resume_that_changes_the_model_shape_is_one_line(trained):
  out = launch("train", f"--workdir={trained}", *TRAIN, "--config.model.num_layers=3")
  assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
  assert out.stderr.strip().splitlines()[-1] == (
      f"error: {trained}/config.json: the run was started with model.num_layers=2, this config has "
      "model.num_layers=3; a run cannot change it (use another --workdir)")
