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
import os

import jax

from dapo_jax import advantages as adv_lib
from dapo_jax import checkpoint, evaluate, loop, objectives, optim, ppo, sharding, train_step
from dapo_jax import metrics as metrics_lib
from dapo_jax import rewards as rewards_lib
from dapo_jax import workdir as workdir_lib
from dapo_jax.config_checks import (  # noqa: F401 (public)
  ConfigError,
  check,
  dataset_files,
  lora_config,
  number,
  validate,
  validate_pairs,
)
from dapo_jax.data import prompts as data_lib
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.envs import base as env_lib
from dapo_jax.hf import convert as hf
from dapo_jax.model import transformer as model_lib
from dapo_jax.rollout import episodes as episodes_lib
from dapo_jax.rollout import rollout as rollout_lib
from dapo_jax.rollout import sampling

# Fields that are not in an HF config.json: they apply to a loaded model too.
_RUNTIME_FIELDS = ("param_dtype", "dtype", "matmul_dtype", "remat", "attn_chunk", "logits_chunk",
                  "router_aux_coef", "expert_chunk", "attention_impl")
_MODEL_FIELDS = ("embed_dim", "mlp_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "rope_theta",
                 "norm_eps", "qkv_bias", "tie_embeddings", "arch", "qk_norm", "rope_type", "rope_factor",
                 "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_pos", "rope_beta_fast",
                 "rope_beta_slow", "rope_attention_factor", "rope_truncate", "sliding_window", "local_layers",
                 "rope_local_theta", "query_scale", "attn_softcap", "final_softcap", "num_experts",
                 "experts_per_token", "expert_mlp_dim", "norm_topk_prob", "dense_layers") + _RUNTIME_FIELDS


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
  if d.task == "reasoning_gym":
    from dapo_jax.data import reasoning_gym
    try:
      settings = json.loads(d.rg_settings) if d.rg_settings else {}
    except json.JSONDecodeError as e:
      raise ValueError(f"data.rg_settings={d.rg_settings!r} is not JSON ({e})") from None
    kw = dict(template=d.prompt_template) if d.prompt_template else {}
    return reasoning_gym.examples(tuple(d.rg_tasks), d.rg_num_train, d.num_eval, seed=cfg.seed, settings=settings,
                                  fewshot=d.fewshot, **kw)
  if d.task != "file":
    raise ValueError(f"data.task={d.task!r}; expected 'file', 'arith' or 'reasoning_gym'")
  files = [f for f in d.train_files if f]
  if not files:
    raise ValueError("data.train_files is empty; set --config.data.train_files=/path/to/train.parquet")
  template = d.prompt_template or None
  check = row_check(cfg)
  load = lambda f: data_lib.load_file(f, missing_answer=d.missing_answer, prompt_template=template, check=check)
  train = [ex for f in files for ex in load(f)]
  evals = [ex for f in d.eval_files if f for ex in load(f)]
  return train, evals[: d.num_eval] if d.num_eval else evals


def row_check(cfg):
  """What every dataset row must pass for this run to use it: the `check_ground_truth` of each reward
  function that has one (`rewards.code.python_tests`: a HumanEval task object) and the environment's
  `check_example`; None when nothing checks. Each raises a ValueError saying what is wrong."""
  r = cfg.reward
  fns = [f for f in r.get("fns") or () if f]
  specs = [spec for spec, _ in rewards_lib.parse_weighted(fns)] if fns else [r.fn]
  checks = []
  for spec in specs:
    if ":" in spec and not spec.startswith(("http://", "https://", "rm:")):  # A function, not a server.
      check = getattr(rewards_lib.resolve(spec), "check_ground_truth", None)
      if check is not None:
        checks.append(lambda ex, check=check: check(ex.ground_truth))
  if cfg.rollout.env:
    make_env, _ = episodes(cfg)
    check = getattr(make_env(), "check_example", None)  # Any class with reset and step is an environment.
    if check is not None:
      checks.append(check)
  if not checks:
    return None

  def check_all(ex) -> None:
    for check in checks:
      check(ex)
  return check_all


