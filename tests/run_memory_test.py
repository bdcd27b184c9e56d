"""A run remembers how it was made: WORKDIR/config.json round-trips the recipe (tuples included),
command.txt keeps each start's command line, and a restart that changes the model is refused."""
import json
import os

import pytest

from configs import dapo_qwen2_5_32b
from dapo_jax import checkpoint, builders


def test_config_json_round_trips_and_validates(tmp_path):
  cfg = dapo_qwen2_5_32b.get_config("runlocal")
  builders.save_run_config(cfg, str(tmp_path), argv=["launch/train.py", "--config=x.py:runlocal", "--a=b c"])
  back = builders.load_run_config(str(tmp_path))
  assert back.to_dict() == cfg.to_dict()
  assert isinstance(back.model.lora.targets, tuple) and isinstance(back.data.train_files, tuple)
  builders.validate(back)
  with open(tmp_path / "command.txt") as f:
    assert f.read().rstrip().endswith("launch/train.py --config=x.py:runlocal '--a=b c'")
  assert builders.load_run_config(str(tmp_path / "none")) is None


def test_a_restart_that_changes_the_model_is_refused_naming_the_field(tmp_path):
  cfg = dapo_qwen2_5_32b.get_config("runlocal")
  builders.save_run_config(cfg, str(tmp_path), argv=["train"])
  cfg.train.num_steps = 10  # Legitimate: a longer run.
  builders.save_run_config(cfg, str(tmp_path), argv=["train"])
  with open(tmp_path / "config.json") as f:
    assert json.load(f)["train"]["num_steps"] == 10
  with open(tmp_path / "command.txt") as f:
    assert len(f.read().splitlines()) == 2
  for field, value in (("model.embed_dim", 64), ("tokenizer.vocab_size", 512), ("dapo.adv_estimator", "rloo"),
                       ("model.lora.rank", 4)):
    bad = dapo_qwen2_5_32b.get_config("runlocal")
    section, *rest = field.split(".")
    node = bad[section]
    for part in rest[:-1]:
      node = node[part]
    before = node[rest[-1]]
    node[rest[-1]] = value
    with pytest.raises(checkpoint.CheckpointMismatchError) as e:
      builders.save_run_config(bad, str(tmp_path), argv=["train"])
    path = os.path.join(tmp_path, "config.json")
    assert str(e.value) == (f"{path}: the run was started with {field}={before!r}, this config has "
                            f"{field}={value!r}; a run cannot change it (use another --workdir)")


def test_an_unreadable_config_json_is_one_line(tmp_path):
  (tmp_path / "config.json").write_text("{not json")
  with pytest.raises(builders.ConfigError, match=r"config.json: not a readable run config"):
    builders.load_run_config(str(tmp_path))
