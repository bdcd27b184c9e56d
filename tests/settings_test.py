"""Every setting has one home: its section in `dapo_jax.settings` (default and one-line doc on the field, or the
library field it takes its default from), and the section checks its own fields."""
import ast
import dataclasses
import glob
import importlib
import inspect
import os
import random
import re

import pytest

from dapo_jax import builders, objectives, settings
from dapo_jax.rollout import rollout as rollout_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS_MODULES = ("model", "task", "rl", "supervised", "run")


def _fields_in_source():
  """(section class, field name, source line, the default's AST) of every field written in dapo_jax/settings."""
  for name in SETTINGS_MODULES:
    module = importlib.import_module(f"dapo_jax.settings.{name}")
    lines = inspect.getsource(module).split("\n")
    for node in ast.parse("\n".join(lines)).body:
      if isinstance(node, ast.ClassDef):
        for st in node.body:
          if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
            yield getattr(module, node.name), st.target.id, lines[st.lineno - 1], lines[st.lineno - 2], st.value


def _leaf_settings(values, prefix=""):
  for k, v in values.items():
    if isinstance(v, dict):
      yield from _leaf_settings(v, f"{prefix}{k}.")
    else:
      yield f"{prefix}{k}"


def test_base_is_built_from_the_settings():
  from configs import common
  assert common.base().to_dict() == settings.Config().to_dict()
  source = open(os.path.join(ROOT, "configs", "common.py")).read()
  # No section is spelled out with its defaults in the config files any more.
  assert "c.dapo = dict(" not in source and "eps_high=0.28" not in source


def test_every_field_has_a_default_and_a_one_line_doc():
  undocumented = []
  for cls, field, line, previous, default in _fields_in_source():
    assert default is not None, f"{cls.__name__}.{field} has no default"
    from_library = isinstance(default, ast.Attribute)  # `= objectives.PGConfig.eps_low`: documented there.
    nested = isinstance(default, ast.Call)  # `= Lora()`: the nested section's docstring.
    if not (from_library or nested or "#" in line or previous.strip().startswith("#")):
      undocumented.append(f"{cls.__name__}.{field}")
  assert not undocumented


def test_ten_random_settings_have_their_default_in_one_place():
  """A setting's default value is written once: on its section field, or on the library field the section
  field names (which the section then takes, never restates), and nowhere in configs/common.py."""
  written = {(cls, field): (line, default) for cls, field, line, _, default in _fields_in_source()}
  common = open(os.path.join(ROOT, "configs", "common.py")).read()
  names = sorted(n for n in _leaf_settings(settings.Config().to_dict()) if "." in n)
  for name in random.Random(0).sample(names, 10):
    *path, field = name.split(".")
    section, value = settings.Config(), None
    for part in path:
      section = getattr(section, part)
    value = getattr(section, field)
    owner = next(c for c in type(section).__mro__ if (c, field) in written or field in vars(c).get(
        "__annotations__", {}))
    if (owner, field) not in written:  # Declared by the library class the section extends (ModelConfig).
      assert owner.__module__.startswith("dapo_jax.model"), name
      line = next(l for l in inspect.getsource(owner).split("\n") if l.strip().startswith(f"{field}:"))
      assert ast.literal_eval(ast.parse(line.strip()).body[0].value) == value, (name, line)
    else:
      line, default = written[(owner, field)]
      if isinstance(default, ast.Attribute):  # `= objectives.PGConfig.eps_low`: that field holds the literal.
        module = importlib.import_module(owner.__module__)
        library = eval(ast.unparse(default.value), vars(module))
        assert getattr(library, default.attr) == value
        written_as = (f"{default.attr}:", f"{default.attr} =")  # A class field, or a module's constant.
        assert any(l.strip().startswith(written_as) for l in inspect.getsource(library).split("\n")), name
      else:
        assert ast.literal_eval(default) == value, (name, line)
    section_path = re.escape(".".join(["c"] + path))
    restated = [u for u in re.findall(section_path + r"\.update\(([^)]*)\)", common) if f"{field}={value!r}" in u]
    assert not restated and not re.search(section_path + rf"\.{field} = {re.escape(repr(value))}\b", common), name


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))))
def test_every_shipped_config_is_typed_and_back_unchanged(path):
  name = os.path.splitext(os.path.basename(path))[0]
  if name in ("__init__", "common"):
    return
  module = importlib.import_module(f"configs.{name}")
  cfg = module.get_config(None)
  typed = builders.as_config(cfg)
  plain = lambda d: {k: plain(v) if isinstance(v, dict) else (tuple(v) if isinstance(v, list) else v)
                     for k, v in d.items()}
  assert plain(typed.to_dict()) == plain(cfg.to_dict())


def test_a_name_that_is_not_a_setting_is_refused_naming_the_nearest():
  values = settings.Config().to_dict()
  values["dapo"]["eps_hgh"] = 0.3
  with pytest.raises(builders.ConfigError, match=r"^dapo.eps_hgh is not a setting; did you mean dapo.eps_high\?$"):
    settings.Config.from_dict(values)
  values = settings.Config().to_dict()
  values["dapo"]["rollout_correction"]["rollout_iz"] = "token"
  with pytest.raises(builders.ConfigError, match=r"^dapo.rollout_correction.rollout_iz is not a setting"):
    settings.Config.from_dict(values)
  with pytest.raises(builders.ConfigError, match=r"^dapoo is not a config section"):
    settings.Config.from_dict({"dapoo": {}})


def test_each_section_checks_its_own_fields():
  for section, field, value, message in [
      (settings.Dapo, "eps_low", 1.5, "dapo.eps_low=1.5: expected > 0 and < 1"),
      (settings.Rollout, "top_p", 0.0, "rollout.top_p=0.0: expected in (0, 1]"),
      (settings.Train, "keep_ckpts", 0, "train.keep_ckpts=0: expected >= 1"),
      (settings.Eval, "k", 0, "eval.k=0: expected >= 1"),
      (settings.Model, "remat", "some", "model.remat='some': expected one of ('none', 'full', 'dots')"),
      (settings.Lora, "rank", -1, "model.lora.rank=-1: expected >= 0 (0 = full fine-tuning)"),
      (settings.DPO, "label_smoothing", 0.7, "dpo.label_smoothing=0.7: expected >= 0 and <= 0.5"),
  ]:
    with pytest.raises(builders.ConfigError) as e:
      section.from_dict({field: value})
    assert str(e.value) == message


def test_library_configs_are_picked_by_field_name():
  cfg = settings.Config.from_dict({"dapo": {"eps_high": 0.31, "tau_pos": 2.0}, "rollout": {"group_size": 4}})
  pg = builders.pg_config(cfg)
  assert (pg.eps_high, pg.tau_pos, pg.group_size) == (0.31, 2.0, 4)
  # What the config does not hold keeps the library class's default.
  assert pg.norm_len == cfg.rollout.max_new_tokens
  rc = builders.rollout_config(cfg)
  assert (rc.shared_prefix, rc.overlong_buffer) == (cfg.rollout.shared_prefix, cfg.dapo.overlong_buffer)
  # A name two sections hold with two values must be passed: `pick` will not choose.
  with pytest.raises(TypeError, match=r"rollout.shared_prefix and train.shared_prefix differ"):
    settings.pick(rollout_lib.RolloutConfig, cfg.rollout, cfg.train.__class__(shared_prefix=1))
  with pytest.raises(TypeError, match=r"has no field 'nope'"):
    settings.pick(objectives.PGConfig, cfg.dapo, nope=1)
