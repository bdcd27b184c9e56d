"""The judge reward against a real judge: a tiny model that has memorised two verdicts, served by
`python -m launch.serve` on 127.0.0.1 with a token. Its scores are the verdicts it was taught; a judge
that answers something else, is too slow, refuses the token or is down is counted, and a run of the
default job trains through it with every request's score in the rollout dumps."""
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dapo_jax import dumps, metrics, rewards, testing
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.hf import convert as hf
from dapo_jax.rewards import judge as judge_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUBRIC = "Grade.\nQ: {prompt}\nA: {response}\nRef: {ground_truth}\n"
TAUGHT = [(("What is 2+3?", "Answer: 5", "5"), "Score: 9"), (("What is 2+3?", "Answer: 7", "5"), "Score: 2")]
TOKEN = "judge-secret"


def test_parse_score_reads_the_patterns_first_group():
  p = judge_lib.JudgeConfig().judge_pattern
  assert judge_lib.parse_score("Score: 7", p, 10) == 0.7
  assert judge_lib.parse_score("I think... score=10.", p, 10) == 1.0
  assert judge_lib.parse_score("SCORE : 3.5 because", p, 10) == 0.35
  assert judge_lib.parse_score("Verdict 1\nScore: -2", p, 4) == -0.5
  assert judge_lib.parse_score("Grade: B (4/5)", r"\((\d)/5\)", 5) == 0.8
  for text in ("no score here", "Score: high"):
    with pytest.raises(judge_lib.JudgeError, match="no score in the judge's answer"):
      judge_lib.parse_score(text, p, 10)


