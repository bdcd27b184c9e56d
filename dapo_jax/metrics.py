"""Metric writers: TensorBoard event files, metrics.jsonl, Weights & Biases; the RL console line.

Only process 0 writes. TensorBoard files are written with tensorboard's own event writer and
protos (no TensorFlow needed). The W&B run keeps its id in WORKDIR/wandb_run_id, so a resumed
run continues the same W&B run; with WANDB_MODE=offline it is written under WORKDIR/wandb and
uploaded later with `wandb sync`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import uuid
from typing import Mapping

import numpy as np

from dapo_jax import console as console_lib
from dapo_jax import errors

WRITERS = ("tensorboard", "jsonl", "wandb")


class MetricsConfigError(errors.UserError, ValueError):
  pass


@dataclasses.dataclass(frozen=True)
class WriterConfig:
  """Where metrics go (the config's `metrics` section, field for field)."""
  writers: tuple[str, ...] = ("tensorboard", "jsonl")   # any of WRITERS
  wandb_project: str = "dapo_jax"
  wandb_entity: str = ""        # "" = the account's default entity
  wandb_name: str = ""          # "" = the workdir's name

  def __post_init__(self):
    object.__setattr__(self, "writers", tuple(self.writers))
    unknown = [w for w in self.writers if w not in WRITERS]
    if unknown:
      raise MetricsConfigError(f"metrics.writers: {unknown[0]!r} is not a writer; choose from {WRITERS}")


class MetricWriter:
  """Writes the same scalars (and sample texts) to every writer of `cfg.writers`.

  `run_config` (a plain dict, e.g. `cfg.to_dict()`) becomes the W&B run's config.
  """

  def __init__(self, workdir: str, enabled: bool = True, cfg: WriterConfig = WriterConfig(),
               run_config: Mapping | None = None):
    self.enabled = enabled
    self.path = workdir
    self.cfg = cfg
    self._tb = self._jsonl = self._wandb = None
    self._tables: dict[str, list] = {}  # W&B sample rows so far, per tag: each log shows them all
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    if "tensorboard" in cfg.writers:
      from tensorboard.summary.writer.event_file_writer import EventFileWriter
      self._tb = EventFileWriter(os.path.join(workdir, "tb"))
    if "jsonl" in cfg.writers:
      self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")
    if "wandb" in cfg.writers:
      self._wandb = _wandb_run(workdir, cfg, run_config)

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    if not self.enabled:
      return
    clean = {k: float(v) for k, v in values.items() if v is not None and np.ndim(v) == 0}
    if self._tb is not None:
      from tensorboard.compat.proto import event_pb2, summary_pb2
      summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=k, simple_value=v)
                                           for k, v in sorted(clean.items())])
      self._tb.add_event(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))
    if self._jsonl is not None:
      record = {"step": int(step), **{k: (v if math.isfinite(v) else str(v)) for k, v in clean.items()}}
      self._jsonl.write(json.dumps(record) + "\n")
    if self._wandb is not None:
      self._wandb.log(clean, step=int(step))

  def text(self, step: int, tag: str, text: str) -> None:
    """A text (e.g. sample generations: blocks separated by blank lines) at `step`: a TensorBoard
    text summary, and in W&B a table with one row per block."""
    if not self.enabled:
      return
    if self._tb is not None:
      from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
      tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[text.encode()],
                                      tensor_shape=tensor_shape_pb2.TensorShapeProto())
      meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
      value = summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=meta)
      self._tb.add_event(event_pb2.Event(wall_time=time.time(), step=int(step),
                                         summary=summary_pb2.Summary(value=[value])))
    if self._wandb is not None:
      import wandb
      rows = self._tables.setdefault(tag, [])
      rows += [[int(step), block] for block in text.split("\n\n") if block.strip()]
      self._wandb.log({tag: wandb.Table(columns=["step", "text"], data=list(rows))}, step=int(step))

  def flush(self) -> None:
    if self._tb is not None:
      self._tb.flush()
    if self._jsonl is not None:
      self._jsonl.flush()

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
    if self._jsonl is not None:
      self._jsonl.close()
    if self._wandb is not None:
      self._wandb.finish()
    self._tb = self._jsonl = self._wandb = None


