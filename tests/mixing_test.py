"""Several train files mixed in fixed shares (`data.train_weights`, `data.MixedIterator`): the shares,
each file's own shuffled epochs, rewinding, restoring, host shards, the config checks; and a run that
trains on two files with each sample's file in the rollout dumps, resumed where it stopped."""
import collections
import json
import os

import numpy as np
import pytest

from configs import common, default
from dapo_jax import builders, dumps, metrics
from dapo_jax.data import prompts as data_lib


def examples(tag, n):
  return [data_lib.Example(messages=({"role": "user", "content": f"{tag}{i}"},), ground_truth=str(i), source=tag)
          for i in range(n)]


A, B = examples("a", 10), examples("b", 100)


def names(exs):
  return [ex.messages[0]["content"] for ex in exs]


def test_shares_follow_the_weights_and_each_file_keeps_its_own_epochs():
  it = data_lib.MixedIterator([A, B], (3, 1), seed=0)
  drawn = it.take(8000)
  share = sum(ex.source == "a" for ex in drawn) / len(drawn)
  assert abs(share - 0.75) < 0.03  # 4 binomial standard deviations at n = 8000
  a = [ex for ex in drawn if ex.source == "a"]
  for epoch in range(5):  # Every 10 of A's draws are a permutation of A, a new one each epoch.
    assert sorted(names(a[10 * epoch:10 * (epoch + 1)])) == sorted(names(A))
  assert names(a[:10]) != names(a[10:20])
  # The same seed draws the same stream; another seed another one.
  assert names(data_lib.MixedIterator([A, B], (3, 1), seed=0).take(200)) == names(drawn[:200])
  assert names(data_lib.MixedIterator([A, B], (3, 1), seed=1).take(200)) != names(drawn[:200])


def test_rewind_and_restore_give_back_the_same_prompts():
  it = data_lib.MixedIterator([A, B], (1, 2), seed=3)
  it.take(37)
  state = json.loads(json.dumps(it.state()))  # As a checkpoint holds it.
  ahead = names(it.take(15))
  it.rewind(15)
  assert it.state() == state and names(it.take(15)) == ahead
  again = data_lib.MixedIterator([A, B], (1, 2), seed=3)
  again.restore(state)
  assert names(again.take(15)) == ahead
  with pytest.raises(ValueError, match="cannot rewind"):
    again.rewind(1000)
  with pytest.raises(data_lib.DataError, match="data.train_weights changed"):
    data_lib.PromptIterator(A).restore(state)
  with pytest.raises(data_lib.DataError, match="data.train_weights changed"):
    data_lib.MixedIterator([A, B], (1, 2)).restore({"epoch": 0, "position": 3})


def test_hosts_read_their_shards_of_one_stream():
  whole = names(data_lib.MixedIterator([A, B], (1, 1), seed=5).take(8))
  shards = [names(data_lib.MixedIterator([A, B], (1, 1), seed=5, process_index=h, process_count=2).next_batch(8))
            for h in range(2)]
  assert shards[0] + shards[1] == whole
  with pytest.raises(data_lib.DataError, match="positive"):
    data_lib.MixedIterator([A, B], (1, 0))


def write_rows(path, tag, n):
  rows = [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": f"What is {i}+{tag}?"}],
           "reward_model": {"ground_truth": str(i + tag), "style": "rule"}} for i in range(n)]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_config_checks_and_the_iterator_by_file(tmp_path):
  f1, f2 = write_rows(tmp_path / "one.jsonl", 1, 20), write_rows(tmp_path / "two.jsonl", 2, 30)
  c = common.base()
  c.data.update(task="file", train_files=(f1, f2), train_weights=(1.0, 3.0))
  train, _ = builders.datasets(c)
  it = builders.data_iterator(c, train)
  assert isinstance(it, data_lib.MixedIterator) and [len(x.examples) for x in it.iters] == [20, 30]
  assert {ex.source for ex in it.iters[0].examples} == {f1}
  for weights, words in (((1.0,), "one weight per data.train_files entry"), ((1.0, 0.0), "positive numbers"),
                         ((1.0, -2.0), "positive numbers")):
    c.data.train_weights = weights
    with pytest.raises(builders.ConfigError, match=words):
      builders.validate(c)
  c.data.train_weights = ()
  assert isinstance(builders.data_iterator(c, train), data_lib.PromptIterator)


@pytest.mark.slow
def test_a_run_mixes_two_files_and_resumes_the_stream(tmp_path):
  f1, f2 = write_rows(tmp_path / "one.jsonl", 1, 40), write_rows(tmp_path / "two.jsonl", 2, 40)
  cfg = default.get_config("runlocal")
  cfg.model.init = "random"
  cfg.data.update(task="file", train_files=(f1, f2), eval_files=(f1,), train_weights=(1.0, 3.0), num_eval=4)
  cfg.train.update(num_steps=2, dump_rollouts_every=1, ckpt_every=1)
  workdir = str(tmp_path / "run")
  builders.run(cfg, workdir)
  cfg.train.num_steps = 4
  builders.run(cfg, workdir)  # Resumes after step 2.
  rows = {s: dumps.read(dumps.path(workdir, s)) for s in range(1, 5)}
  # The prompts the run scored across its restart (every group, kept or not) are the first ones of the
  # stream a fresh iterator draws: the restart continued it where it stopped, nothing drawn twice or lost.
  train, _ = builders.datasets(cfg)
  it = builders.data_iterator(cfg, train)
  consumed = collections.Counter(r["prompt"] for s in range(1, 5) for r in rows[s] if r["sample"] == 0)
  stream = collections.Counter(ex.messages[-1]["content"] for ex in it.take(sum(consumed.values())))
  assert consumed == stream
  sources = collections.Counter(r["source"] for s in rows for r in rows[s] if r["sample"] == 0)
  assert set(sources) == {f1, f2} and os.path.exists(os.path.join(workdir, "checkpoints"))
  # Each step's metrics count the groups scored from each file and their samples' accuracy, as the
  # step's dump lists them.
  logged = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  for s in range(1, 5):
    for name, f in (("one", f1), ("two", f2)):
      mine = [r for r in rows[s] if r["source"] == f]
      assert logged[s][f"data/source/{name}/groups"] == sum(r["sample"] == 0 for r in mine), (s, name)
      if mine:
        assert logged[s][f"data/source/{name}/acc"] == pytest.approx(np.mean([r["acc"] for r in mine]))
