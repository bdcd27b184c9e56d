"""Start-up checks of a config: every value that cannot work is refused, before anything is built,
with one line naming the field and what is allowed (`ConfigError`). `from_config` runs them, once per launch."""
from __future__ import annotations

import functools
import json
import logging
import os

import jax

from dapo_jax import advantages as adv_lib
from dapo_jax import loss as loss_lib
from dapo_jax import sharding
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.model import lora as lora_lib
from dapo_jax.rollout import episodes as episodes_lib
from dapo_jax.rollout import rollout as rollout_lib


class ConfigError(ValueError):
  """A config value that cannot work; the message names the field and the allowed values."""


_LOSS_AGG = loss_lib.AGG_MODES
_REMAT = ("none", "full", "dots")
_INIT = ("random", "hf", "gguf", "sft")
_DTYPES = ("float32", "bfloat16", "float16")


def check(ok, field: str, value, allowed: str) -> None:
  if not ok:
    raise ConfigError(f"{field}={value!r}: expected {allowed}")


def number(cfg, field: str, lo=None, hi=None, *, lo_open=False, hi_open=False, integer=False, allowed=""):
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
  n = functools.partial(number, c)

  # Model.
  check(m.init in _INIT, "model.init", m.init, f"one of {_INIT}")
  check(m.remat in _REMAT, "model.remat", m.remat, f"one of {_REMAT}")
  for f in ("param_dtype", "dtype"):
    check(m[f] in _DTYPES, f"model.{f}", m[f], f"one of {_DTYPES}")
  check(m.matmul_dtype in ("",) + _DTYPES, "model.matmul_dtype", m.matmul_dtype, f"'' or one of {_DTYPES}")
  lora_config(c)
  n("model.vocab_size", 0, integer=True)
  n("model.attn_chunk", 0, integer=True)
  if m.init in ("random", "sft"):
    for f in ("embed_dim", "mlp_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
      n(f"model.{f}", 1, integer=True)
    check(m.num_heads % m.num_kv_heads == 0, "model.num_heads", m.num_heads,
           f"a multiple of model.num_kv_heads={m.num_kv_heads}")
    check(m.head_dim % 2 == 0, "model.head_dim", m.head_dim, "an even number (rotary embeddings)")
    n("model.rope_theta", 0, lo_open=True)
    n("model.norm_eps", 0, lo_open=True)
  n("tokenizer.vocab_size", 1, integer=True)

  # Data.
  check(c.data.task in ("arith", "file", "reasoning_gym"), "data.task", c.data.task,
        "'arith', 'file' or 'reasoning_gym'")
  if c.data.task == "reasoning_gym":
    check(len(c.data.rg_tasks) > 0, "data.rg_tasks", tuple(c.data.rg_tasks),
          "at least one reasoning-gym task when data.task='reasoning_gym', e.g. ('chain_sum',)")
    n("data.rg_num_train", 1, integer=True)
  elif c.data.task == "file":
    check(any(c.data.train_files), "data.train_files", tuple(c.data.train_files),
           "at least one dataset file when data.task='file'")
  else:
    n("data.digits", 1, integer=True)
    n("data.digits_b", 0, integer=True)
    n("data.fewshot", 0, integer=True)
    n("data.heldout_fraction", 0, 1, lo_open=True, hi_open=True)
  check(c.data.missing_answer in ("error", "skip"), "data.missing_answer", c.data.missing_answer,
         "'error' or 'skip'")
  check(c.data.solution_style in ("steps", "column", "mixed", "direct", "tool"), "data.solution_style",
        c.data.solution_style, "'steps', 'column', 'mixed', 'direct' or 'tool' (calculator episodes: "
        "rollout.env='dapo_jax.envs.tasks:CalculatorArith')")
  check(c.data.solution_style != "tool" or r.env, "data.solution_style", c.data.solution_style,
        "'steps' or 'direct' without rollout.env ('tool' writes calculator episodes)")
  P = n("data.max_prompt_len", 1, integer=True)
  for b in c.data.prompt_buckets:
    check(isinstance(b, int) and 1 <= b <= P, "data.prompt_buckets", tuple(c.data.prompt_buckets),
           f"prompt lengths from 1 to data.max_prompt_len={P}")
  n("data.num_eval", 0, integer=True)
  if m.init == "sft":
    check(c.data.task == "arith", "model.init", m.init,
           "'random', 'hf' or 'gguf' when data.task='file' (the SFT warm start needs the arith task's "
           "reference solutions)")

  # Sampling, for rollouts and for evaluation.
  check(d.adv_estimator in adv_lib.ESTIMATORS, "dapo.adv_estimator", d.adv_estimator, f"one of {adv_lib.ESTIMATORS}")
  token_level = d.adv_estimator in adv_lib.TOKEN_ESTIMATORS
  G = n("rollout.group_size", 1 if token_level else 2, integer=True,
        allowed=">= 1" if token_level else ">= 2 (group-relative advantages are 0 for a group of one)")
  C = n("rollout.max_new_tokens", 1, integer=True)
  for p in ("rollout", "eval"):
    n(f"{p}.temperature", 0, allowed=">= 0 (0 = greedy)")
    n(f"{p}.top_p", 0, 1, lo_open=True, allowed="in (0, 1]")
  n("rollout.top_k", 0, integer=True, allowed=">= 0 (0 = off)")
  n("eval.k", 1, integer=True)
  n("eval.max_new_tokens", 0, integer=True, allowed=">= 0 (0 = rollout.max_new_tokens)")

  # Objective.
  if d.policy_loss in ("dppo_tv", "dppo_kl"):  # DPPO: probability / divergence bounds, not ratio ranges
    n("dapo.eps_low", 0, lo_open=True)
  else:  # cispo: 1 = no lower bound on the importance weight (MiniMax-M1)
    n("dapo.eps_low", 0, 1, lo_open=True, hi_open=d.policy_loss != "cispo")
  n("dapo.eps_high", 0, lo_open=True)
  c_dual = n("dapo.clip_ratio_c", 0)
  check(c_dual == 0 or c_dual > 1, "dapo.clip_ratio_c", c_dual, "0 (off) or > 1 (dual clip)")
  check(d.loss_agg in _LOSS_AGG, "dapo.loss_agg", d.loss_agg, f"one of {_LOSS_AGG}")
  check(d.policy_loss in loss_lib.POLICY_LOSSES, "dapo.policy_loss", d.policy_loss,
        f"one of {loss_lib.POLICY_LOSSES}")
  check(d.on_cap in ("train", "raise"), "dapo.on_cap", d.on_cap, "'train' or 'raise'")
  check(d.filter_metric in rollout_lib.FILTER_METRICS, "dapo.filter_metric", d.filter_metric,
         f"one of {rollout_lib.FILTER_METRICS}")
  check(r.stop in tokenizer_lib.STOP_MODES, "rollout.stop", r.stop, f"one of {tokenizer_lib.STOP_MODES}")
  check(r.engine in ("continuous", "static"), "rollout.engine", r.engine, "'continuous' or 'static'")
  n("rollout.slots", 0, integer=True, allowed=">= 0 (0 = the rows of one generation batch)")
  if "max_staleness" in r:
    n("rollout.max_staleness", 0, integer=True, allowed=">= 0 (0: synchronous, 1: one-step-off)")
  if r.get("use_decoupled_loss") and not d.rollout_correction.rollout_is:
    raise ConfigError("rollout.use_decoupled_loss=True needs dapo.rollout_correction.rollout_is='token' or "
                      "'sequence': the decoupled loss weights rows by π_prox/π_behav through it, which would "
                      "otherwise be dropped")
  if r.get("partial_rollouts"):
    if r.get("max_staleness") != 1:
      raise ConfigError("rollout.partial_rollouts=True needs rollout.max_staleness=1 (a rollout in flight while "
                        "the policy updates)")
    if not (d.streaming and r.engine == "continuous"):
      raise ConfigError("rollout.partial_rollouts=True needs dapo.streaming=True and rollout.engine='continuous' "
                        "(params change between engine rounds)")
    if r.env:
      raise ConfigError("rollout.partial_rollouts=True needs single-turn samples (rollout.env is set)")
  kv = r.get("kv_cache_dtype", "")
  check(kv in ("", "float32", "bfloat16", "float16"), "rollout.kv_cache_dtype", kv,
        "'' (the model's dtype), 'float32', 'bfloat16' or 'float16'")
  if r.env:  # Episodes: the budgets, and the continuous engine they run on.
    turns = n("rollout.max_turns", 1, integer=True)
    n("rollout.env_timeout_s", 0, lo_open=True)
    n("rollout.env_workers", 1, integer=True)
    n("rollout.env_failure_score", None)
    check(r.get("env_error", "mask") in episodes_lib.ENV_ERRORS, "rollout.env_error", r.get("env_error"),
          "'mask' (a failed environment's row leaves the loss) or 'score' (it scores rollout.env_failure_score)")
    least = c.data.max_prompt_len + r.max_new_tokens
    E = r.max_episode_tokens
    check(E == 0 or (isinstance(E, int) and E > least), "rollout.max_episode_tokens", E,
          f"0 (= data.max_prompt_len + rollout.max_turns x rollout.max_new_tokens = "
          f"{c.data.max_prompt_len + turns * r.max_new_tokens}) or more than data.max_prompt_len + "
          f"rollout.max_new_tokens = {least}")
    check(r.engine == "continuous", "rollout.engine", r.engine, "'continuous' when rollout.env is set")
    # The soft overlong penalty measures an episode's whole response (observations included) against
    # the episode's response budget (`episodes.response_budget`), not one turn's max_new_tokens.
    budget = episodes_lib.response_budget(P, C, turns, E)
    n("dapo.overlong_buffer", 0, budget, integer=True,
      allowed=f"from 0 to the episode's response budget of {budget} tokens (rollout.max_episode_tokens less "
              "data.max_prompt_len, or rollout.max_turns x rollout.max_new_tokens)")
  else:
    n("dapo.overlong_buffer", 0, C, integer=True, allowed=f"from 0 to rollout.max_new_tokens={C}")
  n("train.length_buckets", 0, integer=True, allowed=">= 0 (0 = every row padded to rollout.max_new_tokens)")
  if "admit_margin" in d:
    n("dapo.admit_margin", 0, allowed=">= 0 (standard deviations of the expected keeps)")
  if "shared_prefix" in cfg.train:
    n("train.shared_prefix", 0, integer=True, allowed=">= 0 (0 = each group's prompt whole)")
  check(d.kl_estimator in ("k1", "k3"), "dapo.kl_estimator", d.kl_estimator, "'k1' or 'k3'")
  n("dapo.kl_coef", 0)
  n("dapo.overlong_penalty", 0)
  n("dapo.max_gen_batches", 0, integer=True, allowed=">= 0 (0 = unlimited)")
  check(isinstance(c.eval.reward_fn, str) and (not c.eval.reward_fn or ":" in c.eval.reward_fn), "eval.reward_fn",
        c.eval.reward_fn, "'' (reward.fn) or a reward spec like reward.fn")
  if token_level:
    _check_token_estimators(c)
  n("reward.timeout_s", 0, lo_open=True)
  n("reward.workers", 1, integer=True)
  check(isinstance(c.reward.fn, str) and ":" in c.reward.fn, "reward.fn", c.reward.fn,
         "'package.module:function', 'http://HOST:PORT' (a reward-model server) or 'rm:DIR' (a reward model)")

  # Batch arithmetic.
  Q = n("dapo.prompts_per_step", 1, integer=True)
  if d.dynamic_sampling:
    n("dapo.gen_prompts", Q, integer=True, allowed=f">= dapo.prompts_per_step={Q} when dynamic sampling is on")
  elif d.gen_prompts != Q:
    logging.info("dynamic sampling is off: each step generates dapo.prompts_per_step prompts")
  gen_rows = (d.gen_prompts if d.dynamic_sampling else Q) * G
  chunk = n("rollout.rows_per_call", 0, integer=True, allowed=">= 0 (0 = the whole generation batch)")
  check(chunk == 0 or (chunk % G == 0 and gen_rows % chunk == 0), "rollout.rows_per_call", chunk,
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
  if t.share_prompt and per_mb % G:  # Rows would be scored against the next group's prompt.
    raise ConfigError(f"train.share_prompt needs whole groups per mini-batch: train.minibatches={mb} splits "
                      f"{rows} rows into mini-batches of {per_mb}, not a multiple of rollout.group_size={G} "
                      "(change train.minibatches, or set train.share_prompt=False)")
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
    if limit and P + C > limit:  # Rotary positions extend past it, but the model never trained there.
      logging.warning("data.max_prompt_len=%d + rollout.max_new_tokens=%d = %d tokens exceeds the model's "
                      "max_position_embeddings=%d (%s/config.json)", P, C, P + C, limit, m.hf_dir)

  # Mesh against the devices (split between rollout and training, or shared), and the batch over
  # its data shards.
  devices = jax.device_count() if num_devices is None else num_devices
  R = c.mesh.get("rollout_devices", 0)
  if not isinstance(R, int) or isinstance(R, bool) or not 0 <= R < devices:
    raise ConfigError(f"mesh.rollout_devices={R!r}: expected 0 (rollout and training share the devices) or "
                      f"1..{devices - 1} of the {devices} devices for the rollout engine")
  if R and jax.process_count() > 1:
    raise ConfigError(f"mesh.rollout_devices={R}: a split mesh runs in one process (this run has "
                      f"{jax.process_count()})")
  try:
    sizes = sharding.mesh_shape(dict(c.mesh), devices - R)
    rollout_sizes = sharding.mesh_shape(dict(c.mesh), R) if R else sizes
  except ValueError as e:
    raise ConfigError(f"{e}{f' (mesh.rollout_devices={R}: {R} rollout and {devices - R} training devices)' if R else ''}") from None
  shards = sharding.batch_shards(sizes)
  if per_mb % shards:
    raise ConfigError(f"train.minibatches={mb}: {per_mb} rows per mini-batch do not split over the "
                      f"mesh's data*fsdp*expert = {shards} batch shards")
  rollout_shards = sharding.batch_shards(rollout_sizes)
  if r.engine == "continuous" and r.slots % rollout_shards:
    raise ConfigError(f"rollout.slots={r.slots}: the decode slots do not split over the {'rollout ' if R else ''}"
                      f"mesh's data*fsdp*expert = {rollout_shards} batch shards")


def _check_token_estimators(c) -> None:
  """The `ppo` section (REINFORCE++, PPO) and, for PPO, the value model's `critic` section."""
  n = functools.partial(number, c)
  n("ppo.gamma", 0, 1)
  n("ppo.lam", 0, 1)
  n("ppo.kl_coef", 0, allowed=">= 0 (0 = no KL in the reward)")
  check(c.ppo.kl_ctrl in ("fixed", "adaptive"), "ppo.kl_ctrl", c.ppo.kl_ctrl, "'fixed' or 'adaptive'")
  if c.ppo.kl_ctrl == "adaptive":
    n("ppo.target_kl", 0, lo_open=True)
    n("ppo.horizon", 0, lo_open=True)
  if c.dapo.adv_estimator != "gae":
    return
  k = c.critic
  check(k.init in ("policy", "rm"), "critic.init", k.init, "'policy' (the policy's trunk, a zero head) or 'rm' "
        "(a reward model's directory: critic.model_dir, or the rm:DIR of reward.fn)")
  if k.init == "rm":
    path = k.model_dir or (c.reward.fn.removeprefix("rm:") if c.reward.fn.startswith("rm:") else "")
    check(bool(path), "critic.model_dir", k.model_dir, "a reward model's HF directory when critic.init='rm' "
          "and reward.fn is not rm:DIR")
  n("critic.lr", 0, lo_open=True)
  n("critic.warmup_steps", 0, integer=True)
  n("critic.weight_decay", 0)
  n("critic.grad_clip", 0, allowed=">= 0 (0 = off)")
  n("critic.clip_range", 0, lo_open=True)


def _max_positions(hf_dir: str) -> int:
  try:
    with open(os.path.join(hf_dir, "config.json")) as f:
      return int(json.load(f).get("max_position_embeddings") or 0)
  except (OSError, ValueError, TypeError, AttributeError):
    return 0  # hf.load names what is wrong with the directory.


def dataset_files(section, field: str, name: str) -> list[str]:
  files = [f for f in section[field] if f]
  check(files or field == "eval_files", f"{name}.{field}", tuple(section[field]), "at least one dataset file")
  return files


def validate_pairs(cfg, name: str) -> None:
  """Checks the `rm` or `dpo` section (and the mesh) before anything is built."""
  s = cfg[name]
  n = functools.partial(number, cfg)
  dataset_files(s, "train_files", name)
  check(bool(s.init_dir), f"{name}.init_dir", s.init_dir, "the HF directory of the starting model "
         "(e.g. the SFT model of launch.sft)")
  for f in ("steps", "batch_pairs", "prompt_len", "response_len", "keep_ckpts"):
    n(f"{name}.{f}", 1, integer=True)
  for f in ("warmup_steps", "eval_every", "ckpt_every"):
    n(f"{name}.{f}", 0, integer=True)
  for f in ("lr", "weight_decay", "grad_clip"):
    n(f"{name}.{f}", 0)
  if name == "dpo":
    n("dpo.beta", 0, lo_open=True)
    check(s.loss_type in loss_lib.DPO_LOSS_TYPES, "dpo.loss_type", s.loss_type, f"one of {loss_lib.DPO_LOSS_TYPES}")
    n("dpo.label_smoothing", 0, 0.5)
    n("dpo.rpo_alpha", 0)
    n("dpo.eval_greedy", 0, integer=True)
    n("dpo.max_new_tokens", 1, integer=True)
  else:
    n("rm.margin", 0)


def lora_config(cfg) -> lora_lib.LoraConfig | None:
  """LoRA adapters on a frozen base (model.lora.rank > 0), or None: full fine-tuning."""
  m = cfg.model
  quant = m.get("base_quant", "")
  if m.get("lora") is None or m.lora.rank == 0:
    check(not quant, "model.base_quant", quant, "'' without LoRA (only a frozen base is quantized: set model.lora.rank)")
    return None
  try:
    return lora_lib.LoraConfig(rank=m.lora.rank, alpha=m.lora.alpha, dropout=m.lora.dropout,
                               targets=tuple(m.lora.targets), base_quant=quant)
  except lora_lib.LoraError as e:
    raise ConfigError(str(e)) from None