def _wandb_run(workdir: str, cfg: WriterConfig, run_config: Mapping | None):
  """A W&B run logging into `workdir`; its id is kept in WORKDIR/wandb_run_id so that a resumed
  training run continues it (resume="allow" creates it the first time)."""
  try:
    import wandb
  except ImportError:
    raise MetricsConfigError("metrics.writers includes 'wandb' but the wandb package is not installed: "
                             'pip install -e ".[wandb]"') from None
  id_path = os.path.join(workdir, "wandb_run_id")
  if os.path.exists(id_path):
    with open(id_path) as f:
      run_id = f.read().strip()
  else:
    run_id = uuid.uuid4().hex[:12]  # W&B ids: lowercase letters and digits
    with open(id_path, "w") as f:
      f.write(run_id + "\n")
  name = cfg.wandb_name or os.path.basename(os.path.normpath(os.path.abspath(workdir)))
  return wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity or None, name=name, id=run_id,
                    resume="allow", dir=workdir, config=dict(run_config or {}), reinit="create_new")


def console(step: int, total: int, values: Mapping[str, float], keys: Mapping[str, str]) -> None:
  """One line per step: a progress bar and the headline numbers."""
  parts = [f"{label} {values[k]:.3g}" for k, label in keys.items() if k in values]
  console_lib.say(f"{console_lib.bar(step, total)} step {step}/{total}  " + "  ".join(parts))


def read_jsonl(path: str) -> dict[int, dict]:
  """metrics.jsonl -> {step: record}; a step logged twice (a resumed run) keeps its last record."""
  out: dict[int, dict] = {}
  with open(path) as f:
    for line in f:
      if line.strip():
        rec = json.loads(line)
        out.setdefault(rec["step"], {}).update(rec)
  return out


# --- What a DAPO rollout step logs (verl's names where verl has the quantity) -------------------

HEADLINE = {"critic/acc/mean": "acc", "rollout/acc_all": "acc(all)", "critic/score/mean": "score",
            "response_length/mean": "len", "actor/entropy": "ent", "train/num_gen_batches": "gen",
            "actor/grad_norm": "gnorm", "actor/reward_kl_penalty": "kl", "critic/vf_loss": "vf",
            "timing_s/step": "s", "val/acc/greedy": "VAL greedy"}


def format_eval(ev: Mapping[str, float]) -> str:
  return "  ".join(f"{k.removeprefix('val/acc/')} {v:.3f}" for k, v in ev.items() if not k.startswith("val/env/"))


def token_level(rewards_BC, returns_BC, values_BC, mask_BC, *, kl: float, beta: float) -> dict:
  """What the token-level estimators (REINFORCE++, PPO) log of a step, under verl's names: the KL to
  the reference and its coefficient, the token rewards summed per response, returns, values and
  the values' explained variance of the returns (`values_BC` None without a value model)."""
  real_B, m = mask_BC.any(1), mask_BC.astype(bool)
  out = {"actor/reward_kl_penalty": kl, "actor/reward_kl_penalty_coeff": beta}
  if real_B.any():
    named = [("rewards", rewards_BC.sum(1)[real_B]), ("returns", returns_BC[m])]
    named += [("values", values_BC[m])] if values_BC is not None else []
    for name, x in named:
      out.update({f"critic/{name}/mean": float(x.mean()), f"critic/{name}/max": float(x.max()),
                  f"critic/{name}/min": float(x.min())})
  if values_BC is not None and m.any():  # As verl: the rollout's values against the returns.
    err = returns_BC[m] - values_BC[m]
    out["critic/vf_explained_var"] = float(1.0 - np.var(err) / (np.var(returns_BC[m]) + 1e-5))
  return out


