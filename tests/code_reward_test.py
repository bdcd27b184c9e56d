"""Code rewards, tasks and the python tool, through real sandboxes: HumanEval's canonical solutions
pass, wrong ones fail, and every generated task's reference solution passes its own tests."""
import concurrent.futures as cf
import json
import os
import subprocess
import sys

import pytest

from dapo_jax.data import code_tasks, prompts
from dapo_jax.envs import python_tool as python_tool_lib
from dapo_jax.envs import sandbox
from dapo_jax.rewards import clients, code

HUMANEVAL_IDS = ("HumanEval/0", "HumanEval/10", "HumanEval/38", "HumanEval/53", "HumanEval/129")


@pytest.fixture(scope="module", autouse=True)
def available():
  sandbox.check_available()


@pytest.fixture(scope="module")
def humaneval_rows():
  return {r["task_id"]: r for r in code_tasks.humaneval()}


@pytest.fixture
def quick_limits(monkeypatch):
  monkeypatch.setattr(code, "LIMITS", sandbox.Limits(cpu_s=1, wall_s=2))


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
  from dapo_jax import from_config  # noqa: PLC0415
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
    from_config.datasets(cfg)
  cfg.data.missing_answer = "skip"
  train, _ = from_config.datasets(cfg)
  assert [ex.index for ex in train] == [0]
  assert "skipped 3 rows with an unusable ground truth" in caplog.text
  for gt, needle in [(bad[2], r"not a JSON object \(a list"), (bad[3], r"lacks string fields \['entry_point'\]")]:
    with pytest.raises(ValueError, match=needle):
      code.python_tests("", gt)