def test_a_bad_judge_setting_fails_at_start_naming_it(tmp_path):
  bad = tmp_path / "rubric.txt"
  bad.write_text("Grade {prompt} against {answer}")
  with pytest.raises(rewards.RewardConfigError, match=r"judge_rubric=.*may name only \{prompt\}"):
    rewards.make_reward("judge:http://127.0.0.1:9/v1", judge=judge_lib.JudgeConfig(judge_rubric=str(bad)))
  with pytest.raises(rewards.RewardConfigError, match="No such file"):
    rewards.make_reward("judge:http://127.0.0.1:9/v1", judge=judge_lib.JudgeConfig(judge_rubric=str(tmp_path / "x")))
  with pytest.raises(rewards.RewardConfigError, match="expected judge:http"):
    rewards.make_reward("judge:127.0.0.1:9")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  """(URL, model name): `launch.serve` of a tiny model that answers each TAUGHT rubric with its verdict
  (token TOKEN)."""
  path = str(tmp_path_factory.mktemp("judge"))
  tok = tokenizer_lib.train_bpe(path, testing.corpus() + [RUBRIC, "Score: 0123456789"], vocab_size=300)
  end = tok.convert_tokens_to_ids("<|im_end|>")
  rows = []
  for (q, a, gt), verdict in TAUGHT:
    question = RUBRIC.format(prompt=q, response=a, ground_truth=gt)
    text = tokenizer_lib.render(tok, [{"role": "user", "content": question}], True)
    rows.append((tok(text, add_special_tokens=False)["input_ids"], tok(verdict, add_special_tokens=False)["input_ids"]
                 + [end]))
  cfg = testing.tiny_model_config(vocab_size=len(tok), embed_dim=64, mlp_dim=128)
  params, loss = testing.memorized_model(cfg, rows, steps=150)
  assert loss < 0.05
  hf.save(path, cfg, params, tokenizer=tok)
  env = dict(os.environ, XLA_FLAGS=testing.FAST_COMPILE_XLA_FLAGS, DAPO_SERVE_TOKEN=TOKEN, PYTHONPATH=ROOT)
  proc = subprocess.Popen([sys.executable, "-m", "launch.serve", f"--model_dir={path}", "--port=0", "--slots=8",
                           "--max_prompt_len=256", "--max_new_tokens=16"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  line = ""
  for line in proc.stdout:
    if line.startswith("serving "):
      break
  assert " on http://127.0.0.1:" in line, line
  yield line.split(" on ", 1)[1].split()[0] + "/v1", os.path.basename(path)
  proc.kill()
  proc.wait()


def judge(url, monkeypatch, **kw):
  monkeypatch.setenv("DAPO_JUDGE_TOKEN", TOKEN)
  cfg = judge_lib.JudgeConfig(**{"judge_rubric": "", "judge_max_tokens": 8, "workers": 3, "timeout_s": 60.0, **kw})
  r = judge_lib.JudgeReward("judge:" + url, cfg)
  r.rubric = RUBRIC
  return r


def grade(r, pairs):
  return r([a for _, a, _ in pairs], [gt for _, _, gt in pairs], prompts=[q for q, _, _ in pairs])


def test_the_judge_scores_are_its_verdicts(served, monkeypatch):
  url, name = served
  r = judge(url, monkeypatch)
  pairs = [p for p, _ in TAUGHT] * 3  # Nine requests, three at a time: each the taught verdict.
  out = grade(r, pairs)
  assert [o["score"] for o in out] == [0.9, 0.2] * 3 and [o["acc"] for o in out] == [True, False] * 3
  assert out[0]["pred"] == "0.9 'Score: 9'" and r.errors == r.timeouts == 0
  assert r.model == name  # The endpoint's model, from its /v1/models.
  r.close()


def test_a_judge_that_answers_no_score_is_slow_or_refused_is_counted(served, monkeypatch):
  judge_url, _ = served
  pairs = [p for p, _ in TAUGHT]
  r = judge(judge_url, monkeypatch, judge_pattern=r"Verdict: (\d)")  # It answers, but not in this form.
  out = grade(r, pairs)
  assert [o["score"] for o in out] == [-1.0, -1.0] and r.errors == 2 and r.timeouts == 0
  assert out[0]["pred"].startswith("[JUDGE_UNPARSABLE] no score in the judge's answer 'Score: 9'")
  slow = judge(judge_url, monkeypatch, timeout_s=1e-4)
  out = grade(slow, pairs)
  assert [o["score"] for o in out] == [-1.0, -1.0] and slow.timeouts == 2 and slow.errors == 0
  assert out[0]["pred"].startswith("[JUDGE_TIMEOUT]")
  monkeypatch.delenv("DAPO_JUDGE_TOKEN")
  cfg = judge_lib.JudgeConfig(judge_max_tokens=8, judge_model="any")
  refused = judge_lib.JudgeReward("judge:" + judge_url, cfg)
  out = grade(refused, pairs)
  assert refused.errors == 2 and "HTTP Error 401" in out[0]["pred"]
  for r_ in (r, slow, refused):
    r_.close()


@pytest.mark.slow
def test_the_judge_trains_the_default_job_and_a_down_judge_is_counted(served, tmp_path, monkeypatch):
  judge_url, _ = served
  from configs import default
  from dapo_jax import builders
  monkeypatch.setenv("DAPO_JUDGE_TOKEN", TOKEN)
  rubric = tmp_path / "rubric.txt"
  rubric.write_text(RUBRIC)
  for name, url in (("served", judge_url), ("down", "http://127.0.0.1:9/v1")):
    cfg = default.get_config("runlocal")
    cfg.reward.update(fn="judge:" + url, judge_rubric=str(rubric), judge_max_tokens=8, timeout_s=60.0)
    cfg.train.update(num_steps=2, dump_rollouts_every=1)
    workdir = str(tmp_path / name)
    builders.run(cfg, workdir)
    recs = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    assert max(recs) == 2  # Trained through every step.
    rows = [row for step in (1, 2) for row in dumps.read(dumps.path(workdir, step))]
    assert len(rows) >= sum(recs[s]["rollout/samples"] for s in (1, 2)) > 0  # Every scored sample, kept or not.
    failed = [row for row in rows if row["pred"].startswith("[JUDGE_")]
    if name == "down":
      assert len(failed) == len(rows) and all(row["pred"].startswith("[JUDGE_ERROR] URLError") for row in rows)
      assert recs[2]["reward/errors"] >= len(rows)
    else:  # Every request's score and what the judge said; a failure among them is counted.
      for row in rows:
        if row not in failed:
          score = float(row["pred"].split()[0])
          assert row["acc"] == (score >= 0.5) and np.isfinite(score)
      assert recs[2]["reward/errors"] + recs[2]["reward/timeouts"] >= len(failed)
      assert json.loads(open(os.path.join(workdir, "config.json")).read())["reward"]["judge_rubric"] == str(rubric)
  assert glob.glob(os.path.join(str(tmp_path / "served"), "rollouts", "step_*.jsonl.gz"))


def test_a_judge_is_not_imported_as_a_reward_function_when_rows_are_checked():
  from configs import common
  from dapo_jax import builders
  c = common.base()
  c.reward.fn = "judge:http://127.0.0.1:9/v1"
  assert builders.row_check(c) is None  # No `check_ground_truth` to ask a judge for; nothing imported.
