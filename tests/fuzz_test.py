"""Property-based fuzzing: damaged inputs either work or fail with our one-line error class.

Budget: each property runs `max_examples=100` random cases with no per-case deadline (about 30 s
for the file on 2 CPU cores); the seed is derandomised so a failure reproduces in CI.
"""
import json
import math
import struct
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from configs import common
from dapo_jax import builders
from dapo_jax.data import prompts as data
from dapo_jax.hf import convert as hf
from dapo_jax.rewards import clients as reward_clients

FUZZ = settings(max_examples=100, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12)


def good_row(i=0):
  return {"data_source": "math_dapo", "prompt": [{"role": "user", "content": f"What is {i}+1?"}],
          "reward_model": {"ground_truth": str(i + 1), "style": "rule"}}


def damaged_row(draw_value, key_path):
  row = good_row()
  node = row
  for k in key_path[:-1]:
    node = node[k] if isinstance(node, dict) else node[0]
  if isinstance(node, list):
    node[0] = draw_value
  else:
    node[key_path[-1]] = draw_value
  return row


KEYS = [("prompt",), ("prompt", 0), ("prompt", 0, "content"), ("prompt", 0, "role"), ("reward_model",),
        ("reward_model", "ground_truth"), ("data_source",)]


@FUZZ
@given(rows=st.lists(st.one_of(
    st.builds(damaged_row, json_values, st.sampled_from(KEYS)),
    json_values.map(lambda v: v),              # a line that is any JSON value at all
    st.text(max_size=30).map(lambda t: {"raw": t})), min_size=1, max_size=6),
    missing=st.sampled_from(["error", "skip"]), garbage=st.binary(max_size=20))
def test_damaged_dataset_rows(tmp_path_factory, rows, missing, garbage):
  path = str(tmp_path_factory.mktemp("rows") / "d.jsonl")
  with open(path, "wb") as f:
    for r in rows:
      f.write(json.dumps(r).encode() + b"\n")
    if garbage.strip():
      f.write(garbage.replace(b"\n", b" ") + b"\n")
  try:
    out = data.load_file(path, missing_answer=missing)
  except data.DataError as e:
    assert "\n" not in str(e) and path in str(e)
    return
  for ex in out:
    assert isinstance(ex.ground_truth, str) and all(isinstance(m["content"], str) for m in ex.messages)


def valid_safetensors(path):
  hf.write_safetensors(path, {"a": np.arange(12, dtype=np.float32).reshape(3, 4),
                              "b": np.ones((5,), np.int32), "c": np.zeros((2, 2), np.float16)})
  return open(path, "rb").read()


@FUZZ
@given(cut=st.integers(0, 400), flips=st.lists(st.tuples(st.integers(0, 400), st.binary(min_size=1, max_size=8)),
                                                max_size=4))
def test_damaged_safetensors_bytes(tmp_path_factory, cut, flips):
  path = str(tmp_path_factory.mktemp("st") / "m.safetensors")
  raw = bytearray(valid_safetensors(path))
  for pos, junk in flips:
    pos %= len(raw)
    raw[pos:pos + len(junk)] = junk
  if cut < len(raw):
    raw = raw[:cut]
  open(path, "wb").write(bytes(raw))
  _read_or_named(path)


entry = st.fixed_dictionaries({"dtype": st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "F8", 3, None]),
                               "shape": st.lists(st.integers(-2, 6), max_size=3) | json_values,
                               "data_offsets": st.lists(st.integers(-4, 80), min_size=0, max_size=3) | json_values})


@FUZZ
@given(header=st.dictionaries(st.text(max_size=6), entry | json_values, max_size=4), data_len=st.integers(0, 64),
       header_len_delta=st.integers(-3, 3) | st.just(0))
def test_random_safetensors_headers(tmp_path_factory, header, data_len, header_len_delta):
  path = str(tmp_path_factory.mktemp("sth") / "m.safetensors")
  raw = json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", max(len(raw) + header_len_delta, 0)) + raw + b"\x01" * data_len)
  _read_or_named(path)


def _read_or_named(path):
  try:
    tensors = hf.read_safetensors(path)
  except hf.CheckpointError as e:
    assert str(e).startswith(path) and "\n" not in str(e)
    return
  for arr in tensors.values():
    np.asarray(arr).sum()  # Every tensor read really fits in the file.


def base_cfg():
  c = common.base()
  common.runlocal(c)
  return c


def _fields(c):
  out = []
  for group, sub in c.items():
    if hasattr(sub, "items"):
      for k, v in sub.items():
        if isinstance(v, (bool, int, float, str)):
          out.append((group, k, type(v)))
  return out


FIELDS = _fields(base_cfg())


def value_for(kind):
  if kind is bool:
    return st.booleans()
  if kind is int:
    return st.integers(-5, 5) | st.integers(-10**9, 10**9)
  if kind is float:
    return st.floats(-10, 10) | st.floats(allow_nan=True, allow_infinity=True)
  return st.text(max_size=12) | st.sampled_from(["token_mean", "k1", "none", "arith", "file", "sft", "hf"])


@st.composite
def config_edits(draw):
  edits = []
  for _ in range(draw(st.integers(1, 4))):
    group, key, kind = draw(st.sampled_from(FIELDS))
    edits.append((group, key, draw(value_for(kind))))
  return edits


@FUZZ
@given(edits=config_edits(), devices=st.sampled_from([1, 2, 8, 6]))
def test_random_config_values(edits, devices):
  c = base_cfg()
  for group, key, value in edits:
    c[group][key] = value
  try:
    builders.validate(c, num_devices=devices)
  except builders.ConfigError as e:
    assert "\n" not in str(e) and "=" in str(e)


@pytest.fixture(scope="module")
def echo_reward(tmp_path_factory):
  """A reward function that returns whatever Python literal the response spells."""
  d = tmp_path_factory.mktemp("echo")
  (d / "fuzz_echo_reward.py").write_text("import ast\n\ndef echo(response, ground_truth):\n"
                                         "  return ast.literal_eval(response)\n")
  sys.path.insert(0, str(d))
  yield "fuzz_echo_reward:echo"
  sys.path.remove(str(d))


reward_outputs = (json_values | st.floats(allow_nan=True, allow_infinity=True)
                  | st.fixed_dictionaries({"score": json_values | st.floats(allow_nan=True)},
                                          optional={"acc": json_values, "pred": json_values}))


@FUZZ
@given(out=reward_outputs)
def test_random_reward_function_outputs(echo_reward, out):
  """A reward's output is normalised to {score: float, acc: bool, pred: str}, or the call raises an
  Exception, which the pool counts and scores as FAILURE (the run goes on)."""
  try:
    got = reward_clients._call(echo_reward, repr(out), "1")
  except Exception:
    return
  assert set(got) == {"score", "acc", "pred"}
  assert isinstance(got["score"], float) and isinstance(got["acc"], bool) and isinstance(got["pred"], str)
  if isinstance(out, dict) and isinstance(out.get("score"), float) and not math.isnan(out["score"]):
    assert got["score"] == out["score"]
