"""Code rewards: a response passes when its program passes the task's tests, run in the sandbox.

    reward.fn = "dapo_jax.rewards:python_tests"
    ground_truth = json.dumps({"prompt": "def add(a, b):\\n", "test": "def check(candidate): ...",
                               "entry_point": "add"})          # HumanEval's row fields

The program is the response's last fenced ```python block when it has one (a whole program), else
`prompt + response` (a completion, as HumanEval scores it). The program and the tests run in two
sandboxes (`dapo_jax.envs.sandbox`) joined by two pipes: the tests' `check(candidate)` runs in one,
where `candidate` sends its arguments to the other, which calls the program's `entry_point` and
sends back the value, both as plain data (`rewards.plain`: JSON with exact types). So the program
never holds the tests (not in its memory, not on its file system) and can only answer with values:
an object equal to everything, or a look at the caller's frames, has nothing to work on. Free of jax.

Sandbox mode: $DAPO_SANDBOX ("namespaces", the default, or "none" for trusted code only), which
`set_sandbox` sets, so the reward pool's worker processes, started later, inherit it.
"""
from __future__ import annotations

import json
import os
import re

from dapo_jax.envs import sandbox
from dapo_jax.rewards import plain

LIMITS = sandbox.Limits(cpu_s=5, wall_s=10, memory_mb=1024, processes=32, output_bytes=16384)
_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_PRED_CHARS = 200
_PASSED = "dapo-check-passed"
with open(plain.__file__) as _f:
  _PLAIN = _f.read()


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


# The program's side: runs solution.py in a namespace named "solution" (so `if __name__ ==
# "__main__":` blocks stay quiet, as in HumanEval's harness), then answers each call on its stdin
# with the entry point's value (or its exception's type and message) on its stdout. Its own prints
# and reads go to /dev/null; the pipes live on other fds.
_PROGRAM = _PLAIN + """
import os, sys, traceback
def _serve(entry_point):
  calls, answers = os.fdopen(os.dup(0), "r", encoding="utf-8"), os.fdopen(os.dup(1), "w", encoding="utf-8")
  quiet = os.open(os.devnull, os.O_RDWR)
  os.dup2(quiet, 0)
  os.dup2(quiet, 1)
  def send(message):
    answers.write(dumps(message) + "\\n")
    answers.flush()
  def failure(e):
    traceback.print_exc()
    sys.stderr.flush()
    return {"error": [type(e).__name__, str(e)[:2000]]}
  scope = {"__name__": "solution"}
  try:
    with open("solution.py") as f:
      exec(compile(f.read(), "solution.py", "exec"), scope)
    function = scope[entry_point]
  except BaseException as e:
    send(failure(e))
    return
  send({"ready": True})
  for line in calls:
    try:
      call = loads(line)
      answer = {"value": encode(function(*decode(call["args"]), **decode(call["kwargs"])))}
    except BaseException as e:  # SystemExit too: the process goes on answering.
      answer = failure(e)
    send(answer)
"""

# The tests' side: runs the task's prompt (helpers its tests use, e.g. HumanEval's `poly`), then the
# tests, then `check(candidate)`, where `candidate` calls the program through the pipes and returns
# only what `decode` builds. Its exceptions come back as the builtin exception of that name. A pass
# is `check` returning: the marker it then prints is the last line of its stdout.
_CHECKER = _PLAIN + """
import builtins, os, sys
class ProgramError(Exception):
  pass
def _check(entry_point, passed):
  calls, answers = os.fdopen(int(sys.argv[1]), "w", encoding="utf-8"), os.fdopen(os.dup(0), "r", encoding="utf-8")
  def receive():
    line = answers.readline(1 << 26)
    if not line:
      raise ProgramError("the program ended without answering")
    message = loads(line)
    if type(message) is dict and type(message.get("error")) is list and len(message["error"]) == 2:
      name, text = (str(x) for x in message["error"])
      kind = getattr(builtins, name, None)
      if isinstance(kind, type) and issubclass(kind, Exception):
        try:
          error = kind(text)
        except Exception:
          error = ProgramError(f"{name}: {text}")
      else:
        error = ProgramError(f"{name}: {text}")
      raise error
    if type(message) is not dict or len(message) != 1:
      raise ProgramError("the program answered something else than one value")
    return message
  def candidate(*args, **kwargs):
    calls.write(dumps({"args": encode(list(args)), "kwargs": encode(kwargs)}) + "\\n")
    calls.flush()
    return decode(receive()["value"])
  receive()  # {"ready": true}, or the error that stopped the program loading
  scope = {"__name__": "tests"}
  with open("prompt.py") as f:
    prompt = f.read()
  try:
    code = compile(prompt, "prompt.py", "exec")
  except SyntaxError:
    code = None  # A prompt that ends inside a function: its tests call only `candidate`.
  if code is not None:
    exec(code, scope)
  scope[entry_point] = candidate
  with open("test.py") as f:
    exec(compile(f.read(), "test.py", "exec"), scope)
  scope["check"](candidate)
  print("\\n" + passed, flush=True)
"""


def run_tests(response: str, task: dict, limits: sandbox.Limits | None = None) -> tuple[bool, sandbox.Result]:
  """Runs the response's program and the task's `check(entry_point)` in two sandboxes joined by
  pipes of plain data; (passed, result): the tests' exit status, output and end, with the
  program's stderr before the tests' and its timeout, signal and memory exhaustion counted."""
  limits = limits or LIMITS
  program = extract_program(response, task.get("prompt") or "")
  calls_r, calls_w = os.pipe()       # tests -> program
  answers_r, answers_w = os.pipe()   # program -> tests
  entry_point = task["entry_point"]
  jobs = [sandbox.Job.python(_PROGRAM + f"_serve({entry_point!r})\n", files={"solution.py": program},
                             stdin=calls_r, stdout=answers_w, limits=limits),
          sandbox.Job.python(_CHECKER + f"_check({entry_point!r}, {_PASSED!r})\n", args=[str(calls_w)],
                             files={"test.py": task["test"], "prompt.py": task.get("prompt") or ""},
                             stdin=answers_r, pass_fds=(calls_w,), limits=limits)]
  ran, checked = sandbox.run_all(jobs, primary=1)
  passed = checked.ok and checked.stdout.rstrip("\n").rsplit("\n", 1)[-1] == _PASSED
  result = sandbox.Result(
      exit_code=checked.exit_code, stdout=checked.stdout, stderr=ran.stderr + checked.stderr,
      timed_out=ran.timed_out or checked.timed_out,
      killed_by_signal=checked.killed_by_signal or (ran.killed_by_signal if not ran.ok else None),
      truncated=ran.truncated or checked.truncated, wall_s=max(ran.wall_s, checked.wall_s), mode=checked.mode,
      uid=ran.uid, out_of_memory=ran.out_of_memory or checked.out_of_memory)
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
  if result.out_of_memory:
    return {"score": -1.0, "acc": False, "pred": "failed: out of memory"}
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  why = lines[-1].strip() if lines else (f"signal {result.killed_by_signal}" if result.killed_by_signal
                                         else f"exit {result.exit_code} before the tests ended")
  return {"score": -1.0, "acc": False, "pred": f"failed: {why}"[:_PRED_CHARS]}


# Datasets check every row with it when they load (`data.prompts.load_file`'s `check`): a task row that
# could never be scored is named by file and row at start, not counted as a failure at every step.
python_tests.check_ground_truth = parse_task