def step_metrics(groups, stats, info: dict, train: dict, timing: dict, adv: np.ndarray, step_s: float, *,
                 max_new_tokens: int, group_size: int, reward, skipped: int, truncated_prompts: int,
                 policy_version: int | None = None) -> dict:
  """The metrics of one rollout step: the trained groups (`datatypes.Groups` or None), what
  dynamic sampling saw (`dynamic_sampling.FillStats`), generation `info`, the mean update metrics.
  `rollout/samples` counts the responses generated (kept or not): runs that filter groups are
  compared with others at equal samples. `policy_version`: the version being trained, against which
  `rollout/staleness_*` count the trained rows' sampler versions (`Groups.version_QG`)."""
  m = {f"actor/{k}": v for k, v in train.items() if k not in ("lr", "grad_norm", "num_tokens")}
  if train:
    m["actor/lr"], m["actor/grad_norm"] = train["lr"], train["grad_norm"]
  if groups is not None:
    lengths = groups.length_QG
    m.update({
        "critic/score/mean": float(groups.score_QG.mean()), "critic/score/max": float(groups.score_QG.max()),
        "critic/score/min": float(groups.score_QG.min()), "critic/acc/mean": float(groups.acc_QG.mean()),
        "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": float((lengths >= max_new_tokens).mean()),
        "train/carried_groups": int(groups.carried_Q.sum())})  # trained against their sampling policy
    if policy_version is not None and len(groups):
      stale_QG = policy_version - groups.version_QG
      m["rollout/staleness_mean"], m["rollout/staleness_max"] = float(stale_QG.mean()), int(stale_QG.max())
      if (groups.switch_QG >= 0).any():  # Partial rollouts: tokens after a row's switch are one version newer.
        C = groups.tokens_QGC.shape[-1]
        newer_QGC = (groups.switch_QG[..., None] >= 0) & (np.arange(C) >= groups.switch_QG[..., None])
        stale_QGC = stale_QG[..., None] - newer_QGC
        m["rollout/partial_rows"] = float((groups.switch_QG >= 0).mean())
        m["rollout/staleness_token_mean"] = float(stale_QGC[groups.mask_QGC].mean())
    if adv.size:  # Per response, or per loss token (REINFORCE++, GAE).
      m.update({"critic/advantages/mean": float(adv.mean()), "critic/advantages/max": float(adv.max()),
                "critic/advantages/min": float(adv.min())})
  gen = max(stats.generated, 1)
  if stats.generated:  # A step filled from carried-over groups generated nothing.
    m["rollout/acc_all"] = stats.acc_sum / gen
  if hasattr(stats, "admitted"):  # Streaming dynamic sampling (`streaming.StreamStats`).
    m.update({"rollout/prompts_admitted": stats.admitted, "rollout/prompts_returned": stats.returned,
              "rollout/groups_kept": stats.kept,
              "rollout/max_in_flight": stats.max_in_flight, "rollout/slot_utilisation": stats.slot_utilisation,
              "timing_s/reward_wait": stats.reward_wait_s,
              "timing_s/reward_hidden": max(stats.reward_s - stats.reward_wait_s, 0.0)})
  m.update({
      "rollout/samples": stats.generated * group_size,
      "train/num_gen_batches": stats.gen_batches, "train/kept_fraction": stats.kept / gen,
      "train/all_correct_fraction": stats.all_correct / gen, "train/all_wrong_fraction": stats.all_wrong / gen,
      "train/cap_reached": int(stats.cap_reached),
      "reward/errors": reward.errors, "reward/timeouts": reward.timeouts,
      "train/skipped_updates": skipped, "data/truncated_prompts": truncated_prompts,
      "timing_s/gen": info["gen_s"], "timing_s/reward": info["reward_s"],
      "timing_s/old_log_prob": timing.get("old_log_prob_s", 0.0),
      "timing_s/update_actor": timing.get("update_actor_s", 0.0), "timing_s/step": step_s,
      "perf/throughput": info["gen_tokens"] / max(step_s, 1e-9)})
  m.update(info.get("data", {}))  # The stream's: data.curriculum's pools, mixed sources' outcomes (data/*)
  if "carry_dropped" in info:  # Carried groups past their staleness bound (`pipelining.bound_carry`).
    m["rollout/carry_dropped_stale"] = info["carry_dropped"]
  m.update(info.get("env", {}))  # Episodes: this rollout's environment errors, timeouts, turns (`loop.DAPO.collect`).
  return m


def mean_updates(updates: list[dict]) -> dict:
  """A rollout step's update metrics: the mean over the updates that were applied, weighted by their
  loss tokens (as verl logs them); an update of padding only (no loss tokens) does not count.
  `update_skipped` is the number of non-finite updates skipped."""
  w = np.array([u.get("update_applied", 1.0) * u.get("num_tokens", 1.0) for u in updates], np.float64)
  if w.sum() == 0:
    w = np.ones(len(updates))
  out = {k: float(np.average([u[k] for u in updates], weights=w)) for k in updates[0]}
  out["update_skipped"] = float(np.sum([u["update_skipped"] for u in updates]))
  return out


