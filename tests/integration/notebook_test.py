"""The quickstart notebook runs the default job top to bottom on CPU: RL raises held-out accuracy, and the
README's `launch.sample` line, asked of the trained run, answers as the README says."""
import ast
import os
import re
import shlex
import subprocess
import sys

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The default job's measured rise is in docs/results.md; the standard error of a mean@4 over 200 problems
# is ~0.02.
MIN_RISE = 0.30


def code_digest(nb) -> str:
  """As docs/scripts/execute_notebook.py stamps it: SHA-256 of the code cells, in order."""
  import hashlib
  return hashlib.sha256("\n\0".join(c.source for c in nb.cells if c.cell_type == "code").encode()).hexdigest()


def evals_printed(nb) -> list[dict]:
  """The plot cell prints the first and the last evaluation's metrics as two dicts."""
  outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
  return [ast.literal_eval(line) for line in outputs.splitlines() if line.startswith("{'val/")]


def test_quickstart_is_saved_with_the_outputs_of_its_own_code():
  # A reader sees results without running it; they come from the code it holds (stamped when it was run
  # by docs/scripts/execute_notebook.py), the default job, and show what the default job shows.
  nb = nbformat.read(os.path.join(ROOT, "notebooks", "quickstart.ipynb"), as_version=4)
  stamp = nb.metadata.get("dapo_jax", {})
  assert stamp.get("code_sha256") == code_digest(nb), "the code changed since the outputs were saved: rerun it"
  assert stamp.get("environment", {}).get("QUICKSTART_DEFAULT_JOB") == "1"
  first, last = evals_printed(nb)
  assert last["val/acc/mean@4"] >= first["val/acc/mean@4"] + MIN_RISE, (first, last)
  install = nb.cells[1]
  assert "pip install" in install.source and "skip-execution" in install.metadata.get("tags", [])
  assert "dapo_jax.builders" not in "".join(c.source for c in nb.cells)   # the Python API only


def readme_sample_line():
  """The README's `launch.sample` command line and the answer its comment promises."""
  for line in open(os.path.join(ROOT, "README.md")):
    if line.strip().startswith("python -m launch.sample --workdir=runs/default"):
      command, _, answer = line.strip().partition("# greedy:")
      return shlex.split(command), answer.strip()
  raise AssertionError("README.md has no `python -m launch.sample --workdir=runs/default` line")


@pytest.mark.slow  # The default job itself (SFT to 30% of a probe, 100 RL steps): about 5 minutes.
def test_quickstart_runs_the_default_job_which_learns_and_answers_the_readme_question(tmp_path):
  import nbclient
  nb = nbformat.read(os.path.join(ROOT, "notebooks", "quickstart.ipynb"), as_version=4)
  workdir = str(tmp_path / "default")
  env = {"XLA_FLAGS": "", "PYTHONPATH": ROOT, "QUICKSTART_DEFAULT_JOB": "1", "QUICKSTART_WORKDIR": workdir}
  old = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  try:
    nbclient.NotebookClient(nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": ROOT}}).execute()
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
  outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
  assert "Held-out before RL" in outputs and "parameters" in outputs
  assert any(o.get("output_type") == "display_data" for c in nb.cells for o in c.get("outputs", []))
  evals = evals_printed(nb)
  assert len(evals) == 2, outputs[-2000:]
  first, last = evals
  print("held-out mean@4", first["val/acc/mean@4"], "->", last["val/acc/mean@4"], "greedy", first["val/acc/greedy"],
        "->", last["val/acc/greedy"])
  assert last["val/acc/mean@4"] >= first["val/acc/mean@4"] + MIN_RISE, (first, last)

  # The README's line, with its run directory pointed at the one the notebook trained.
  command, answer = readme_sample_line()
  command = [sys.executable if a == "python" else f"--workdir={workdir}" if a.startswith("--workdir=") else a
             for a in command]
  out = subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  print(out.stdout)
  # launch.sample prints "prompt 1/1: '<the prompt as trained>'" then "  1: '<the completion>'".
  completion = ast.literal_eval(out.stdout.strip().splitlines()[-1].split(": ", 1)[1])
  said = completion.rsplit("Answer: ", 1)[-1]
  assert said.isdigit() and completion.endswith(f"Answer: {said}"), out.stdout  # The trained answer format.
  question = next(a.split("=", 1)[1] for a in command if a.startswith("--prompt="))
  assert answer.isdigit() and int(answer) == sum(map(int, re.findall(r"\d+", question))), (question, answer)
  # The README's answer is its run's. A CPU whose floating-point rounding differs (another vector width)
  # takes another path from the first SFT update on, and its model may answer otherwise: the run is the
  # README's when its warm start stopped where the README's did (its printed "SFT update N: ..." line).
  readme_stop = next(line.strip().split(":")[0] for line in open(os.path.join(ROOT, "README.md"))
                     if line.strip().startswith("SFT update "))
  stops = re.findall(r"SFT update \d+: greedy reproduces", outputs)
  assert len(stops) == 1, outputs[-2000:]
  if stops[0].startswith(readme_stop + ":"):
    assert said == answer, (answer, out.stdout)
  else:
    print(f"another rounding path than the README's run ({stops[0]} against {readme_stop}): answered {said}")

  # The policy server, asked that question as the run's training prompts put it (the text a client
  # sends: `builders.user_prompt_messages`), answers as the run's greedy decoding does.
  import openai

  from dapo_jax import builders
  messages = builders.user_prompt_messages(builders.load_run_config(workdir), question)
  server = subprocess.Popen([sys.executable, "-m", "launch.serve", f"--workdir={workdir}", "--port=0"], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
  try:
    line = ""
    while not line.startswith("serving "):
      line = server.stdout.readline()
      assert line, "launch.serve ended before it served"
    client = openai.OpenAI(base_url=line.split(" on ")[1].split()[0] + "/v1", api_key="unused")
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, temperature=0)
    assert r.choices[0].message.content == completion, (r.choices[0].message.content, completion)
  finally:
    server.terminate()
    server.wait(timeout=60)
