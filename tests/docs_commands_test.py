"""Every `python -m launch.*` command line written in README.md and docs/*.md resolves its config: run
with `--dry_run` (the config file, its argument and the overrides, checked for the mesh it names) it
exits 0. Each command runs in a child forked from one process that has imported the heavy libraries
once, so the whole set takes seconds per dozen."""
import glob
import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The launchers that take --config (and so --dry_run).
LAUNCHERS = ("train", "eval", "sample", "sft", "rm", "dpo", "export", "serve", "plan", "ablate", "sweep", "bench")
PLACEHOLDERS = {"$DIR": "/tmp/dapo_docs_dir", "$W": "/tmp/dapo_docs_w", "W/": "/tmp/dapo_docs_w/"}


def command_lines(path: str) -> list[tuple[str, int, list[str]]]:
  """(file, line, argv after `python -m`) of each launcher command in a code block of `path`."""
  lines = open(path, encoding="utf-8").read().splitlines()
  out, i, fenced = [], 0, False
  while i < len(lines):
    line = lines[i]
    fenced ^= line.strip().startswith("```")
    start = i
    prefix = line[:line.find("python -m launch.")].split()
    # A command on its own (maybe behind VAR=value assignments), not one quoted inside another.
    if ((fenced or line.startswith("    ")) and "python -m launch." in line
        and all(re.fullmatch(r"[A-Z_]+=[^\s\"']*", p) for p in prefix)):
      text = line
      while text.rstrip().endswith("\\") and i + 1 < len(lines):
        i += 1
        text = text.rstrip()[:-1] + " " + lines[i].strip()
      text = text[text.index("python -m launch."):]
      text = re.split(r"\s+#", text, maxsplit=1)[0].strip()
      for k, v in PLACEHOLDERS.items():
        text = text.replace(k, v)
      argv = shlex.split(text)[2:]
      module = argv[0].split(".", 1)[1]
      if module in LAUNCHERS and not any("|" in a or "..." in a or "<" in a for a in argv):
        out.append((os.path.relpath(path, ROOT), start + 1, argv))
    i += 1
  return out


RUNNER = r"""
import json, os, sys, runpy
import jax, ml_collections, absl.app  # imported once, before the children fork
from dapo_jax import builders
results = []
for argv in json.load(sys.stdin):
  r, w = os.pipe()
  pid = os.fork()
  if pid == 0:
    os.close(r)
    os.dup2(w, 2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    sys.argv = [argv[0].replace(".", "/") + ".py", *argv[1:], "--dry_run"]
    try:
      runpy.run_module(argv[0], run_name="__main__")
    except SystemExit as e:
      os._exit(e.code if isinstance(e.code, int) else 1)
    except BaseException as e:
      print(repr(e), file=sys.stderr)
      os._exit(1)
    os._exit(3)  # a launcher that ran without exiting: --dry_run did not stop it
  os.close(w)
  with os.fdopen(r) as f:
    err = f.read()
  _, status = os.waitpid(pid, 0)
  results.append((os.waitstatus_to_exitcode(status), err[-600:]))
json.dump(results, sys.stdout)
"""


def test_every_documented_command_resolves_its_config():
  import json
  commands = [c for p in ["README.md", *sorted(glob.glob(os.path.join("docs", "*.md")))]
              for c in command_lines(os.path.join(ROOT, p))]
  assert len(commands) >= 40 and any(c[0] == "README.md" for c in commands)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  out = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps([argv for _, _, argv in commands]),
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  failed = [f"{path}:{line}: python -m {' '.join(argv)}\n    {err.strip().splitlines()[-1] if err.strip() else code}"
            for (path, line, argv), (code, err) in zip(commands, json.loads(out.stdout)) if code != 0]
  assert not failed, "\n".join(failed)
