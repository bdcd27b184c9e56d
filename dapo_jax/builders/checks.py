"""Start-up checks that read more than one section: the batch arithmetic, the episode budgets, the
mesh against the devices. Each section checks its own fields when it is built (`settings`); together
they refuse every value that cannot work before anything is built, with one line naming the field and
what is allowed (`ConfigError`). The builders run them once per launch.
"""
from __future__ import annotations

import functools
import json
import logging
import os

import jax

from dapo_jax import advantages as adv_lib
from dapo_jax import sharding
from dapo_jax.errors import ConfigError
from dapo_jax.model import paged_cache
from dapo_jax.rollout import episodes as episodes_lib
from dapo_jax.settings import SFT_TASKS, Config, check, number

__all__ = ["ConfigError", "as_config", "check", "number", "typed", "validate", "validate_pairs", "dataset_files"]


def as_config(cfg) -> Config:
  """The `settings.Config` of a ConfigDict (a config file's, with its overrides), of its plain values, or
  `cfg` itself."""
  return Config.from_dict(cfg.to_dict() if hasattr(cfg, "to_dict") and not isinstance(cfg, Config) else cfg)


def typed(build):
  """`build(cfg, ...)` given a ConfigDict (or plain values) gets its `settings.Config`: builders take either."""
  @functools.wraps(build)
  def with_config(cfg, *args, **kwargs):
    return build(as_config(cfg), *args, **kwargs)
  return with_config


@typed
def validate(cfg: Config, num_devices: int | None = None) -> None:
  """Refuses, before anything is built, every setting that cannot work, naming the field and the
  allowed range. `num_devices` (default: this process's view, `jax.device_count()`) checks the mesh;
  pass the target's count to check a config for another machine."""
  m, d, r, t, data = cfg.model, cfg.dapo, cfg.rollout, cfg.train, cfg.data

  if data.task == "file":
    check(any(data.train_files), "data.train_files", data.train_files,
          "at least one dataset file when data.task='file'")
  check(data.solution_style != "tool" or r.env, "data.solution_style", data.solution_style,
        "'steps' or 'direct' without rollout.env ('tool' writes calculator episodes)")
  if m.init == "sft":
    check(data.task in SFT_TASKS, "model.init", m.init, f"'random', 'hf' or 'gguf' when data.task="
          f"{data.task!r} (the SFT warm start needs reference solutions: data.task in {SFT_TASKS})")

  token_level = d.adv_estimator in adv_lib.TOKEN_ESTIMATORS
  G = r.number("group_size", 1 if token_level else 2, integer=True,
               allowed=">= 1" if token_level else ">= 2 (group-relative advantages are 0 for a group of one)")
  if r.use_decoupled_loss and not d.rollout_correction.rollout_is:
    raise ConfigError("rollout.use_decoupled_loss=True needs dapo.rollout_correction.rollout_is='token' or "
                      "'sequence': the decoupled loss weights rows by π_prox/π_behav through it, which would "
                      "otherwise be dropped")
  if m.router_replay != "disabled":
    check(r.engine == "continuous" or m.router_replay != "R3", "model.router_replay", m.router_replay,
          "'disabled' or 'R2' with rollout.engine='static' (the continuous engine records the sampler's experts)")
  check(m.sequence_attention != "ring" or t.packing, "model.sequence_attention", m.sequence_attention,
        "'gather' without train.packing=True (the ring runs over packed sequences)")
  if r.partial_rollouts and not (d.streaming and r.engine == "continuous"):
    raise ConfigError("rollout.partial_rollouts=True needs dapo.streaming=True and rollout.engine='continuous' "
                      "(params change between engine rounds)")
  _check_budgets(cfg)
  if token_level and d.adv_estimator == "gae" and cfg.critic.init == "rm":
    path = cfg.critic.model_dir or (cfg.reward.fn.removeprefix("rm:") if cfg.reward.fn.startswith("rm:") else "")
    check(bool(path), "critic.model_dir", cfg.critic.model_dir, "a reward model's HF directory when "
          "critic.init='rm' and reward.fn is not rm:DIR")

  # Batch arithmetic.
  Q = d.prompts_per_step
  if not d.dynamic_sampling and d.gen_prompts != Q:
    logging.info("dynamic sampling is off: each step generates dapo.prompts_per_step prompts")
  gen_rows = (d.gen_prompts if d.dynamic_sampling else Q) * G
  chunk = r.rows_per_call
  check(chunk == 0 or (chunk % G == 0 and gen_rows % chunk == 0), "rollout.rows_per_call", chunk,
        f"0, or a multiple of rollout.group_size={G} that divides the {gen_rows} rows of a generation batch")
  mb, micro = t.minibatches, t.num_microbatches
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

  # Lengths: prompt + completion within the model's positions, where the model states them.
  P, C = data.max_prompt_len, r.max_new_tokens
  if m.init == "hf" and m.hf_dir:
    limit = _max_positions(m.hf_dir)
    if limit and P + C > limit:  # Rotary positions extend past it, but the model never trained there.
      logging.warning("data.max_prompt_len=%d + rollout.max_new_tokens=%d = %d tokens exceeds the model's "
                      "max_position_embeddings=%d (%s/config.json)", P, C, P + C, limit, m.hf_dir)
  if r.kv_layout == "paged" and r.kv_pages:
    M = paged_cache.pages_per_row(P + C, r.page_size)
    r.number("kv_pages", M + 1, integer=True, allowed=f"0 (the dense layout's bytes) or >= {M + 1}: the pages of "
             f"one sample of data.max_prompt_len + rollout.max_new_tokens = {P + C} tokens, and the null page")
  _check_mesh(cfg, per_mb, jax.device_count() if num_devices is None else num_devices)