def user_prompt(cfg, question: str):
  """A question typed by a person, put as the run's training prompts were (`launch.sample`): the
  arithmetic task's instruction and worked examples, or a file task's `data.prompt_template`."""
  d = cfg.data
  if d.task == "arith":
    kw = dict(template=d.prompt_template) if d.prompt_template else {}
    return data_lib.arith_prompt(question, seed=cfg.seed, digits=d.digits, ops=d.ops, digits_b=d.digits_b,
                                 heldout_fraction=d.heldout_fraction, fewshot=d.fewshot, **kw)
  if d.task == "reasoning_gym":  # The task's instruction around the question, after its worked examples.
    from dapo_jax.data import reasoning_gym
    template = d.prompt_template or reasoning_gym.INSTRUCTION
    settings = json.loads(d.rg_settings) if d.rg_settings else {}
    shots = reasoning_gym.shots(tuple(d.rg_tasks), d.fewshot, d.num_eval, seed=cfg.seed, settings=settings,
                                template=template)
    return data_lib.Example(messages=shots + ({"role": "user", "content": template.format(question=question)},),
                            ground_truth="", data_source="reasoning_gym")
  return d.prompt_template.format(problem=question) if d.prompt_template else question


def user_prompt_messages(cfg, question: str) -> list[dict]:
  """`user_prompt` as chat messages (the policy server's form)."""
  prompt = user_prompt(cfg, question)
  return [dict(m) for m in prompt.messages] if not isinstance(prompt, str) else [{"role": "user", "content": prompt}]


def gguf_model_dir(cfg, workdir: str) -> str:
  """The HF directory converted from `model.gguf` (a .gguf path, "smollm2" or "gemma3_270m"), made once per
  workdir."""
  from dapo_jax.hf import gguf
  out = os.path.join(workdir, "model")
  workdir_lib.recover_model_dir(out)
  if os.path.exists(os.path.join(out, "model.safetensors")):
    return out
  assembled = [f for f in os.listdir(out) if f.endswith(".gguf")] if os.path.isdir(out) else []  # Gemma's.
  workdir_lib.check_model_dir(out, "model.gguf's conversion", extra=assembled)

  def convert(tmp):
    if cfg.model.gguf == "gemma3_270m":  # Assembled from its PyPI parts, checked against its SHA-256.
      path, sha256 = gguf.gemma3_270m_path(tmp)
    else:
      path, sha256 = gguf.smollm2_path() if cfg.model.gguf == "smollm2" else cfg.model.gguf, None
    gguf.to_hf_dir(path, tmp, sha256=sha256)

  return workdir_lib.write_model_dir(out, convert)


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
    tokenizer_lib.train_bpe(path, texts, vocab_size=cfg.tokenizer.vocab_size, chat_template=template)
    logging.info("trained a %d-token BPE tokenizer into %s", cfg.tokenizer.vocab_size, path)
  return tokenizer_lib.load(path)


def _corpus_tools(cfg, example) -> list[dict] | None:
  """The tool schemas the environment's prompts show, for the tokenizer's corpus."""
  make_env, _ = episodes(cfg)
  env = make_env()
  env.reset(example)
  return env.tools


