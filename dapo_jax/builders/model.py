"""The policy of a run, from its config: the tokenizer, the model's architecture and initial weights (random,
an HF or GGUF directory, or the SFT warm start, trained once and reused), its trainer, and a trained
policy restored from a run's checkpoints.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile

import jax

from dapo_jax import checkpoint, objectives, sharding, train_step
from dapo_jax.builders import record
from dapo_jax.builders.checks import ConfigError, typed
from dapo_jax.builders.task import datasets, episodes
from dapo_jax.data import images as images_lib
from dapo_jax.data import prompts as data_lib
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.hf import convert as hf
from dapo_jax.model import transformer as model_lib
from dapo_jax.pipelines import sft
from dapo_jax.settings import SFT_TASKS, pick


@typed
def gguf_model_dir(cfg, workdir: str) -> str:
  """The HF directory converted from `model.gguf` (a .gguf path, "smollm2" or "gemma3_270m"), made once per
  workdir."""
  from dapo_jax.hf import gguf
  out = os.path.join(workdir, "model")
  record.recover_model_dir(out)
  if os.path.exists(os.path.join(out, "model.safetensors")):
    return out
  assembled = [f for f in os.listdir(out) if f.endswith(".gguf")] if os.path.isdir(out) else []  # Gemma's.
  record.check_model_dir(out, "model.gguf's conversion", extra=assembled)

  def convert(tmp):
    if cfg.model.gguf == "gemma3_270m":  # Assembled from its PyPI parts, checked against its SHA-256.
      path, sha256 = gguf.gemma3_270m_path(tmp)
    else:
      path, sha256 = gguf.smollm2_path() if cfg.model.gguf == "smollm2" else cfg.model.gguf, None
    gguf.to_hf_dir(path, tmp, sha256=sha256)

  return record.write_model_dir(out, convert)


@typed
def tokenizer(cfg, workdir: str, corpus_examples=None):
  if cfg.model.init == "gguf":
    return tokenizer_lib.load(gguf_model_dir(cfg, workdir))
  path = cfg.tokenizer.path or (cfg.model.hf_dir if cfg.model.init == "hf" else "")
  if path:
    return tokenizer_lib.load(path)
  path = os.path.join(workdir, "tokenizer")
  if not os.path.exists(os.path.join(path, "tokenizer.json")):
    if not corpus_examples:
      raise ValueError("tokenizer.path is empty and there is no task text to train a tokenizer on")
    # The task's own text: prompts, and what a good answer looks like (the arith task's worked
    # solutions; a file's ground-truth answers, which is all a dataset file has).
    answer = ((lambda ex: data_lib.arith_solution(ex, cfg.data.solution_style)) if cfg.data.task == "arith"
              else (lambda ex: f"Answer: {ex.ground_truth}"))
    texts = [" ".join(m["content"] for m in ex.messages) + "\n" + answer(ex) for ex in corpus_examples[:5000]]
    texts += ["user", "assistant", "system"] * 10
    template = True
    if cfg.rollout.env:  # Episodes: a template with tools, and its text (tool calls, results) in the corpus.
      template = tokenizer_lib.CHATML_TOOLS_TEMPLATE
      tools = _corpus_tools(cfg, corpus_examples[0])
      texts += [tokenizer_lib.render_template(template, ex.messages, tools=tools) + answer(ex)
                + f"\n<tool_response>\n{ex.ground_truth}\n</tool_response>" for ex in corpus_examples[:2000]]
    # Trained aside, then renamed into place: another process of the run that finds the directory finds
    # it whole (each trains the same tokenizer; the first rename wins).
    os.makedirs(workdir, exist_ok=True)
    aside = tempfile.mkdtemp(prefix=".tokenizer-", dir=workdir)
    images = images_lib.image_tokens(cfg.model.vision.kind) if cfg.model.vision.image_size else ()
    tokenizer_lib.train_bpe(aside, texts, vocab_size=cfg.tokenizer.vocab_size, chat_template=template,
                            extra_special=images)
    try:
      os.rename(aside, path)
    except OSError:
      shutil.rmtree(aside, ignore_errors=True)
      if not os.path.exists(os.path.join(path, "tokenizer.json")):
        raise
    logging.info("trained a %d-token BPE tokenizer into %s", cfg.tokenizer.vocab_size, path)
  return tokenizer_lib.load(path)


def _corpus_tools(cfg, example) -> list[dict] | None:
  """The tool schemas the environment's prompts show, for the tokenizer's corpus."""
  make_env, _ = episodes(cfg)
  env = make_env()
  env.reset(example)
  return env.tools


@typed
def model_config(cfg, vocab_size: int) -> model_lib.ModelConfig:
  """The architecture of `model` for a tokenizer of `vocab_size` (padded) tokens."""
  return cfg.model.architecture(vocab_size)


@typed
def runtime_overrides(cfg) -> dict:
  return cfg.model.runtime_overrides()


@typed
def lora_config(cfg):
  return cfg.model.lora_config()


def padded_vocab(tok) -> int:
  """The vocabulary of a model built here for `tok`: rounded up to 64 (tidy shapes, room for tensor sharding)."""
  return ((len(tok) + 63) // 64) * 64


def bf16_cpu_warning(matmul_dtype: str, backend: str, cpuinfo: str) -> str | None:
  """A warning when bf16 matmuls are asked of a CPU without the instructions that make them fast."""
  if matmul_dtype != "bfloat16" or backend != "cpu" or not cpuinfo:
    return None
  if "avx512_bf16" in cpuinfo or "amx_bf16" in cpuinfo:
    return None
  return ("model.matmul_dtype/dtype is bfloat16 on a CPU without AVX512-BF16 or AMX-BF16, the "
          "instructions that make bf16 matmuls faster than float32 here; compare "
          "`python -m launch.bench train --matmul_dtype=bfloat16` with the float32 default")


def _cpuinfo() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return f.read()
  except OSError:  # Not Linux: nothing to check.
    return ""


@typed
def initial_model(cfg, workdir: str, tok, mesh, train_examples):
  """(ModelConfig, params) as `model.init` says: random, an HF directory, or the SFT warm start."""
  warning = bf16_cpu_warning(cfg.model.matmul_dtype or cfg.model.dtype, jax.default_backend(), _cpuinfo())
  if warning:
    logging.warning(warning)
  init = cfg.model.init
  if init in ("hf", "gguf"):
    path = cfg.model.hf_dir if init == "hf" else gguf_model_dir(cfg, workdir)
    model_cfg, params = hf.load(path, **cfg.model.runtime_overrides())
    tokenizer_lib.check_vocab(tok, model_cfg.vocab_size, f"{path}/config.json")
    return model_cfg, params
  vocab = padded_vocab(tok)
  model_cfg = cfg.model.architecture(vocab, tok)
  tokenizer_lib.check_vocab(tok, model_cfg.vocab_size, f"model.vocab_size={cfg.model.vocab_size}")
  if init == "random":
    return model_cfg, model_lib.init_params(model_cfg, jax.random.key(cfg.seed))
  if init == "sft":
    sft_dir = os.path.join(workdir, "sft_model")
    record.recover_model_dir(sft_dir)
    if not os.path.exists(os.path.join(sft_dir, "model.safetensors")):
      record.check_model_dir(sft_dir, "the SFT warm start")  # Never replaces a user's files.
      params = sft.run(sft_config(cfg), model_cfg, tok, train_examples, mesh, os.path.join(workdir, "sft"))
      if jax.process_index() == 0:
        params = jax.device_get(params)
        record.write_model_dir(sft_dir, lambda d: hf.save(d, model_cfg, params, tokenizer=tok))
    loaded_cfg, params = hf.load(sft_dir, **cfg.model.runtime_overrides())
    return loaded_cfg, params
  raise ValueError(f"model.init={init!r}; expected 'random', 'hf' or 'sft'")


@typed
def warm_start(cfg, workdir: str, mesh) -> str:
  """Trains the SFT warm start of `cfg` (`model.init="sft"`) into WORKDIR/sft_model (its tokenizer into
  WORKDIR/tokenizer) unless it is there, as a run would, and returns that HF directory: what
  `launch.train --warm_start_only` writes for runs that share one start (sweeps, ablations)."""
  if cfg.model.init != "sft":
    raise ConfigError(f"model.init={cfg.model.init!r}: only the SFT warm start (model.init='sft') is trained "
                      "ahead of a run")
  train, _ = datasets(cfg)
  tok = tokenizer(cfg, workdir, train)
  initial_model(cfg, workdir, tok, mesh, train)
  return os.path.join(workdir, "sft_model")


@typed
def model_dir(cfg, workdir: str) -> str:
  """The HF directory the policy is loaded from ("" for a model built here)."""
  if cfg.model.init == "hf":
    return cfg.model.hf_dir
  if cfg.model.init == "gguf":
    return gguf_model_dir(cfg, workdir)
  return ""


@typed
def trained_model(cfg, workdir: str):
  """(tokenizer, ModelConfig) of the policy a run in `workdir` trains, from the files the run wrote."""
  if cfg.model.init in ("hf", "gguf"):
    source = model_dir(cfg, workdir)
    return tokenizer_lib.load(cfg.tokenizer.path or source), hf.load_config(source, **cfg.model.runtime_overrides())
  tok_dir = cfg.tokenizer.path or os.path.join(workdir, "tokenizer")
  tok = tokenizer_lib.load(tok_dir)
  if cfg.model.init == "sft":
    return tok, hf.load_config(os.path.join(workdir, "sft_model"), **cfg.model.runtime_overrides())
  return tok, cfg.model.architecture(padded_vocab(tok), tok)


@typed
def chat_tokenizer(cfg, workdir: str, convs):
  """`tokenizer.path` (or the HF model's), else a BPE trained on the conversations into WORKDIR/tokenizer."""
  path = cfg.tokenizer.path or (cfg.model.hf_dir if cfg.model.init == "hf" else "")
  if path:
    return tokenizer_lib.load(path)
  path = os.path.join(workdir, "tokenizer")
  if not os.path.exists(os.path.join(path, "tokenizer.json")):
    from dapo_jax.pipelines import sft_chat  # noqa: PLC0415
    texts = sft_chat.corpus(convs[:5000]) + ["user", "assistant", "system"] * 10
    tokenizer_lib.train_bpe(path, texts, vocab_size=cfg.tokenizer.vocab_size)
  return tokenizer_lib.load(path)


@typed
def sft_config(cfg):
  """The SFT warm start's `sft.SFTConfig`."""
  if cfg.data.task not in SFT_TASKS:
    raise ConfigError(f"the SFT warm start needs reference solutions, which only data.task in {SFT_TASKS} "
                      "have; use model.init='hf' for other tasks")
  return pick(sft.SFTConfig, cfg.sft, seed=cfg.seed, chat_template=cfg.data.chat_template,
              solution_style=cfg.data.solution_style, microbatch_tokens=cfg.train.microbatch_tokens)


@typed
def trainer(cfg, model_cfg: model_lib.ModelConfig, mesh, objective) -> train_step.Trainer:
  if cfg.model.train_vision and model_cfg.vision is None:
    raise ConfigError("model.train_vision=True: the model has no vision tower (a text model)")
  return train_step.Trainer(model_cfg, cfg.optim.library(), mesh, objective,
                            num_microbatches=cfg.train.num_microbatches,
                            microbatch_tokens=cfg.train.microbatch_tokens, lora=cfg.model.lora_config(), seed=cfg.seed,
                            train_vision=cfg.model.train_vision)


@typed
def restore_policy(cfg, workdir: str, mesh=None):
  """(model_cfg, params, tokenizer, rollout step) of the newest checkpoint in `workdir`, without
  building a training run (no datasets, reward workers or SFT): for `launch.eval` and `launch.export`."""
  mesh = mesh if mesh is not None else sharding.make_mesh(cfg.mesh.to_dict())
  none = checkpoint.CheckpointMismatchError(f"{workdir} holds no checkpoint ({os.path.join(workdir, 'checkpoints')} "
                                            "is empty or missing): train first, or pass --model_dir=HF_DIR")
  if "://" not in workdir and not os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise none  # Before the checkpointer, which would create the directory it looks in.
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), keep=cfg.train.keep_ckpts)
  try:
    if ckpt.latest_step() is None:
      raise none
    tok, model_cfg = trained_model(cfg, workdir)
    trainer_ = trainer(cfg, model_cfg, mesh, objectives.language_model(model_cfg))
    abstract_state = jax.eval_shape(lambda: trainer_.init(jax.random.key(0)))
    step, state, _ = ckpt.restore_latest(checkpoint.abstract(abstract_state, trainer_.state_sharding))
    return model_cfg, state.params, tok, step
  finally:
    ckpt.close()


@typed
def served_policy(cfg, workdir, hf_dir, adapter_dir, mesh):
  """(model_cfg, params, tokenizer, source dir, name) of what `launch.serve` serves: `hf_dir` (with a
  PEFT adapter) or the newest checkpoint in `workdir` (a run trained with `cfg`)."""
  from dapo_jax.hf import peft
  from dapo_jax.model import lora as lora_lib
  if hf_dir:
    model_cfg, params = hf.load(hf_dir, **cfg.model.runtime_overrides())
    tok = tokenizer_lib.load(cfg.tokenizer.path or hf_dir)
    if adapter_dir:
      lora_cfg, adapters = peft.load_peft(adapter_dir, model_cfg)
      params = lora_lib.adapt(model_cfg, lora_cfg, params, jax.random.key(0), adapters)
    return model_cfg, params, tok, hf_dir, os.path.basename(os.path.normpath(adapter_dir or hf_dir))
  if adapter_dir:
    raise ValueError("--adapter_dir goes with --model_dir (its base model)")
  model_cfg, params, tok, _ = restore_policy(cfg, workdir, mesh)
  return model_cfg, params, tok, model_dir(cfg, workdir), os.path.basename(os.path.normpath(workdir))
