"""Metric writers: TensorBoard event files, metrics.jsonl, and a one-line console summary.

Only process 0 writes. TensorBoard files are written with tensorboard's own event writer and
protos (no TensorFlow needed).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Mapping

import numpy as np


class MetricWriter:
  def __init__(self, workdir: str, enabled: bool = True):
    self.enabled = enabled
    self.path = workdir
    if not enabled:
      return
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    os.makedirs(workdir, exist_ok=True)
    self._tb = EventFileWriter(os.path.join(workdir, "tb"))
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    if not self.enabled:
      return
    from tensorboard.compat.proto import event_pb2, summary_pb2
    clean = {k: float(v) for k, v in values.items() if v is not None and np.ndim(v) == 0}
    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=k, simple_value=v)
                                         for k, v in sorted(clean.items())])
    self._tb.add_event(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))
    record = {"step": int(step), **{k: (v if math.isfinite(v) else str(v)) for k, v in clean.items()}}
    self._jsonl.write(json.dumps(record) + "\n")

  def text(self, step: int, tag: str, text: str) -> None:
    if not self.enabled:
      return
    from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
    tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[text.encode()],
                                    tensor_shape=tensor_shape_pb2.TensorShapeProto())
    meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
    value = summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=meta)
    self._tb.add_event(event_pb2.Event(wall_time=time.time(), step=int(step),
                                       summary=summary_pb2.Summary(value=[value])))

  def flush(self) -> None:
    if self.enabled:
      self._tb.flush()
      self._jsonl.flush()

  def close(self) -> None:
    if self.enabled:
      self._tb.close()
      self._jsonl.close()


def console(step: int, total: int, values: Mapping[str, float], keys: Mapping[str, str]) -> None:
  """One line per step: a progress bar and the headline numbers."""
  width = 20
  done = int(width * step / max(total, 1))
  parts = [f"{label} {values[k]:.3g}" for k, label in keys.items() if k in values]
  print(f"[{'#' * done}{'.' * (width - done)}] step {step}/{total}  " + "  ".join(parts), flush=True)
  sys.stdout.flush()


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
            "actor/grad_norm": "gnorm", "timing_s/step": "s", "val/acc/greedy": "VAL greedy"}


def format_eval(ev: Mapping[str, float]) -> str:
  return "  ".join(f"{k.removeprefix('val/acc/')} {v:.3f}" for k, v in ev.items())


def step_metrics(groups, stats, info: dict, train: dict, timing: dict, adv: np.ndarray, step_s: float, *,
                 max_new_tokens: int, reward, skipped: int, truncated_prompts: int) -> dict:
  """The metrics of one rollout step: the trained groups (`datatypes.Groups` or None), what
  dynamic sampling saw (`advantages.FillStats`), generation `info`, the mean update metrics."""
  m = {f"actor/{k}": v for k, v in train.items() if k not in ("lr", "grad_norm", "num_tokens")}
  if train:
    m["actor/lr"], m["actor/grad_norm"] = train["lr"], train["grad_norm"]
  if groups is not None:
    lengths = groups.length_QG
    m.update({
        "critic/score/mean": float(groups.score_QG.mean()), "critic/score/max": float(groups.score_QG.max()),
        "critic/score/min": float(groups.score_QG.min()), "critic/acc/mean": float(groups.acc_QG.mean()),
        "critic/advantages/mean": float(adv.mean()), "critic/advantages/max": float(adv.max()),
        "critic/advantages/min": float(adv.min()),
        "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": float((lengths >= max_new_tokens).mean())})
  gen = max(stats.generated, 1)
  if stats.generated:  # A step filled from carried-over groups generated nothing.
    m["rollout/acc_all"] = stats.acc_sum / gen
  if hasattr(stats, "admitted"):  # Streaming dynamic sampling (`streaming.StreamStats`).
    m.update({"rollout/prompts_admitted": stats.admitted, "rollout/groups_kept": stats.kept,
              "rollout/max_in_flight": stats.max_in_flight, "rollout/slot_utilisation": stats.slot_utilisation,
              "timing_s/reward_wait": stats.reward_wait_s,
              "timing_s/reward_hidden": max(stats.reward_s - stats.reward_wait_s, 0.0)})
  m.update({
      "train/num_gen_batches": stats.gen_batches, "train/kept_fraction": stats.kept / gen,
      "train/all_correct_fraction": stats.all_correct / gen, "train/all_wrong_fraction": stats.all_wrong / gen,
      "train/cap_reached": int(stats.cap_reached),
      "reward/errors": reward.errors, "reward/timeouts": reward.timeouts,
      "train/skipped_updates": skipped, "data/truncated_prompts": truncated_prompts,
      "timing_s/gen": info["gen_s"], "timing_s/reward": info["reward_s"],
      "timing_s/old_log_prob": timing.get("old_log_prob_s", 0.0),
      "timing_s/update_actor": timing.get("update_actor_s", 0.0), "timing_s/step": step_s,
      "perf/throughput": info["gen_tokens"] / max(step_s, 1e-9)})
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