def padded_vocab(tok) -> int:
  """The vocabulary of a model built here for `tok`: rounded up to 64 (tidy shapes, room for tensor sharding)."""
  return ((len(tok) + 63) // 64) * 64


def model_config(cfg, vocab_size: int) -> model_lib.ModelConfig:
  fields = {k: cfg.model[k] for k in _MODEL_FIELDS if k in cfg.model}  # Family fields default.
  v = cfg.model.vocab_size or vocab_size
  return model_lib.ModelConfig(vocab_size=v, **fields)


def runtime_overrides(cfg) -> dict:
  """The config's model fields that apply to a model loaded from disk (not in its config.json)."""
  return {k: cfg.model[k] for k in _RUNTIME_FIELDS if k in cfg.model}  # An older run's config.json may lack one.


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
  vocab = padded_vocab(tok)
  model_cfg = model_config(cfg, vocab)
  tokenizer_lib.check_vocab(tok, model_cfg.vocab_size, f"model.vocab_size={cfg.model.vocab_size}")
  if init == "random":
    return model_cfg, model_lib.init_params(model_cfg, jax.random.key(cfg.seed))
  if init == "sft":
    sft_dir = os.path.join(workdir, "sft_model")
    workdir_lib.recover_model_dir(sft_dir)
    if not os.path.exists(os.path.join(sft_dir, "model.safetensors")):
      workdir_lib.check_model_dir(sft_dir, "the SFT warm start")  # Never replaces a user's files.
      from dapo_jax.pipelines import sft
      params = sft.run(sft_config(cfg), model_cfg, tok, train_examples, mesh, os.path.join(workdir, "sft"))
      if jax.process_index() == 0:
        params = jax.device_get(params)
        workdir_lib.write_model_dir(sft_dir, lambda d: hf.save(d, model_cfg, params, tokenizer=tok))
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


def completion_len(cfg) -> int:
  """C, the completion positions of a row: rollout.max_new_tokens, or with an environment the
  episode's budget after the prompt (policy turns and observations)."""
  r = cfg.rollout
  if not r.env:
    return r.max_new_tokens
  return episodes_lib.response_budget(cfg.data.max_prompt_len, r.max_new_tokens, r.max_turns, r.max_episode_tokens)


def episodes(cfg, tok=None):
  """(environment factory, EpisodeConfig) of `rollout.env`, or (None, None) for single turns."""
  r = cfg.rollout
  if not r.env:
    return None, None
  return env_lib.resolve(r.env, r.env_args), episodes_lib.EpisodeConfig(
      max_turns=r.max_turns, timeout_s=r.env_timeout_s, workers=r.env_workers, failure_score=r.env_failure_score,
      env_error=r.get("env_error", "mask"), turn_stop_ids=turn_stop_ids(cfg, tok) if tok is not None else ())


def turn_stop_ids(cfg, tok) -> tuple[int, ...]:
  """The ids of `rollout.turn_stop` (episodes only), each a single token of the vocabulary."""
  stops = tuple(cfg.rollout.get("turn_stop", ()) or ())
  if not stops:
    return ()
  if not cfg.rollout.env:
    raise ConfigError(f"rollout.turn_stop={stops!r} ends turns of episodes; set rollout.env or leave it empty")
  ids = []
  for s in stops:
    found = tok(s, add_special_tokens=False)["input_ids"] if isinstance(s, str) and s else []
    if len(found) != 1:
      raise ConfigError(f"rollout.turn_stop: {s!r} is {len(found)} tokens of this tokenizer ({found}); "
                        "each must be exactly one token")
    ids.append(found[0])
  return tuple(ids)


def sampler_config(cfg, tok, source_dir: str = "") -> sampling.SamplerConfig:
  r = cfg.rollout
  eos = tuple(dict.fromkeys((*tokenizer_lib.stop_ids(tok, source_dir, r.stop), *turn_stop_ids(cfg, tok))))
  return sampling.SamplerConfig(
      max_new_tokens=completion_len(cfg), temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
      eos_ids=eos, pad_id=tok.pad_token_id)


def eval_sampler_config(cfg, sampler_cfg: sampling.SamplerConfig) -> sampling.SamplerConfig:
  e = cfg.eval
  return dataclasses.replace(sampler_cfg, temperature=e.temperature, top_p=e.top_p, top_k=0,
                             max_new_tokens=e.max_new_tokens or sampler_cfg.max_new_tokens)


def rollout_config(cfg) -> rollout_lib.RolloutConfig:
  d = cfg.dapo
  return rollout_lib.RolloutConfig(
      max_prompt_len=cfg.data.max_prompt_len, prompt_buckets=tuple(cfg.data.prompt_buckets),
      chat_template=cfg.data.chat_template, rows_per_call=cfg.rollout.rows_per_call,
      engine=cfg.rollout.engine, slots=cfg.rollout.slots or cfg.dapo.prompts_per_step * cfg.rollout.group_size,
      prefill_tokens=cfg.rollout.prefill_tokens, turn_tokens=cfg.rollout.max_new_tokens if cfg.rollout.env else 0,
      kv_cache_dtype=cfg.rollout.get("kv_cache_dtype", ""), shared_prefix=cfg.rollout.get("shared_prefix", 0),
      overlong_buffer=d.overlong_buffer, overlong_penalty=d.overlong_penalty, filter_metric=d.filter_metric)


def pg_config(cfg) -> objectives.PGConfig:
  d, t = cfg.dapo, cfg.train
  return objectives.PGConfig(
      eps_low=d.eps_low, eps_high=d.eps_high, clip_ratio_c=d.clip_ratio_c if d.clip_ratio_c > 0 else None,
      loss_agg=d.loss_agg, policy_loss=d.policy_loss, norm_len=completion_len(cfg),
      **{k: d[k] for k in objectives.PG_KNOBS},
      rollout_correction=objectives.RolloutCorrection(**d.rollout_correction),
      verl_microbatch_weighting=d.verl_microbatch_weighting,
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
      reference=d.kl_coef > 0 or kl_in_reward(cfg), seed=cfg.seed, adv_estimator=d.adv_estimator,
      gamma=cfg.ppo.gamma, lam=cfg.ppo.lam, ckpt_every=t.ckpt_every, eval_every=t.eval_every,
      log_samples_every=t.log_samples_every, max_bad_steps=t.max_bad_steps, streaming=d.streaming,
      admit_ahead=d.get("admit_ahead", True), admit_margin=float(d.get("admit_margin", 1.0)),
      max_staleness=cfg.rollout.get("max_staleness", 0),
      use_decoupled_loss=cfg.rollout.get("use_decoupled_loss", False),
      partial_rollouts=cfg.rollout.get("partial_rollouts", False),
      length_buckets=train_step.length_buckets(completion_len(cfg), t.length_buckets) if t.length_buckets else (),
      shared_prefix=t.get("shared_prefix", 0) if t.get("share_prompt", True) else 0,
      **run_record_config(cfg))


def run_record_config(cfg) -> dict:
  """The loop's rollout-dump, profiler and MFU fields (`train.dump_rollouts_every`, `profile_steps`,
  `peak_flops`), checked: -1 dumps every step when a step generates at most 2^20 tokens."""
  t = cfg.train
  every = t.get("dump_rollouts_every", 0)
  check(isinstance(every, int) and every >= -1, "train.dump_rollouts_every", every, "an integer >= -1")
  if every == -1:
    every = int(cfg.dapo.prompts_per_step * cfg.rollout.group_size * completion_len(cfg) <= 2 ** 20)
  steps = tuple(t.get("profile_steps", ()))
  check(steps == () or (len(steps) == 2 and all(isinstance(x, int) for x in steps) and 1 <= steps[0] <= steps[1]),
        "train.profile_steps", steps, "() or (a, b) with 1 <= a <= b (rollout steps)")
  peak = number(cfg, "train.peak_flops", 0) if "peak_flops" in t else 0.0
  return dict(dump_rollouts_every=every, profile_steps=steps, peak_flops=float(peak))


def kl_in_reward(cfg) -> bool:
  """Whether the token rewards carry -β·KL to a frozen reference (PPO's estimators, β > 0; distillation's
  advantage is the teacher's, so it needs no reference)."""
  return cfg.dapo.adv_estimator in adv_lib.KL_SHAPED_ESTIMATORS and cfg.ppo.kl_coef > 0


def kl_controller(cfg):
  """β of the KL-shaped reward (`ppo.kl_ctrl`), or None without one."""
  p = cfg.ppo
  if not kl_in_reward(cfg):
    return None
  if p.kl_ctrl == "adaptive":
    return adv_lib.AdaptiveKLController(p.kl_coef, p.target_kl, p.horizon)
  return adv_lib.FixedKLController(p.kl_coef)


def critic(cfg, model_cfg: model_lib.ModelConfig, params, tok, mesh, group_size: int) -> ppo.Critic:
  """PPO's value model (`critic`): the policy's trunk with a zero scalar head, or a reward model's
  directory; its own Trainer (objectives.value_model) and optimizer on the policy's mesh."""
  from dapo_jax.pipelines import rm  # noqa: PLC0415
  c = cfg.critic
  if c.init == "rm":
    path = c.model_dir or cfg.reward.fn.removeprefix("rm:")
    critic_cfg, critic_params = hf.load_scalar(path, **runtime_overrides(cfg))
    tokenizer_lib.check_vocab(tok, critic_cfg.vocab_size, f"{path}/config.json (critic.model_dir)")
    if critic_cfg.vocab_size != model_cfg.vocab_size:
      raise ConfigError(f"critic.model_dir={path!r}: vocab_size={critic_cfg.vocab_size}, the policy's is "
                        f"{model_cfg.vocab_size}; the value model must read the policy's tokens")
  else:
    critic_cfg, critic_params = model_cfg, rm.from_lm(jax.device_get(params))
  opt = optim.OptimConfig(lr=c.lr, warmup_steps=c.warmup_steps, weight_decay=c.weight_decay, grad_clip=c.grad_clip)
  trainer_ = train_step.Trainer(critic_cfg, opt, mesh, objectives.value_model(critic_cfg, c.clip_range, group_size),
                                num_microbatches=cfg.train.num_microbatches,
                                microbatch_tokens=cfg.train.microbatch_tokens, head="scalar")
  return ppo.Critic(trainer_, trainer_.forward(objectives.completion_values(critic_cfg, group_size)), critic_params)


def sft_config(cfg):
  """The SFT warm start's `sft.SFTConfig`."""
  from dapo_jax.pipelines import sft  # noqa: PLC0415 (sft imports train_step; only SFT runs need it)
  s = cfg.sft
  if cfg.data.task != "arith":
    raise ConfigError("the SFT warm start needs reference solutions, which only data.task='arith' has; "
                      "use model.init='hf' for other tasks")
  return sft.SFTConfig(steps=s.steps, batch_size=s.batch_size, seq_len=s.seq_len, lr=s.lr,
                       warmup_steps=s.warmup_steps, num_examples=s.num_examples, target_acc=s.target_acc,
                       probe_size=s.probe_size, probe_every=s.probe_every, completion_only=s.completion_only,
                       seed=cfg.seed,
                       chat_template=cfg.data.chat_template, solution_style=cfg.data.solution_style,
                       microbatch_tokens=cfg.train.microbatch_tokens, ckpt_every=s.ckpt_every,
                       keep_ckpts=s.keep_ckpts)


def trainer(cfg, model_cfg: model_lib.ModelConfig, mesh, objective) -> train_step.Trainer:
  return train_step.Trainer(model_cfg, optim.OptimConfig(**cfg.optim), mesh, objective,
                            num_microbatches=cfg.train.num_microbatches,
                            microbatch_tokens=cfg.train.microbatch_tokens, lora=lora_config(cfg), seed=cfg.seed)


def evaluator(cfg, rollout: rollout_lib.Rollout, examples, progress: bool = False) -> evaluate.Evaluator:
  # Static sampler: chunks of the rollout's row count, so the compiled sampler shapes are few.
  rows = max(cfg.dapo.gen_prompts * cfg.rollout.group_size // cfg.eval.k, 1)
  e = cfg.eval
  reward_ = rewards_lib.make_reward(e.reward_fn, cfg.reward.timeout_s, cfg.reward.workers) if e.reward_fn else None
  return evaluate.Evaluator(rollout, examples, k=e.k, sampler_cfg=eval_sampler_config(cfg, rollout.sampler_cfg),
                            greedy=e.greedy, seed=cfg.seed, rows=rows, progress=progress, reward=reward_)


def dapo(cfg, workdir: str, mesh=None) -> loop.DAPO:
  """Everything one DAPO run needs, built from its config (a context manager: see `loop.DAPO`)."""
  validate(cfg)  # Once, before the mesh, any worker process, compile or generation.
  # The trainer's mesh; with mesh.rollout_devices, the rollout engine's own (else it shares this one).
  mesh, rollout_mesh = (mesh, None) if mesh is not None else sharding.split_meshes(cfg.mesh)
  os.makedirs(workdir, exist_ok=True)
  workdir_lib.lock(workdir, jax.process_index())  # A second run on this workdir stops here, naming the first.
  save_run_config(cfg, workdir)  # A resume that changes the model, tokens or objective fails here.
  run_record_config(cfg)  # Its checks, before anything is built.
  reward_ = reward(cfg)
  try:
    train, evals = datasets(cfg)
    tok = tokenizer(cfg, workdir, train)
    for ex in train[:1]:
      tokenizer_lib.render(tok, ex.messages, cfg.data.chat_template)  # Template errors now.
    model_cfg, params = initial_model(cfg, workdir, tok, mesh, train)
    pg = pg_config(cfg)
    trainer_ = trainer(cfg, model_cfg, mesh, objectives.policy_gradient(model_cfg, pg))
    logprobs = trainer_.forward(objectives.completion_logprobs(model_cfg, pg.temperature, pg.group_size))
    rollout = rollout_lib.Rollout(tok, model_cfg, rollout_mesh or mesh, rollout_config(cfg),
                                  sampler_config(cfg, tok, model_dir(cfg, workdir)), reward_, *episodes(cfg, tok))
    data_iter = data_lib.PromptIterator(train, seed=cfg.seed, process_index=jax.process_index(),
                                        process_count=jax.process_count())
    critic_ = critic(cfg, model_cfg, params, tok, mesh, pg.group_size) if cfg.dapo.adv_estimator == "gae" else None
    teacher_ = teacher(cfg, model_cfg, tok, mesh, pg) if cfg.dapo.adv_estimator == "distill" else None
    evaluator_ = evaluator(cfg, rollout, evals)
  except BaseException:
    reward_.close()
    raise
  try:
    return loop.DAPO(loop_config(cfg), trainer=trainer_, logprobs=logprobs, rollout=rollout,
                     evaluator=evaluator_, data_iter=data_iter, params=params,
                     workdir=workdir, keep_ckpts=cfg.train.keep_ckpts,
                     writer_cfg=metrics_lib.WriterConfig(**cfg.metrics), run_config=cfg.to_dict(),
                     critic=critic_, kl_ctrl=kl_controller(cfg), teacher=teacher_)
  except BaseException:
    reward_.close()
    evaluator_.close()
    raise


def run(cfg, workdir: str, mesh=None) -> dict:
  """Trains with DAPO as the config `cfg` says; resumes from `workdir` if it holds a checkpoint.
  Returns the last step's metrics."""
  with dapo(cfg, workdir, mesh) as run_:
    last = run_.run()
  ev = {k: v for k, v in last.items() if k.startswith("val/")}
  if ev:
    print("Held-out after RL: " + metrics_lib.format_eval(ev), flush=True)
  return last


# --- The run's own record of its config: WORKDIR/config.json and command.txt -----------------------

CONFIG_FILE, COMMAND_FILE = workdir_lib.CONFIG_FILE, workdir_lib.COMMAND_FILE
# Fields a run cannot change between starts: its parameters' shapes and meaning, its tokens, what its
# checkpoints hold (a value model with gae) and what it optimises.
RESUME_FIELDS = (tuple(f"model.{k}" for k in _MODEL_FIELDS if k not in _RUNTIME_FIELDS)
                 + ("model.init", "model.hf_dir", "model.gguf", "model.vocab_size", "model.lora.rank",
                    "tokenizer.path", "tokenizer.vocab_size", "dapo.adv_estimator", "dapo.policy_loss"))


# The supervised pipelines' own records (WORKDIR/<pipeline>_config.json, beside a training run's):
# what they start from, train on and optimise.
_PAIR_FIELDS = ("init_dir", "train_files", "prompt_len", "response_len")
PIPELINE_RESUME_FIELDS = {
    "sft": RESUME_FIELDS[:-2] + ("data.task", "data.train_files", "chat_sft.assistant_only", "chat_sft.packing",
                                 "sft.seq_len"),
    "rm": tuple(f"rm.{k}" for k in _PAIR_FIELDS + ("margin",)) + ("tokenizer.path", "model.lora.rank"),
    "dpo": tuple(f"dpo.{k}" for k in _PAIR_FIELDS + ("beta", "loss_type", "label_smoothing", "rpo_alpha"))
           + ("tokenizer.path", "model.lora.rank"),
}


def save_pipeline_config(cfg, workdir: str, pipeline: str) -> None:
  """`save_run_config` for `launch.sft|rm|dpo`: WORKDIR/<pipeline>_config.json, checked against
  `PIPELINE_RESUME_FIELDS[pipeline]` when the pipeline resumes."""
  save_run_config(cfg, workdir, fields=PIPELINE_RESUME_FIELDS[pipeline], name=f"{pipeline}_config.json",
                  command_name=f"{pipeline}_command.txt")


def save_run_config(cfg, workdir: str, argv=None, *, fields=RESUME_FIELDS, name: str = CONFIG_FILE,
                    command_name: str = COMMAND_FILE) -> None:
  """Writes the resolved config to WORKDIR/config.json and appends the command line to command.txt;
  refuses (CheckpointMismatchError) a config whose `fields` differ from the run's recorded ones."""
  workdir_lib.record_config(cfg, workdir, fields, argv=argv, name=name, command_name=command_name,
                            write=jax.process_index() == 0)


def load_run_config(workdir: str):
  """The ConfigDict a run in `workdir` recorded (`save_run_config`), or None if it has none."""
  return workdir_lib.recorded_config(workdir)


def restore_policy(cfg, workdir: str, mesh=None):
  """(model_cfg, params, tokenizer, rollout step) of the newest checkpoint in `workdir`, without
  building a training run (no datasets, reward workers or SFT): for `launch.eval` and `launch.export`."""
  mesh = mesh if mesh is not None else sharding.make_mesh(cfg.mesh)
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


def served_policy(cfg, workdir, hf_dir, adapter_dir, mesh):
  """(model_cfg, params, tokenizer, source dir, name) of what `launch.serve` serves: `hf_dir` (with a
  PEFT adapter) or the newest checkpoint in `workdir` (a run trained with `cfg`)."""
  from dapo_jax.hf import peft
  from dapo_jax.model import lora as lora_lib
  if hf_dir:
    model_cfg, params = hf.load(hf_dir, **runtime_overrides(cfg))
    tok = tokenizer_lib.load(cfg.tokenizer.path or hf_dir)
    if adapter_dir:
      lora_cfg, adapters = peft.load_peft(adapter_dir, model_cfg)
      params = lora_lib.adapt(model_cfg, lora_cfg, params, jax.random.key(0), adapters)
    return model_cfg, params, tok, hf_dir, os.path.basename(os.path.normpath(adapter_dir or hf_dir))
  if adapter_dir:
    raise ValueError("--adapter_dir goes with --model_dir (its base model)")
  model_cfg, params, tok, _ = restore_policy(cfg, workdir, mesh)
  return model_cfg, params, tok, model_dir(cfg, workdir), os.path.basename(os.path.normpath(workdir))


def teacher(cfg, model_cfg: model_lib.ModelConfig, tok, mesh, pg: objectives.PGConfig):
  """On-policy distillation's teacher from `dapo.teacher_dir` (any HF directory we load): (its
  completion log-prob function, its params on the mesh). Refused at start unless it reads the
  policy's token ids as the policy does (one vocabulary size, one tokenizer), naming both."""
  path = cfg.dapo.teacher_dir
  if not path:
    raise ConfigError("dapo.adv_estimator='distill' needs dapo.teacher_dir=HF_DIR (the teacher model)")
  teacher_cfg, params = hf.load(path, **runtime_overrides(cfg))
  student = cfg.model.hf_dir or cfg.model.init
  adv_lib.check_teacher_vocab(model_cfg.vocab_size, teacher_cfg.vocab_size, student=student, teacher=path)
  if any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
    if tokenizer_lib.load(path).get_vocab() != tok.get_vocab():
      raise ConfigError(f"dapo.teacher_dir={path!r}: its tokenizer is not the policy's ({student!r}); "
                        "distillation scores the policy's token ids, so both need one tokenizer")
  teacher_trainer = train_step.Trainer(teacher_cfg, optim.OptimConfig(**cfg.optim), mesh,
                                       objectives.policy_gradient(teacher_cfg, pg),
                                       num_microbatches=cfg.train.num_microbatches,
                                       microbatch_tokens=cfg.train.microbatch_tokens)
  logprobs = teacher_trainer.forward(objectives.completion_logprobs(teacher_cfg, pg.temperature, pg.group_size))
  return logprobs, jax.device_put(params, teacher_trainer.params_sharding)


def trained_model(cfg, workdir: str):
  """(tokenizer, ModelConfig) of the policy a run in `workdir` trains, from the files the run wrote."""
  if cfg.model.init in ("hf", "gguf"):
    source = model_dir(cfg, workdir)
    return tokenizer_lib.load(cfg.tokenizer.path or source), hf.load_config(source, **runtime_overrides(cfg))
  tok_dir = cfg.tokenizer.path or os.path.join(workdir, "tokenizer")
  tok = tokenizer_lib.load(tok_dir)
  if cfg.model.init == "sft":
    return tok, hf.load_config(os.path.join(workdir, "sft_model"), **runtime_overrides(cfg))
  return tok, model_config(cfg, padded_vocab(tok))


# --- RLHF pipelines: the reward, chat SFT, the reward model, DPO ---------------------------------

def reward(cfg):
  """The rollout's reward from `reward.fn` (or weighted `reward.fns`, when the config has them):
  a function path (process pool), http(s)://HOST:PORT (an RM server) or rm:DIR (a reward model
  in this process, on the accelerator)."""
  r = cfg.reward
  mode = r.get("sandbox", "namespaces")
  if mode != "namespaces" or any("python_tests" in f for f in (r.fn, *(r.get("fns") or ()))):
    from dapo_jax.rewards import code  # noqa: PLC0415
    code.set_sandbox(mode)  # A host that cannot sandbox fails here, saying what is missing.
  fns = tuple(f for f in (r.get("fns") or ()) if f)
  if fns:
    return rewards_lib.CombinedReward(rewards_lib.parse_weighted(fns), r.timeout_s, r.workers)
  return rewards_lib.make_reward(r.fn, r.timeout_s, r.workers)


def _pair_fields(cfg, name: str) -> dict:
  s = cfg[name]
  return dict(steps=s.steps, batch_pairs=s.batch_pairs, lr=s.lr, warmup_steps=s.warmup_steps,
              weight_decay=s.weight_decay, grad_clip=s.grad_clip, prompt_len=s.prompt_len,
              response_len=s.response_len, chat_template=cfg.data.chat_template, eval_every=s.eval_every,
              ckpt_every=s.ckpt_every, keep_ckpts=s.keep_ckpts, microbatch_tokens=cfg.train.microbatch_tokens,
              seed=cfg.seed)


def rm_config(cfg):
  from dapo_jax.pipelines import rm  # noqa: PLC0415
  return rm.RMConfig(margin=cfg.rm.margin, **_pair_fields(cfg, "rm"))


def dpo_config(cfg):
  from dapo_jax.pipelines import dpo  # noqa: PLC0415
  d = cfg.dpo
  return dpo.DPOTrainConfig(beta=d.beta, loss_type=d.loss_type, label_smoothing=d.label_smoothing,
                            rpo_alpha=d.rpo_alpha, **_pair_fields(cfg, "dpo"))


def preference_data(cfg, name: str):
  """(train pairs, held-out pairs) of the `rm` or `dpo` section's files."""
  from dapo_jax.data import preference  # noqa: PLC0415
  s = cfg[name]
  load = lambda files: [p for f in files for p in preference.load_pairs(f)]
  return load(dataset_files(s, "train_files", name)), load(dataset_files(s, "eval_files", name))


def chat_sft_config(cfg):
  from dapo_jax.pipelines import sft_chat  # noqa: PLC0415
  s, c = cfg.sft, cfg.chat_sft
  return sft_chat.ChatSFTConfig(steps=s.steps, batch_size=s.batch_size, seq_len=s.seq_len, lr=s.lr,
                                warmup_steps=s.warmup_steps, assistant_only=c.assistant_only, packing=c.packing,
                                chat_template=cfg.data.chat_template, eval_every=c.eval_every,
                                ckpt_every=s.ckpt_every, keep_ckpts=s.keep_ckpts,
                                microbatch_tokens=cfg.train.microbatch_tokens, seed=cfg.seed)


def conversation_data(cfg):
  """(train, held-out) conversations of `data.train_files` (held out by prompt hash, or `data.eval_files`)."""
  from dapo_jax.data import conversations  # noqa: PLC0415
  check(any(cfg.data.train_files), "data.train_files", tuple(cfg.data.train_files), "at least one conversation file")
  n = functools.partial(number, cfg)
  for f in ("steps", "batch_size", "seq_len"):
    n(f"sft.{f}", 1, integer=True)
  n("chat_sft.heldout_fraction", 0, 1, hi_open=True)
  train = [c for f in cfg.data.train_files if f for c in conversations.load_conversations(f)]
  evals = [c for f in cfg.data.eval_files if f for c in conversations.load_conversations(f)]
  if evals:
    return train, evals
  if cfg.chat_sft.heldout_fraction > 0:
    return conversations.split_heldout(train, cfg.chat_sft.heldout_fraction)
  return train, []


def run_sft(cfg, workdir: str, mesh=None):
  """`launch.sft`: SFT on the arithmetic task's solutions (data.task="arith") or on conversation files
  (data.task="file"), resuming from WORKDIR/sft. Returns (model_cfg, params, tokenizer)."""
  mesh = mesh if mesh is not None else sharding.make_mesh(cfg.mesh)
  workdir_lib.lock(workdir, jax.process_index())
  from dapo_jax.pipelines import sft as sft_lib  # noqa: PLC0415
  from dapo_jax.pipelines import sft_chat  # noqa: PLC0415
  run_dir = os.path.join(workdir, "sft")
  save_pipeline_config(cfg, workdir, "sft")
  if cfg.data.task != "file":
    train, _ = datasets(cfg)
    tok = tokenizer(cfg, workdir, train)
    model_cfg = model_config(cfg, padded_vocab(tok))
    return model_cfg, sft_lib.run(sft_config(cfg), model_cfg, tok, train, mesh, run_dir, lora=lora_config(cfg)), tok
  train, held = conversation_data(cfg)
  tok = chat_tokenizer(cfg, workdir, train)
  if cfg.model.init == "hf":
    model_cfg, params = hf.load(cfg.model.hf_dir, **runtime_overrides(cfg))
  else:
    model_cfg = model_config(cfg, padded_vocab(tok))
    params = model_lib.init_params(model_cfg, jax.random.key(cfg.seed))
  params, _ = sft_chat.train(chat_sft_config(cfg), model_cfg, params, tok, train, held, mesh, run_dir,
                             source=",".join(f for f in cfg.data.train_files if f), lora=lora_config(cfg))
  return model_cfg, params, tok


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


def dpo_evaluator(cfg, tok, model_cfg, mesh, held_pairs):
  """Rule-checked greedy accuracy on the held-out pairs' prompts that carry a `ground_truth`
  (`dpo.eval_greedy` of them; None when there are none)."""
  examples = [data_lib.Example(messages=p.prompt, ground_truth=p.ground_truth, index=p.index)
              for p in held_pairs if p.ground_truth is not None][: cfg.dpo.eval_greedy]
  if not examples:
    return None
  greedy = sampling.SamplerConfig(max_new_tokens=cfg.dpo.max_new_tokens, temperature=0.0,
                                  eos_ids=tokenizer_lib.stop_ids(tok, cfg.dpo.init_dir, cfg.rollout.stop),
                                  pad_id=tok.pad_token_id)
  rcfg = rollout_lib.RolloutConfig(max_prompt_len=cfg.dpo.prompt_len, chat_template=cfg.data.chat_template)
  rule = lambda responses, gts: [rewards_lib.math_dapo(r, g) for r, g in zip(responses, gts)]
  rollout = rollout_lib.Rollout(tok, model_cfg, mesh, rcfg, greedy, rule)
  return evaluate.Evaluator(rollout, examples, k=1, sampler_cfg=greedy, seed=cfg.seed, rows=len(examples))
