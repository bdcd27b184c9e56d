"""The RLHF notebook's commands name real entry points, flags, configs and config fields.

The notebook runs each stage for minutes (SFT, reward model, PPO, DPO), too long for CI; this runs
its cells with `sh` recording the commands instead, and checks every command the way absl and
ml_collections would parse it."""
import ast
import importlib
import os
import re

import nbformat

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _check(args):
  module = args[0]
  src = open(os.path.join(ROOT, *module.split(".")) + ".py").read()
  defined = set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", src))
  if "define_config()" in src:
    defined.add("config")
  cfg = None
  for a in args[1:]:
    if not a.startswith("--"):
      assert a in ast.literal_eval(src.split("commands = ", 1)[1].split("\n", 1)[0]), (module, a)
      continue
    if "=" not in a:  # A boolean flag: --name (or --noname).
      assert a[2:] in defined or (a.startswith("--no") and a[4:] in defined), f"{module}: no flag {a}"
      continue
    name, value = a[2:].split("=", 1)
    if name == "config":
      path, _, arg = value.partition(":")
      spec = importlib.util.spec_from_file_location("nb_config", os.path.join(ROOT, path))
      mod = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(mod)
      cfg = mod.get_config(arg or None)
      cfg.lock()
    elif name.startswith("config."):
      assert cfg is not None, f"{module}: {a} before --config"
      *groups, field = name.split(".")[1:]
      node = cfg
      for g in groups:
        node = node[g]
      assert field in node, f"{module}: no config field {name}"
      try:
        v = ast.literal_eval(value)
      except (ValueError, SyntaxError):
        v = value
      node[field] = v  # A locked ConfigDict refuses a value of another type.
    else:
      assert name in defined, f"{module}: no flag --{name}"


def test_notebook_commands_parse():
  nb = nbformat.read(os.path.join(ROOT, "notebooks", "rlhf_pipeline.ipynb"), as_version=4)
  cells = [c.source for c in nb.cells if c.cell_type == "code"]
  calls = []
  ns = {}
  exec(cells[0], ns)  # noqa: S102 - the notebook's set-up: paths, step counts, helpers.
  ns["sh"] = lambda *args: calls.append(args) or ""
  ns["heldout"] = lambda *a: {}
  for source in cells[1:]:
    exec(source, ns)  # noqa: S102
  stages = [a[0] for a in calls]
  for stage in ("launch.sft", "launch.rm", "launch.train", "launch.dpo", "launch.prepare", "launch.eval"):
    assert stage in stages, stage
  for args in calls:
    _check(args)
