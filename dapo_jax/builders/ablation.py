"""An ablation study, as the paper's Table 1: every stage x seed trained from one shared warm
start, then a table at equal generated samples and at equal rollout steps, and curves.

    ablation.run({"naive_grpo": cfg, ..., "dapo": cfg}, seeds=3, workdir="runs/ablation")

The stages' configs differ only in the algorithm; each run gets its seed and the shared start. The
workdir holds

    start/sft_model/     the SFT warm start every run begins from (an HF directory with its
                         tokenizer), trained once: the configs' `model.init="sft"`
    <stage>/seed<k>/     one training run, as `launch.train` writes it (metrics.jsonl, checkpoints/)
    table.md, table.json, curves.png

and the same call resumes: a run whose metrics reach its last step is not re-run, an interrupted
one resumes from its checkpoints. Dynamic sampling generates more responses per rollout step than
it trains on, so stages are compared at equal generated samples (`rollout/samples`) as well as at
equal steps.
"""
from __future__ import annotations

import json
import os
from typing import Mapping, Sequence

import numpy as np

from dapo_jax import metrics as metrics_lib
from dapo_jax import sharding
from dapo_jax.builders import model, rl, task
from dapo_jax.errors import ConfigError

END_STEPS = 5  # "At the end" is the mean over a run's last rollout steps: one step's batch is small.
END_METRICS = {"actor/entropy": "entropy", "response_length/mean": "length",
               "response_length/clip_ratio": "truncated", "actor/pg_clipfrac_eps_high": "clip_high",
               "actor/pg_clipfrac_eps_low": "clip_low"}


class Interrupted(RuntimeError):
  """A run stopped before its last step (a signal): the same command resumes it."""


# --- running --------------------------------------------------------------------------------------

def run_dir(workdir: str, stage: str, seed: int) -> str:
  return os.path.join(workdir, stage, f"seed{seed}")


def shared_start(cfg, workdir: str, mesh) -> str:
  """The HF directory of the SFT warm start of `cfg` (`model.init="sft"`), trained once into
  WORKDIR/start with the config's own seed."""
  if cfg.model.init != "sft":
    raise ConfigError(f"model.init={cfg.model.init!r}: an ablation shares the SFT warm start "
                      "between its runs; expected 'sft'")
  start = os.path.join(workdir, "start")
  train, _ = task.datasets(cfg)
  tok = model.tokenizer(cfg, start, train)
  model.initial_model(cfg, start, tok, mesh, train)  # Trains and saves start/sft_model once.
  return os.path.join(start, "sft_model")


def run_config(cfg, start_dir: str, seed: int):
  """`cfg` for one seed, starting from the shared warm start (model and tokenizer)."""
  cfg = cfg.copy_and_resolve_references()
  cfg.seed = seed
  cfg.model.update(init="hf", hf_dir=start_dir)
  return cfg


def finished(workdir: str, num_steps: int) -> bool:
  path = os.path.join(workdir, "metrics.jsonl")
  return os.path.exists(path) and max(metrics_lib.read_jsonl(path), default=-1) >= num_steps


def run(stage_cfgs: Mapping[str, object], seeds: int, workdir: str, mesh=None) -> dict:
  """Trains every stage x seed not yet finished (stage by stage), then writes the report; returns
  the table (`table`). Raises `Interrupted` when a run stopped before its end."""
  first = next(iter(stage_cfgs.values()))
  mesh = mesh if mesh is not None else sharding.make_mesh(first.mesh)
  start = shared_start(first, workdir, mesh)
  for stage, cfg in stage_cfgs.items():
    for seed in range(seeds):
      out = run_dir(workdir, stage, seed)
      if finished(out, cfg.train.num_steps):
        print(f"{out}: finished, not re-run", flush=True)
        continue
      print(f"=== {stage}, seed {seed} -> {out}", flush=True)
      rl.run(run_config(cfg, start, seed), out, mesh)
      if not finished(out, cfg.train.num_steps):
        raise Interrupted(f"{out} stopped before step {cfg.train.num_steps}; run the same command to resume")
  return report(workdir, list(stage_cfgs), seeds)


# --- reading the runs -----------------------------------------------------------------------------