def _check_budgets(cfg: Config) -> None:
  """The overlong buffer within the response budget: one turn's, or with episodes the whole episode's
  (`episodes.response_budget`: observations count, as the soft overlong penalty measures them)."""
  r, P, C = cfg.rollout, cfg.data.max_prompt_len, cfg.rollout.max_new_tokens
  if not r.env:
    cfg.dapo.number("overlong_buffer", 0, C, integer=True, allowed=f"from 0 to rollout.max_new_tokens={C}")
    return
  least, E = P + C, r.max_episode_tokens
  check(E == 0 or (isinstance(E, int) and E > least), "rollout.max_episode_tokens", E,
        f"0 (= data.max_prompt_len + rollout.max_turns x rollout.max_new_tokens = {P + r.max_turns * C}) or "
        f"more than data.max_prompt_len + rollout.max_new_tokens = {least}")
  budget = episodes_lib.response_budget(P, C, r.max_turns, E)
  cfg.dapo.number("overlong_buffer", 0, budget, integer=True,
                  allowed=f"from 0 to the episode's response budget of {budget} tokens (rollout.max_episode_tokens "
                          "less data.max_prompt_len, or rollout.max_turns x rollout.max_new_tokens)")


def _check_mesh(cfg: Config, per_mb: int, devices: int) -> None:
  """The mesh against the devices (split between rollout and training, or shared), and the batch over
  its data shards."""
  R, mesh = cfg.mesh.rollout_devices, cfg.mesh.to_dict()
  if not R < devices:
    raise ConfigError(f"mesh.rollout_devices={R!r}: expected 0 (rollout and training share the devices) or "
                      f"1..{devices - 1} of the {devices} devices for the rollout engine")
  if R and jax.process_count() > 1:
    raise ConfigError(f"mesh.rollout_devices={R}: a split mesh runs in one process (this run has "
                      f"{jax.process_count()})")
  try:
    sizes = sharding.mesh_shape(mesh, devices - R)
    rollout_sizes = sharding.mesh_shape(mesh, R) if R else sizes
  except ValueError as e:
    split = f" (mesh.rollout_devices={R}: {R} rollout and {devices - R} training devices)" if R else ""
    raise ConfigError(f"{e}{split}") from None
  shards = sharding.batch_shards(sizes)
  if per_mb % shards:
    raise ConfigError(f"train.minibatches={cfg.train.minibatches}: {per_mb} rows per mini-batch do not split "
                      f"over the mesh's data*fsdp*expert = {shards} batch shards")
  rollout_shards = sharding.batch_shards(rollout_sizes)
  slots = cfg.rollout.slots
  if cfg.rollout.engine == "continuous" and slots % rollout_shards:
    raise ConfigError(f"rollout.slots={slots}: the decode slots do not split over the {'rollout ' if R else ''}"
                      f"mesh's data*fsdp*expert = {rollout_shards} batch shards")


def _max_positions(hf_dir: str) -> int:
  try:
    with open(os.path.join(hf_dir, "config.json")) as f:
      return int(json.load(f).get("max_position_embeddings") or 0)
  except (OSError, ValueError, TypeError, AttributeError):
    return 0  # hf.load names what is wrong with the directory.


def dataset_files(section, field: str, name: str) -> list[str]:
  """The non-empty paths of `section.field`; at least one for train_files."""
  files = [f for f in getattr(section, field) if f]
  check(files or field == "eval_files", f"{name}.{field}", getattr(section, field), "at least one dataset file")
  return files


@typed
def validate_pairs(cfg: Config, name: str) -> None:
  """Checks the `rm` or `dpo` section before anything is built (its own fields were checked with it)."""
  getattr(cfg, name).check_runnable()