def sample_text(tok, texts, groups, G: int) -> str:
  """Two prompts of a step's first groups with two responses each, for TensorBoard ("" if none)."""
  if texts is None or groups is None:
    return ""
  lines = []
  for q in range(min(2, len(groups))):
    prompt = tok.decode(groups.prompt_QP[q][groups.prompt_mask_QP[q]], skip_special_tokens=True)
    for g in range(min(2, G)):
      lines.append(f"PROMPT: {prompt!r}\nRESPONSE: {texts[q * G + g]!r}  score={groups.score_QG[q, g]:+.2f}")
  return "\n\n".join(lines)


# --- Memory and speed (verl's perf/* names where verl has the quantity) ---------------------------

# Dense bf16 matmul peak per device (FLOP/s), by `jax.Device.device_kind`; the longest name that
# the kind contains wins. A kind not listed (CPUs) gets no MFU unless `train.peak_flops` sets it.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "H20": 148e12, "B200": 2250e12, "A100": 312e12,
              "A800": 312e12, "L40S": 362e12, "L4": 121e12, "TPU v4": 275e12, "TPU v5 lite": 197e12,
              "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v5": 459e12, "TPU v6 lite": 918e12, "TPU v6e": 918e12,
              "TPU7x": 2307e12}


def peak_flops(device_kind: str) -> float | None:
  names = [k for k in PEAK_FLOPS if k.lower() in device_kind.lower()]
  return PEAK_FLOPS[max(names, key=len)] if names else None


def matmul_params(mc) -> int:
  """Parameters that take part in matmuls per token (the projections and the unembedding): a
  forward costs 2x this many FLOPs per token, a forward and backward 6x."""
  D, F, N, K, H = mc.embed_dim, mc.mlp_dim, mc.num_heads, mc.num_kv_heads, mc.head_dim
  experts = max(getattr(mc, "experts_per_token", 0), 1) if getattr(mc, "num_experts", 0) else 1
  mlp = 3 * D * (mc.expert_mlp_dim if getattr(mc, "num_experts", 0) else F) * experts
  return mc.num_layers * (D * H * (2 * N + 2 * K) + mlp) + mc.vocab_size * D


def memory() -> dict:
  """Host resident memory now and at its peak; the local devices' memory in use and at peak (the
  largest device), where the backend reports it (`Device.memory_stats()`; CPUs do not: omitted)."""
  import resource

  import jax
  out = {}
  try:
    with open("/proc/self/statm") as f:
      out["perf/cpu_memory_used_gb"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
  except (OSError, ValueError, IndexError):  # Not Linux.
    pass
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
  out["perf/cpu_memory_peak_gb"] = peak * (1 if os.uname().sysname == "Darwin" else 1024) / 1e9
  stats = []
  for d in jax.local_devices():
    try:
      s = d.memory_stats()
    except Exception:  # noqa: BLE001 (a backend without memory stats)
      s = None
    if s:
      stats.append(s)
  if stats:
    if any("bytes_in_use" in s for s in stats):
      out["perf/memory_allocated_gb"] = max(s.get("bytes_in_use", 0) for s in stats) / 1e9
    if any("peak_bytes_in_use" in s for s in stats):
      out["perf/max_memory_allocated_gb"] = max(s.get("peak_bytes_in_use", 0) for s in stats) / 1e9
    if any("bytes_limit" in s for s in stats):
      out["perf/memory_limit_gb"] = max(s.get("bytes_limit", 0) for s in stats) / 1e9
  return out


def speed(*, gen_tokens: int, gen_s: float, prompt_tokens: int, update_tokens: int, update_s: float,
          forward_tokens: int, step_s: float, flops_per_token: float, peak: float | None, devices: int) -> dict:
  """Tokens per second of generation and of the updates, the model FLOP/s of the whole step and its
  MFU against `peak` per device (None: no MFU). FLOPs: 2·N per generated or prefilled token, 6·N per
  token of an update (forward and backward), 2·N per token of the extra forward passes (π_old,
  reference); N = `matmul_params` (attention's own FLOPs are left out)."""
  out = {}
  if gen_tokens and gen_s > 0:
    out["perf/gen_tokens_per_s"] = gen_tokens / gen_s
  if update_tokens and update_s > 0:
    out["perf/update_tokens_per_s"] = update_tokens / update_s
  flops = flops_per_token * (2 * (gen_tokens + prompt_tokens + forward_tokens) + 6 * update_tokens)
  if step_s > 0:
    out["perf/model_flops_per_s"] = flops / step_s
    if peak:
      out["perf/mfu"] = flops / step_s / (peak * devices)
  return out