def eval_key(records: Mapping[int, dict]) -> str:
  """The run's sampled held-out metric, e.g. 'val/acc/mean@4'."""
  keys = sorted({k for r in records.values() for k in r if k.startswith("val/acc/mean@")})
  if len(keys) != 1:
    raise ValueError(f"expected one held-out mean@k metric in the run, found {keys}")
  return keys[0]


def run_curves(records: Mapping[int, dict]) -> dict:
  """A run's metrics by rollout step: cumulative generated samples after each step, the held-out
  evaluations (step 0 is before RL), and the per-step metrics that END_METRICS names."""
  steps = np.array(sorted(s for s in records if s > 0))
  samples = np.cumsum([records[s].get("rollout/samples", 0.0) for s in steps])
  at = {0: 0.0, **dict(zip(steps.tolist(), samples.tolist()))}
  mean_key = eval_key(records)
  evals = sorted(s for s in records if mean_key in records[s])
  out = {"steps": steps, "samples": samples, "eval_steps": np.array(evals),
         "eval_samples": np.array([at[s] for s in evals]),
         "mean": np.array([records[s][mean_key] for s in evals]),
         "greedy": np.array([records[s].get("val/acc/greedy", np.nan) for s in evals])}
  for k in END_METRICS:
    out[k] = np.array([records[s].get(k, np.nan) for s in steps], np.float64)
  return out


def spread(values: Sequence[float]) -> dict:
  """Mean and spread over seeds (std with ddof=1; 0 for one seed)."""
  v = np.asarray(values, np.float64)
  return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
          "min": float(v.min()), "max": float(v.max()), "values": v.tolist()}


def table(curves: Mapping[str, Sequence[dict]], eval_name: str = "mean@k") -> dict:
  """Per stage, over its seeds: held-out accuracy at the largest sample budget every run reached
  at an evaluation (linear interpolation between evaluations), and at the last step every run
  evaluated; samples generated by then; the END_METRICS averaged over the last END_STEPS steps."""
  runs = [c for cs in curves.values() for c in cs]
  budget = float(min(c["eval_samples"][-1] for c in runs))
  step = int(min(c["eval_steps"][-1] for c in runs))
  out = {"eval": eval_name, "budget_samples": budget, "budget_step": step, "end_steps": END_STEPS,
         "stages": {}}
  for stage, cs in curves.items():
    by_samples = lambda key: spread([np.interp(budget, c["eval_samples"], c[key]) for c in cs])
    by_step = lambda key: spread([np.interp(step, c["eval_steps"], c[key]) for c in cs])
    row = {"seeds": len(cs), f"{eval_name}_at_samples": by_samples("mean"), "greedy_at_samples": by_samples("greedy"),
           "step_at_samples": spread([np.interp(budget, np.append(0, c["samples"]), np.append(0, c["steps"]))
                                      for c in cs]),
           f"{eval_name}_at_step": by_step("mean"), "greedy_at_step": by_step("greedy"),
           "samples_at_step": by_step("eval_samples"), "before_rl": spread([c["mean"][0] for c in cs]),
           # What the overlong techniques have to act on: the responses cut off by the budget at first.
           "truncated_start": spread([c["response_length/clip_ratio"][0] for c in cs])}
    for k, name in END_METRICS.items():
      ends = [np.nanmean(c[k][-END_STEPS:]) if np.isfinite(c[k][-END_STEPS:]).any() else np.nan for c in cs]
      row[name] = spread(ends)
    out["stages"][stage] = row
  return out


def load_curves(workdir: str, stages: Sequence[str], seeds: int) -> dict[str, list[dict]]:
  return {stage: [run_curves(metrics_lib.read_jsonl(os.path.join(run_dir(workdir, stage, seed), "metrics.jsonl")))
                  for seed in range(seeds)] for stage in stages}


# --- writing the report ---------------------------------------------------------------------------

