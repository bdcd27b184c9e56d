"""Plot a run's curves from its metrics.jsonl into one PNG (needs matplotlib: pip install -e ".[plot]").

  python -m launch.plot --workdir=runs/default              # writes runs/default/curves.png
  python -m launch.plot --workdir=runs/default --out=curves.png

Panels, against the rollout step: held-out accuracy (val/acc/*), reward and accuracy of the
trained groups, response length, entropy, clip fractions, and the groups dynamic sampling kept.
A quantity the run did not log leaves its panel empty, saying so.
"""
import math
import os

from absl import flags

from . import common

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (its metrics.jsonl).", required=True)
_OUT = flags.DEFINE_string("out", None, "PNG to write (default: WORKDIR/curves.png).")

# (title, [(metric, label)]); a metric with a trailing "*" stands for every key with that prefix.
PANELS = (
    ("held-out accuracy", [("val/acc/*", None)]),
    ("reward (trained groups)", [("critic/score/mean", "score"), ("critic/acc/mean", "acc"),
                                 ("rollout/acc_all", "acc, all generated")]),
    ("response length (tokens)", [("response_length/mean", "mean"), ("response_length/max", "max")]),
    ("entropy", [("actor/entropy", "entropy")]),
    ("clip fractions", [("actor/pg_clipfrac_eps_high", "ε_high"), ("actor/pg_clipfrac_eps_low", "ε_low"),
                        ("actor/pg_clipfrac_lower", "dual clip"), ("actor/pg_clipfrac", "any")]),
    ("groups kept by dynamic sampling", [("train/kept_fraction", "kept"),
                                         ("train/all_correct_fraction", "all correct"),
                                         ("train/all_wrong_fraction", "all wrong")]),
)


def series(records: dict, key: str) -> tuple[list, list]:
  """(steps, values) of `key`, finite values only."""
  steps, values = [], []
  for step in sorted(records):
    v = records[step].get(key)
    if isinstance(v, (int, float)) and math.isfinite(v):
      steps.append(step)
      values.append(v)
  return steps, values


def plot(records: dict, out: str, title: str = "") -> int:
  """Writes the panels of `records` ({step: metrics}, `metrics.read_jsonl`) to `out`; returns the
  number of curves drawn."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  keys = sorted({k for rec in records.values() for k in rec})
  fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
  drawn = 0
  for ax, (name, metrics) in zip(axes.flat, PANELS):
    for key, label in metrics:
      for k in [k for k in keys if k.startswith(key[:-1])] if key.endswith("*") else [key]:
        steps, values = series(records, k)
        if steps:
          ax.plot(steps, values, marker="." if len(steps) < 30 else None, label=label or k.split("/")[-1])
          drawn += 1
    ax.set_title(name)
    ax.set_xlabel("rollout step")
    ax.grid(alpha=0.3)
    if ax.lines:
      ax.legend(fontsize=8)
    else:
      ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
  fig.suptitle(title)
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return drawn


def main(argv):
  del argv
  from dapo_jax import metrics
  path = os.path.join(_WORKDIR.value, "metrics.jsonl")
  if not os.path.exists(path):
    raise SystemExit(f"error: {path}: no such file (train first, with metrics.writers including 'jsonl')")
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    raise SystemExit('error: launch.plot needs matplotlib: pip install -e ".[plot]"') from None
  records = metrics.read_jsonl(path)
  out = _OUT.value or os.path.join(_WORKDIR.value, "curves.png")
  n = plot(records, out, title=os.path.basename(os.path.normpath(_WORKDIR.value)))
  print(f"wrote {out}: {n} curves over {len(records)} logged steps", flush=True)


if __name__ == "__main__":
  common.run(main)
