"""Code rewards: a response passes when its program passes the task's tests, run in the sandbox.

    reward.fn = "dapo_jax.rewards:python_tests"
    ground_truth = json.dumps({"prompt": "def add(a, b):\\n", "test": "def check(candidate): ...",
                               "entry_point": "add"})          # HumanEval's row fields

The program is the response's last fenced ```python block when it has one (a whole program), else
`prompt + response` (a completion, as HumanEval scores it). The program, then the tests, then
`check(<entry_point>)` run in `dapo_jax.envs.sandbox` (namespaces, own uid, limits). Free of jax.

Sandbox mode: $DAPO_SANDBOX ("namespaces", the default, or "none" for trusted code only), which
`set_sandbox` sets, so the reward pool's worker processes, started later, inherit it.
"""
from __future__ import annotations

import json
import os
import re
import secrets

from dapo_jax.envs import sandbox

LIMITS = sandbox.Limits(cpu_s=5, wall_s=10, memory_mb=1024, processes=32, output_bytes=16384)
_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_PRED_CHARS = 200


def set_sandbox(mode: str) -> None:
  """Selects the sandbox for code rewards in this process and the processes it starts later."""
  if mode not in sandbox.MODES:
    raise ValueError(f"reward.sandbox={mode!r}; expected one of {sandbox.MODES}")
  os.environ["DAPO_SANDBOX"] = mode
  if mode != "none":
    sandbox.check_available()  # A host that cannot sandbox fails at start-up, saying why.


def extract_program(response: str, prompt: str) -> str:
  """The last fenced python block (a bare ``` block if none is tagged), else `prompt + response`."""
  blocks = _FENCE.findall(response)
  tagged = [code for lang, code in blocks if lang]
  if tagged or blocks:
    return (tagged or [code for _, code in blocks])[-1]
  return prompt + response


# Runs the program, then the tests, then `check`, in one namespace named "solution" (so `if __name__ ==
# "__main__":` blocks stay quiet, as in HumanEval's harness) with the program's prints dropped. A pass
# is the nonce (read from stdin) printed after `check` returns; an early `sys.exit(0)` or `os._exit(0)`
# in the program, which would end the process with status 0, then counts as a failure.
_HARNESS = """\
import os, sys, traceback
def _main():
  nonce = sys.stdin.readline().strip()
  real_stdout, sys.stdout = sys.stdout, open(os.devnull, "w")
  scope = {"__name__": "solution"}
  try:
    for name in ("solution.py", "test.py"):
      with open(name) as f:
        exec(compile(f.read(), name, "exec"), scope)
    scope["check"](scope[%r])
  except BaseException:
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)
  real_stdout.write("\\n" + nonce + "\\n")
  real_stdout.flush()
  os._exit(0)
_main()
"""


def run_tests(response: str, task: dict, limits: sandbox.Limits | None = None) -> tuple[bool, sandbox.Result]:
  """Runs the response's program, the task's tests and `check(entry_point)` in the sandbox; (passed, result)."""
  program = extract_program(response, task.get("prompt") or "")
  nonce = secrets.token_hex(16)
  result = sandbox.run_python(_HARNESS % task["entry_point"], stdin=nonce + "\n", limits=limits or LIMITS,
                              files={"solution.py": program, "test.py": task["test"]})
  passed = result.ok and result.stdout.rstrip("\n").rsplit("\n", 1)[-1] == nonce
  return passed, result


def parse_task(ground_truth: str) -> dict:
  """The task a ground truth holds: a JSON object with string `test` and `entry_point` (and an
  optional string `prompt`); a ValueError saying what is wrong otherwise."""
  try:
    task = json.loads(ground_truth)
  except json.JSONDecodeError as e:
    raise ValueError(f"python_tests: ground_truth is not a JSON object ({e}): {ground_truth[:200]!r}") from None
  if not isinstance(task, dict):
    raise ValueError(f"python_tests: ground_truth is not a JSON object (a {type(task).__name__}; it needs 'test' "
                     f"and 'entry_point'): {ground_truth[:200]!r}")
  missing = [k for k in ("test", "entry_point") if not isinstance(task.get(k), str) or not task[k].strip()]
  if missing or not isinstance(task.get("prompt", ""), (str, type(None))):
    raise ValueError(f"python_tests: ground_truth lacks string fields {missing or ['prompt']}: {ground_truth[:200]!r}")
  return task


def python_tests(response: str, ground_truth: str) -> dict:
  """+1 when the program passes `check(entry_point)` (exit status 0), else -1."""
  passed, result = run_tests(response, parse_task(ground_truth))
  if passed:
    return {"score": 1.0, "acc": True, "pred": "passed"}
  if result.timed_out:
    return {"score": -1.0, "acc": False, "pred": "timeout"}
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  why = lines[-1].strip() if lines else (f"signal {result.killed_by_signal}" if result.killed_by_signal
                                         else f"exit {result.exit_code} before the tests ended")
  return {"score": -1.0, "acc": False, "pred": f"failed: {why}"[:_PRED_CHARS]}


# Datasets check every row with it when they load (`data.prompts.load_file`'s `check`): a task row that
# could never be scored is named by file and row at start, not counted as a failure at every step.
python_tests.check_ground_truth = parse_task
