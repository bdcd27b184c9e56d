"""The launch boundary: validates a config and builds what a run needs from it.

`validate(cfg)` refuses every setting that cannot work before anything is built. The builders
turn the ConfigDict into the library's frozen dataclasses and objects (tokenizer, datasets, model
config and initial params, sampler, rollout, evaluator, trainer, `loop.DAPO`): nothing below this
module reads a ConfigDict.

The default job is self-contained: with no paths set it trains its own tokenizer on the task's
text, initialises a small model and warm-starts it with SFT (the result is saved in the workdir
and reused by later runs).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os

import jax

from dapo_jax import advantages as adv_lib
from dapo_jax import checkpoint, evaluate, hf, loop, objectives, optim, sampling, sharding, train_step
from dapo_jax import data as data_lib
from dapo_jax import lora as lora_lib
from dapo_jax import loss as loss_lib
from dapo_jax import model as model_lib
from dapo_jax import rewards as rewards_lib
from dapo_jax import rollout as rollout_lib
from dapo_jax import tokenizer as tokenizer_lib

# Fields that are not in an HF config.json: they apply to a loaded model too.
_RUNTIME_FIELDS = ("param_dtype", "dtype", "matmul_dtype", "remat", "attn_chunk")
_MODEL_FIELDS = ("embed_dim", "mlp_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "rope_theta",
                 "norm_eps", "qkv_bias", "tie_embeddings", "arch", "qk_norm", "rope_type", "rope_factor",
                 "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_pos", "rope_beta_fast",
                 "rope_beta_slow", "rope_attention_factor", "rope_truncate", "sliding_window", "local_layers",
                 "rope_local_theta", "query_scale", "attn_softcap", "final_softcap") + _RUNTIME_FIELDS


class ConfigError(ValueError):
  """A config value that cannot work; the message names the field and the allowed values."""


_LOSS_AGG = loss_lib.AGG_MODES
_REMAT = ("none", "full", "dots")
_INIT = ("random", "hf", "gguf", "sft")
_DTYPES = ("float32", "bfloat16", "float16")


def _check(ok, field: str, value, allowed: str) -> None:
  if not ok:
    raise ConfigError(f"{field}={value!r}: expected {allowed}")


def _number(cfg, field: str, lo=None, hi=None, *, lo_open=False, hi_open=False, integer=False, allowed=""):
  """The value of `field` (dotted), checked to be a number in the given range."""
  v = cfg
  for k in field.split("."):
    v = v[k]
  kind = "an integer" if integer else "a number"
  if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)) or v != v:
    raise ConfigError(f"{field}={v!r}: expected {kind}{' ' + allowed if allowed else ''}")
  bad_lo = lo is not None and (v <= lo if lo_open else v < lo)
  bad_hi = hi is not None and (v >= hi if hi_open else v > hi)
  if bad_lo or bad_hi:
    if not allowed:
      parts = []
      if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo}")
      if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {hi}")
      allowed = " and ".join(parts)
    raise ConfigError(f"{field}={v!r}: expected {allowed}")
  return v


def validate(cfg, num_devices: int | None = None) -> None:
  """Refuses, before anything is built, every setting that cannot work, naming the field and the
  allowed range. `num_devices` (default: this process's view, `jax.device_count()`) checks the mesh;
  pass the target's count to check a config for another machine."""
  c = cfg
  m, d, r, t = c.model, c.dapo, c.rollout, c.train
  n = functools.partial(_number, c)

  # Model.
  _check(m.init in _INIT, "model.init", m.init, f"one of {_INIT}")
  _check(m.remat in _REMAT, "model.remat", m.remat, f"one of {_REMAT}")
  for f in ("param_dtype", "dtype"):
    _check(m[f] in _DTYPES, f"model.{f}", m[f], f"one of {_DTYPES}")
  _check(m.matmul_dtype in ("",) + _DTYPES, "model.matmul_dtype", m.matmul_dtype, f"'' or one of {_DTYPES}")
  lora_config(c)
  n("model.vocab_size", 0, integer=True)
  n("model.attn_chunk", 0, integer=True)
  if m.init in ("random", "sft"):
    for f in ("embed_dim", "mlp_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
      n(f"model.{f}", 1, integer=True)
    _check(m.num_heads % m.num_kv_heads == 0, "model.num_heads", m.num_heads,
           f"a multiple of model.num_kv_heads={m.num_kv_heads}")
    _check(m.head_dim % 2 == 0, "model.head_dim", m.head_dim, "an even number (rotary embeddings)")
    n("model.rope_theta", 0, lo_open=True)
    n("model.norm_eps", 0, lo_open=True)
  n("tokenizer.vocab_size", 1, integer=True)

  # Data.
  _check(c.data.task in ("arith", "file"), "data.task", c.data.task, "'arith' or 'file'")
  if c.data.task == "file":
    _check(any(c.data.train_files), "data.train_files", tuple(c.data.train_files),
           "at least one dataset file when data.task='file'")
  else:
    n("data.digits", 1, integer=True)
    n("data.digits_b", 0, integer=True)
    n("data.fewshot", 0, integer=True)
    n("data.heldout_fraction", 0, 1, lo_open=True, hi_open=True)
  _check(c.data.missing_answer in ("error", "skip"), "data.missing_answer", c.data.missing_answer,
         "'error' or 'skip'")
  _check(c.data.solution_style in ("steps", "direct"), "data.solution_style", c.data.solution_style,
         "'steps' or 'direct'")
  P = n("data.max_prompt_len", 1, integer=True)
  for b in c.data.prompt_buckets:
    _check(isinstance(b, int) and 1 <= b <= P, "data.prompt_buckets", tuple(c.data.prompt_buckets),
           f"prompt lengths from 1 to data.max_prompt_len={P}")
  n("data.num_eval", 0, integer=True)
  if m.init == "sft":
    _check(c.data.task == "arith", "model.init", m.init,
           "'random', 'hf' or 'gguf' when data.task='file' (the SFT warm start needs the arith task's "
           "reference solutions)")

  # Sampling, for rollouts and for evaluation.
  G = n("rollout.group_size", 2, integer=True,
        allowed=">= 2 (group-normalised advantages are 0 for a group of one)")
  C = n("rollout.max_new_tokens", 1, integer=True)
  for p in ("rollout", "eval"):
    n(f"{p}.temperature", 0, allowed=">= 0 (0 = greedy)")
    n(f"{p}.top_p", 0, 1, lo_open=True, allowed="in (0, 1]")
  n("rollout.top_k", 0, integer=True, allowed=">= 0 (0 = off)")
  n("eval.k", 1, integer=True)
  n("eval.max_new_tokens", 0, integer=True, allowed=">= 0 (0 = rollout.max_new_tokens)")

  # Objective.
  n("dapo.eps_low", 0, 1, lo_open=True, hi_open=True)
  n("dapo.eps_high", 0, lo_open=True)
  c_dual = n("dapo.clip_ratio_c", 0)
  _check(c_dual == 0 or c_dual > 1, "dapo.clip_ratio_c", c_dual, "0 (off) or > 1 (dual clip)")
  _check(d.loss_agg in _LOSS_AGG, "dapo.loss_agg", d.loss_agg, f"one of {_LOSS_AGG}")
  _check(d.on_cap in ("train", "raise"), "dapo.on_cap", d.on_cap, "'train' or 'raise'")
  _check(d.filter_metric in adv_lib.FILTER_METRICS, "dapo.filter_metric", d.filter_metric,
         f"one of {adv_lib.FILTER_METRICS}")
  _check(r.stop in tokenizer_lib.STOP_MODES, "rollout.stop", r.stop, f"one of {tokenizer_lib.STOP_MODES}")
  _check(d.kl_estimator in ("k1", "k3"), "dapo.kl_estimator", d.kl_estimator, "'k1' or 'k3'")
  n("dapo.kl_coef", 0)
  n("dapo.overlong_buffer", 0, C, integer=True, allowed=f"from 0 to rollout.max_new_tokens={C}")
  n("dapo.overlong_penalty", 0)
  n("dapo.max_gen_batches", 0, integer=True, allowed=">= 0 (0 = unlimited)")
  n("reward.timeout_s", 0, lo_open=True)
  n("reward.workers", 1, integer=True)
  _check(isinstance(c.reward.fn, str) and ":" in c.reward.fn, "reward.fn", c.reward.fn, "'package.module:function'")

  # Batch arithmetic.
  Q = n("dapo.prompts_per_step", 1, integer=True)
  if d.dynamic_sampling:
    n("dapo.gen_prompts", Q, integer=True, allowed=f">= dapo.prompts_per_step={Q} when dynamic sampling is on")
  elif d.gen_prompts != Q:
    logging.info("dynamic sampling is off: each step generates dapo.prompts_per_step prompts")
  gen_rows = (d.gen_prompts if d.dynamic_sampling else Q) * G
  chunk = n("rollout.rows_per_call", 0, integer=True, allowed=">= 0 (0 = the whole generation batch)")
  _check(chunk == 0 or (chunk % G == 0 and gen_rows % chunk == 0), "rollout.rows_per_call", chunk,
         f"0, or a multiple of rollout.group_size={G} that divides the {gen_rows} rows of a generation batch")
  mb = n("train.minibatches", 1, integer=True)
  n("train.ppo_epochs", 1, integer=True)
  micro = n("train.num_microbatches", 0, integer=True, allowed=">= 1, or 0 (auto)")
  n("train.microbatch_tokens", 1, integer=True, allowed="a positive token budget")
  rows = Q * G
  per_mb = rows // mb if rows % mb == 0 else None
  if per_mb is None or per_mb % (micro or 1):
    raise ConfigError(f"train batch of {Q} prompts x {G} = {rows} rows does not split into "
                      f"train.minibatches={mb} x train.num_microbatches={micro}")
  if t.share_prompt and micro and (per_mb // micro) % G:
    raise ConfigError(f"train.share_prompt needs whole groups per micro-batch: {per_mb // micro} rows "
                      f"per micro-batch is not a multiple of rollout.group_size={G} "
                      "(change train.minibatches / train.num_microbatches, or set train.share_prompt=False)")
  for f in ("num_steps", "ckpt_every", "eval_every", "log_samples_every"):
    n(f"train.{f}", 0, integer=True)
  n("train.keep_ckpts", 1, integer=True)
  n("train.max_bad_steps", 1, integer=True)

  # Optimiser.
  n("optim.lr", 0)
  n("optim.warmup_steps", 0, integer=True)
  n("optim.weight_decay", 0)
  n("optim.grad_clip", 0, allowed=">= 0 (0 = off)")
  n("optim.b1", 0, 1, hi_open=True)
  n("optim.b2", 0, 1, hi_open=True)
  n("optim.eps", 0, lo_open=True)

  # SFT warm start.
  if m.init == "sft":
    for f in ("steps", "warmup_steps"):
      n(f"sft.{f}", 0, integer=True)
    for f in ("batch_size", "seq_len", "num_examples", "probe_size", "probe_every"):
      n(f"sft.{f}", 1, integer=True)
    n("sft.lr", 0)
    n("sft.target_acc", 0, 1)

  # Lengths: prompt + completion within the model's positions, where the model states them.
  if m.init == "hf" and m.hf_dir:
    limit = _max_positions(m.hf_dir)
    if limit and P + C > limit:
      raise ConfigError(f"data.max_prompt_len={P} + rollout.max_new_tokens={C} = {P + C} tokens exceeds the "
                        f"model's max_position_embeddings={limit} ({m.hf_dir}/config.json)")

  # Mesh against the devices, and the batch over its data shards.
  sizes = {}
  for a in ("data", "fsdp", "tensor"):
    v = c.mesh.get(a, 1)
    _check(isinstance(v, int) and not isinstance(v, bool) and (v >= 1 or v == -1), f"mesh.{a}", v,
           "a positive size, or -1 for the rest of the devices")
    sizes[a] = v
  if list(sizes.values()).count(-1) > 1:
    raise ConfigError(f"mesh={sizes}: at most one axis may be -1 (the rest of the devices)")
  if num_devices is None:
    num_devices = jax.device_count()
  fixed = math.prod(v for v in sizes.values() if v != -1)
  if -1 in sizes.values():
    if num_devices % fixed:
      raise ConfigError(f"mesh={sizes}: the fixed axes multiply to {fixed}, which does not divide the "
                        f"{num_devices} devices")
    sizes = {a: (num_devices // fixed if v == -1 else v) for a, v in sizes.items()}
  elif fixed != num_devices:
    raise ConfigError(f"mesh={sizes}: data*fsdp*tensor = {fixed}, but there are {num_devices} devices")
  shards = sizes["data"] * sizes["fsdp"]
  if per_mb % shards:
    raise ConfigError(f"train.minibatches={mb}: {per_mb} rows per mini-batch do not split over the "
                      f"mesh's data*fsdp = {shards} batch shards")


def _max_positions(hf_dir: str) -> int:
  try:
    with open(os.path.join(hf_dir, "config.json")) as f:
      return int(json.load(f).get("max_position_embeddings") or 0)
  except (OSError, ValueError, TypeError, AttributeError):
    return 0  # hf.load names what is wrong with the directory.


def datasets(cfg) -> tuple[list[data_lib.Example], list[data_lib.Example]]:
  """(train, held-out) examples."""
  d = cfg.data
  if d.task == "arith":
    kw = dict(seed=cfg.seed, digits=d.digits, ops=d.ops, heldout_fraction=d.heldout_fraction,
              digits_b=d.digits_b, fewshot=d.fewshot)
    if d.prompt_template:
      kw["template"] = d.prompt_template
    return (data_lib.arith_examples(max(cfg.sft.num_examples, 4096), split="train", **kw),
            data_lib.arith_examples(d.num_eval, split="heldout", **kw))
  if d.task != "file":
    raise ValueError(f"data.task={d.task!r}; expected 'file' or 'arith'")
  files = [f for f in d.train_files if f]
  if not files:
    raise ValueError("data.train_files is empty; set --config.data.train_files=/path/to/train.parquet")
  template = d.prompt_template or None
  load = lambda f: data_lib.load_file(f, missing_answer=d.missing_answer, prompt_template=template)
  train = [ex for f in files for ex in load(f)]
  evals = [ex for f in d.eval_files if f for ex in load(f)]
  return train, evals[: d.num_eval] if d.num_eval else evals


def gguf_model_dir(cfg, workdir: str) -> str:
  """The HF directory converted from `model.gguf` (a .gguf path, or "smollm2"), made once per workdir."""
  from dapo_jax import gguf
  out = os.path.join(workdir, "model")
  if not os.path.exists(os.path.join(out, "model.safetensors")):
    path = gguf.smollm2_path() if cfg.model.gguf == "smollm2" else cfg.model.gguf
    gguf.to_hf_dir(path, out)
  return out


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
    tokenizer_lib.train_bpe(path, texts, vocab_size=cfg.tokenizer.vocab_size)
    logging.info("trained a %d-token BPE tokenizer into %s", cfg.tokenizer.vocab_size, path)
  return tokenizer_lib.load(path)


def model_config(cfg, vocab_size: int) -> model_lib.ModelConfig:
  fields = {k: cfg.model[k] for k in _MODEL_FIELDS if k in cfg.model}  # Family fields default.
  v = cfg.model.vocab_size or vocab_size
  return model_lib.ModelConfig(vocab_size=v, **fields)


def runtime_overrides(cfg) -> dict:
  """The config's model fields that apply to a model loaded from disk (not in its config.json)."""
  return {k: cfg.model[k] for k in _RUNTIME_FIELDS}


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


def initial_model(cfg, workdir: str, tok, mesh, train_examples):
  """(ModelConfig, params) as `model.init` says: random, an HF directory, or the SFT warm start."""
  warning = bf16_cpu_warning(cfg.model.matmul_dtype or cfg.model.dtype, jax.default_backend(), _cpuinfo())
  if warning:
    logging.warning(warning)
  init = cfg.model.init
  if init in ("hf", "gguf"):
    path = cfg.model.hf_dir if init == "hf" else gguf_model_dir(cfg, workdir)
    model_cfg, params = hf.load(path, **runtime_overrides(cfg))
    tokenizer_lib.check_vocab(tok, model_cfg.vocab_size, f"{path}/config.json")
    return model_cfg, params
  vocab = ((len(tok) + 63) // 64) * 64  # Round up: tidy shapes, room for tensor sharding.
  model_cfg = model_config(cfg, vocab)
  tokenizer_lib.check_vocab(tok, model_cfg.vocab_size, f"model.vocab_size={cfg.model.vocab_size}")
  if init == "random":
    return model_cfg, model_lib.init_params(model_cfg, jax.random.key(cfg.seed))
  if init == "sft":
    sft_dir = os.path.join(workdir, "sft_model")
    if not os.path.exists(os.path.join(sft_dir, "model.safetensors")):
      from dapo_jax import sft
      params = sft.run(sft_config(cfg), model_cfg, tok, train_examples, mesh)
      if jax.process_index() == 0:
        hf.save(sft_dir, model_cfg, jax.device_get(params), tokenizer=tok)
    loaded_cfg, params = hf.load(sft_dir, **runtime_overrides(cfg))
    return loaded_cfg, params
  raise ValueError(f"model.init={init!r}; expected 'random', 'hf' or 'sft'")


# --- Builders: ConfigDict -> the library's dataclasses and objects -------------------------------

def model_dir(cfg, workdir: str) -> str:
  """The HF directory the policy is loaded from ("" for a model built here)."""
  if cfg.model.init == "hf":
    return cfg.model.hf_dir
  if cfg.model.init == "gguf":
    return gguf_model_dir(cfg, workdir)
  return ""


def sampler_config(cfg, tok, source_dir: str = "") -> sampling.SamplerConfig:
  r = cfg.rollout
  return sampling.SamplerConfig(
      max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
      eos_ids=tokenizer_lib.stop_ids(tok, source_dir, r.stop), pad_id=tok.pad_token_id)


def eval_sampler_config(cfg, sampler_cfg: sampling.SamplerConfig) -> sampling.SamplerConfig:
  e = cfg.eval
  return dataclasses.replace(sampler_cfg, temperature=e.temperature, top_p=e.top_p, top_k=0,
                             max_new_tokens=e.max_new_tokens or sampler_cfg.max_new_tokens)


def rollout_config(cfg) -> rollout_lib.RolloutConfig:
  d = cfg.dapo
  return rollout_lib.RolloutConfig(
      max_prompt_len=cfg.data.max_prompt_len, prompt_buckets=tuple(cfg.data.prompt_buckets),
      chat_template=cfg.data.chat_template, rows_per_call=cfg.rollout.rows_per_call,
      overlong_buffer=d.overlong_buffer, overlong_penalty=d.overlong_penalty, filter_metric=d.filter_metric)


def pg_config(cfg) -> objectives.PGConfig:
  d, t = cfg.dapo, cfg.train
  return objectives.PGConfig(
      eps_low=d.eps_low, eps_high=d.eps_high, clip_ratio_c=d.clip_ratio_c if d.clip_ratio_c > 0 else None,
      loss_agg=d.loss_agg, verl_microbatch_weighting=d.verl_microbatch_weighting,
      temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,  # greedy: unscaled
      kl_coef=d.kl_coef, kl_estimator=d.kl_estimator, old_is_current=t.minibatches * t.ppo_epochs == 1,
      group_size=cfg.rollout.group_size if t.share_prompt else 0)


def loop_config(cfg) -> loop.LoopConfig:
  d, t = cfg.dapo, cfg.train
  return loop.LoopConfig(
      num_steps=t.num_steps, prompts_per_step=d.prompts_per_step, group_size=cfg.rollout.group_size,
      gen_prompts=d.gen_prompts, dynamic_sampling=d.dynamic_sampling, max_gen_batches=d.max_gen_batches,
      on_cap=d.on_cap, carry_over=d.carry_over, norm_adv_by_std=d.norm_adv_by_std,
      overlong_filter=d.overlong_filter, minibatches=t.minibatches, ppo_epochs=t.ppo_epochs,
      reference=d.kl_coef > 0, seed=cfg.seed, ckpt_every=t.ckpt_every, eval_every=t.eval_every,
      log_samples_every=t.log_samples_every, max_bad_steps=t.max_bad_steps)


def sft_config(cfg):
  """The SFT warm start's `sft.SFTConfig`."""
  from dapo_jax import sft  # noqa: PLC0415 (sft imports train_step; only SFT runs need it)
  s = cfg.sft
  if cfg.data.task != "arith":
    raise ConfigError("the SFT warm start needs reference solutions, which only data.task='arith' has; "
                      "use model.init='hf' for other tasks")
  return sft.SFTConfig(steps=s.steps, batch_size=s.batch_size, seq_len=s.seq_len, lr=s.lr,
                       warmup_steps=s.warmup_steps, num_examples=s.num_examples, target_acc=s.target_acc,
                       probe_size=s.probe_size, probe_every=s.probe_every, seed=cfg.seed,
                       chat_template=cfg.data.chat_template, solution_style=cfg.data.solution_style,
                       microbatch_tokens=cfg.train.microbatch_tokens)


def lora_config(cfg) -> lora_lib.LoraConfig | None:
  """LoRA adapters on a frozen base (model.lora.rank > 0), or None: full fine-tuning."""
  m = cfg.model
  quant = m.get("base_quant", "")
  if m.get("lora") is None or m.lora.rank == 0:
    _check(not quant, "model.base_quant", quant, "'' without LoRA (only a frozen base is quantized: set model.lora.rank)")
    return None
  try:
    return lora_lib.LoraConfig(rank=m.lora.rank, alpha=m.lora.alpha, dropout=m.lora.dropout,
                               targets=tuple(m.lora.targets), base_quant=quant)
  except lora_lib.LoraError as e:
    raise ConfigError(str(e)) from None


def trainer(cfg, model_cfg: model_lib.ModelConfig, mesh, objective) -> train_step.Trainer:
  return train_step.Trainer(model_cfg, optim.OptimConfig(**cfg.optim), mesh, objective,
                            num_microbatches=cfg.train.num_microbatches,
                            microbatch_tokens=cfg.train.microbatch_tokens, lora=lora_config(cfg))


def evaluator(cfg, rollout: rollout_lib.Rollout, examples) -> evaluate.Evaluator:
  # Chunks of the rollout's row count, so the compiled sampler shapes are few.
  rows = max(cfg.dapo.gen_prompts * cfg.rollout.group_size // cfg.eval.k, 1)
  return evaluate.Evaluator(rollout, examples, k=cfg.eval.k, sampler_cfg=eval_sampler_config(cfg, rollout.sampler_cfg),
                            greedy=cfg.eval.greedy, seed=cfg.seed, rows=rows)


def dapo(cfg, workdir: str, mesh=None) -> loop.DAPO:
  """Everything one DAPO run needs, built from its config (a context manager: see `loop.DAPO`)."""
  mesh = mesh if mesh is not None else sharding.make_mesh(cfg.mesh)
  validate(cfg)  # Before any worker process, compile or generation.
  os.makedirs(workdir, exist_ok=True)
  reward = rewards_lib.RewardPool(cfg.reward.fn, cfg.reward.timeout_s, cfg.reward.workers)
  try:
    train, evals = datasets(cfg)
    tok = tokenizer(cfg, workdir, train)
    for ex in train[:1]:
      tokenizer_lib.render(tok, ex.messages, cfg.data.chat_template)  # Template errors now.
    model_cfg, params = initial_model(cfg, workdir, tok, mesh, train)
    pg = pg_config(cfg)
    trainer_ = trainer(cfg, model_cfg, mesh, objectives.policy_gradient(model_cfg, pg))
    logprobs = trainer_.forward(objectives.completion_logprobs(model_cfg, pg.temperature, pg.group_size))
    rollout = rollout_lib.Rollout(tok, model_cfg, mesh, rollout_config(cfg),
                                  sampler_config(cfg, tok, model_dir(cfg, workdir)), reward)
    data_iter = data_lib.PromptIterator(train, seed=cfg.seed, process_index=jax.process_index(),
                                        process_count=jax.process_count())
    return loop.DAPO(loop_config(cfg), trainer=trainer_, logprobs=logprobs, rollout=rollout,
                     evaluator=evaluator(cfg, rollout, evals), data_iter=data_iter, params=params,
                     workdir=workdir, keep_ckpts=cfg.train.keep_ckpts)
  except BaseException:
    reward.close()
    raise


def restore_policy(cfg, workdir: str, mesh=None):
  """(model_cfg, params, tokenizer, rollout step) of the newest checkpoint in `workdir`, without
  building a training run (no datasets, reward workers or SFT): for `launch.eval` and `launch.export`."""
  mesh = mesh if mesh is not None else sharding.make_mesh(cfg.mesh)
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), keep=cfg.train.keep_ckpts)
  try:
    if ckpt.latest_step() is None:
      raise checkpoint.CheckpointMismatchError(
          f"{workdir} holds no checkpoint ({os.path.join(workdir, 'checkpoints')} is empty or missing): "
          "train first, or pass --model_dir=HF_DIR")
    tok, model_cfg = trained_model(cfg, workdir)
    trainer_ = trainer(cfg, model_cfg, mesh, objectives.language_model(model_cfg))
    abstract_state = jax.eval_shape(lambda: trainer_.init(jax.random.key(0)))
    step, state, _ = ckpt.restore_latest(checkpoint.abstract(abstract_state, trainer_.state_sharding))
    return model_cfg, state.params, tok, step
  finally:
    ckpt.close()


def trained_model(cfg, workdir: str):
  """(tokenizer, ModelConfig) of the policy a run in `workdir` trains, from the files the run wrote."""
  if cfg.model.init in ("hf", "gguf"):
    source = model_dir(cfg, workdir)
    return tokenizer_lib.load(cfg.tokenizer.path or source), hf.load_config(source, **runtime_overrides(cfg))
  tok_dir = cfg.tokenizer.path or os.path.join(workdir, "tokenizer")
  tok = tokenizer_lib.load(tok_dir)
  if cfg.model.init == "sft":
    return tok, hf.load_config(os.path.join(workdir, "sft_model"), **runtime_overrides(cfg))
  return tok, model_config(cfg, ((len(tok) + 63) // 64) * 64)