def markdown(t: dict) -> str:
  """The table as markdown: mean ± std over seeds."""
  e, n = t["eval"], f"{t['budget_samples']:,.0f}"
  fmt = lambda s, p=3: f"{s['mean']:.{p}f} ± {s['std']:.{p}f}"
  head = (f"| stage | {e} at {n} samples | greedy at {n} samples | {e} at step {t['budget_step']} | "
          f"greedy at step {t['budget_step']} | samples by step {t['budget_step']} | entropy | length | "
          "truncated at step 1 | truncated | clip high | clip low |")
  lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
  for stage, r in t["stages"].items():
    lines.append(f"| {stage} | {fmt(r[f'{e}_at_samples'])} | {fmt(r['greedy_at_samples'])} | "
                 f"{fmt(r[f'{e}_at_step'])} | {fmt(r['greedy_at_step'])} | {r['samples_at_step']['mean']:,.0f} | "
                 f"{fmt(r['entropy'], 2)} | {fmt(r['length'], 1)} | {fmt(r['truncated_start'])} | "
                 f"{fmt(r['truncated'])} | "
                 f"{fmt(r['clip_high'], 4)} | {fmt(r['clip_low'], 4)} |")
  seeds = {r["seeds"] for r in t["stages"].values()}
  before = np.mean([r["before_rl"]["mean"] for r in t["stages"].values()])
  lines += ["", f"Mean ± std over {max(seeds)} seed(s) (min and max per seed in table.json); held-out "
            f"{e} before RL {before:.3f}. Accuracy at equal samples is interpolated between evaluations; "
            f"entropy, response length, truncated fraction and clip fractions are the mean of the last "
            f"{t['end_steps']} rollout steps."]
  return "\n".join(lines) + "\n"


def plot(curves: Mapping[str, Sequence[dict]], path: str, eval_name: str = "mean@k") -> bool:
  """curves.png: held-out accuracy, entropy and the truncated fraction against generated samples,
  per stage (mean over seeds, the band from the lowest to the highest seed). False when matplotlib
  is missing."""
  try:
    from matplotlib.figure import Figure
  except ImportError:
    return False
  fig = Figure(figsize=(15, 4), layout="constrained")
  acc_ax, ent_ax, cut_ax = fig.subplots(1, 3)
  for i, (stage, cs) in enumerate(curves.items()):
    color = f"C{i}"
    # Seeds of a stage that filters groups generate different numbers of samples: share a grid.
    _band(acc_ax, [(c["eval_samples"], c["mean"]) for c in cs], color, stage)
    _band(ent_ax, [(c["samples"], _smooth(c["actor/entropy"])) for c in cs], color, stage)
    _band(cut_ax, [(c["samples"], _smooth(c["response_length/clip_ratio"])) for c in cs], color, stage)
  acc_ax.set(xlabel="generated samples", ylabel=f"held-out {eval_name}", title="Held-out accuracy")
  ent_ax.set(xlabel="generated samples", ylabel="token entropy (5-step mean)", title="Policy entropy")
  cut_ax.set(xlabel="generated samples", ylabel="truncated fraction (5-step mean)", title="Responses cut off")
  acc_ax.legend(fontsize=8)
  for ax in (acc_ax, ent_ax, cut_ax):
    ax.grid(alpha=0.3)
  fig.savefig(path, dpi=90)
  return True


def _band(ax, xys, color: str, label: str) -> None:
  hi = min(x[-1] for x, _ in xys)
  grid = np.linspace(min(x[0] for x, _ in xys), hi, 100)
  ys = np.stack([np.interp(grid, x, y) for x, y in xys])
  ax.plot(grid, ys.mean(0), color=color, label=label)
  ax.fill_between(grid, ys.min(0), ys.max(0), color=color, alpha=0.15, linewidth=0)


def _smooth(y: np.ndarray, window: int = 5) -> np.ndarray:
  """Trailing mean over `window` steps (fewer at the start); NaN steps (no update) are skipped."""
  out = np.full(len(y), np.nan)
  for i in range(len(y)):
    w = y[max(0, i - window + 1):i + 1]
    if np.isfinite(w).any():
      out[i] = np.nanmean(w)
  return out


def report(workdir: str, stages: Sequence[str], seeds: int) -> dict:
  """Writes table.md, table.json and curves.png (when matplotlib is installed) into `workdir`."""
  curves = load_curves(workdir, stages, seeds)
  name = eval_key(metrics_lib.read_jsonl(os.path.join(run_dir(workdir, stages[0], 0), "metrics.jsonl")))
  name = name.removeprefix("val/acc/")
  t = table(curves, name)
  with open(os.path.join(workdir, "table.json"), "w") as f:
    json.dump(t, f, indent=1)
  md = markdown(t)
  with open(os.path.join(workdir, "table.md"), "w") as f:
    f.write(md)
  t["plotted"] = plot(curves, os.path.join(workdir, "curves.png"), name)
  return t
