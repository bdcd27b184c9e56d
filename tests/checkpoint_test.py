"""Checkpoint digests: damaged bytes on disk are caught at restore, and the newest intact step wins."""
import glob
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from dapo_jax import checkpoint


def make_state(scale: float):
  k = jax.random.key(0)
  return {"params": {"w_DF": jax.random.normal(k, (64, 256), jnp.float32) * scale,
                     "b_F": jnp.ones((256,), jnp.bfloat16) * scale},
          "step": jnp.asarray(int(scale), jnp.int32), "ok": jnp.asarray(True)}


def abstract_of(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def save_steps(directory, steps=(1, 2)):
  ckpt = checkpoint.Checkpointer(str(directory))
  for s in steps:
    ckpt.save(s, make_state(float(s)), {"rollout_step": s, "seed": 0})
    ckpt.wait()
  return ckpt


def damage(step_dir, nbytes=64):
  """Overwrites `nbytes` in the middle of the step's largest array file with 0x7f (floats ~3e38)."""
  files = glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True)
  f = max(files, key=os.path.getsize)
  raw = bytearray(open(f, "rb").read())
  mid = len(raw) // 2
  raw[mid:mid + nbytes] = b"\x7f" * nbytes
  open(f, "wb").write(bytes(raw))


def truncate(step_dir):
  """Cuts every file of the step's array data to half its length, as a copy stopped half-way leaves."""
  for f in glob.glob(os.path.join(step_dir, "state", "**", "*"), recursive=True):
    if os.path.isfile(f):
      with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)


def naive_checksum(x: np.ndarray) -> str:
  """The documented digest, one element at a time in Python integers."""
  w = x.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[x.dtype.itemsize]).reshape(-1)
  mask = 2**32 - 1

  def mix(h):
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & mask
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & mask
    return h ^ (h >> 16)

  s1 = s2 = 0
  for i, v in enumerate(int(v) for v in w):
    s1 = (s1 + v * (2 * i + 1)) & mask
    s2 = (s2 + mix(v ^ mix((i + 0x6A09E667) & mask))) & mask
  return f"{s1:08x}{s2:08x}"


def test_digest_matches_naive_reference_and_ignores_sharding():
  x = np.asarray(jax.random.normal(jax.random.key(1), (8, 24)), np.float32)
  y = np.arange(-6, 6, dtype=np.int8).reshape(3, 4)
  z = np.linspace(-2, 2, 10).astype(jnp.bfloat16)
  got = checkpoint.state_digest({"x": jnp.asarray(x), "y": jnp.asarray(y), "z": jnp.asarray(z)})
  assert got == {"x": naive_checksum(x), "y": naive_checksum(y), "z": naive_checksum(z)}
  mesh = jax.make_mesh((4, 2), ("a", "b"))
  sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec("a", "b")))
  assert checkpoint.state_digest({"x": sharded})["x"] == got["x"]


def test_digest_changes_with_any_single_word_and_with_a_swap():
  x = np.zeros((16, 16), np.float32)
  base = checkpoint.state_digest({"x": jnp.asarray(x)})["x"]
  y = x.copy()
  y[7, 3] = np.float32(1e-38)
  assert checkpoint.state_digest({"x": jnp.asarray(y)})["x"] != base
  a = np.arange(256, dtype=np.float32).reshape(16, 16)
  b = a.copy()
  b[[2, 9]] = b[[9, 2]]  # Two rows swapped: same values, other places.
  assert checkpoint.state_digest({"x": jnp.asarray(a)}) != checkpoint.state_digest({"x": jnp.asarray(b)})


def test_intact_checkpoint_restores_exactly(tmp_path):
  ckpt = save_steps(tmp_path)
  step, state, extra = ckpt.restore_latest(abstract_of(make_state(1.0)))
  assert step == 2 and extra == {"rollout_step": 2, "seed": 0}
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), state, make_state(2.0))
  ckpt.close()


def test_empty_directory_restores_nothing(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  assert ckpt.restore_latest(abstract_of(make_state(1.0))) is None
  ckpt.close()


def test_damaged_newest_falls_back_with_a_warning(tmp_path, caplog):
  ckpt = save_steps(tmp_path)
  damage(tmp_path / "2")
  with pytest.raises(checkpoint.CheckpointCorruptError, match=rf"checkpoint {tmp_path}/2: 1 array\(s\) do not "
                     r"match their digest \(params/w_DF\)"):
    ckpt.restore(2, abstract_of(make_state(1.0)))
  with caplog.at_level(logging.WARNING):
    step, state, extra = ckpt.restore_latest(abstract_of(make_state(1.0)))
  assert step == 1 and extra["rollout_step"] == 1
  np.testing.assert_array_equal(np.asarray(state["params"]["w_DF"]), np.asarray(make_state(1.0)["params"]["w_DF"]))
  assert f"checkpoint {tmp_path}/2: 1 array(s) do not match" in caplog.text
  # The damaged step is set aside, so the resumed run can write step 2 again.
  assert os.path.isdir(tmp_path / "2.damaged") and ckpt.all_steps() == [1]
  ckpt.save(2, make_state(2.0), {"rollout_step": 2, "seed": 0})
  ckpt.wait()
  assert ckpt.restore_latest(abstract_of(make_state(1.0)))[0] == 2
  ckpt.close()


def test_damaged_run_record_falls_back(tmp_path):
  ckpt = save_steps(tmp_path)
  meta = tmp_path / "2" / "extra" / "metadata"
  meta.write_text(meta.read_text().replace("2", "3"))
  assert ckpt.restore_latest(abstract_of(make_state(1.0)))[0] == 1
  ckpt.close()


def test_truncated_checkpoint_falls_back(tmp_path):
  ckpt = save_steps(tmp_path)
  truncate(tmp_path / "2")
  with pytest.raises(checkpoint.CheckpointCorruptError, match=rf"checkpoint {tmp_path}/2"):
    ckpt.restore(2, abstract_of(make_state(1.0)))
  assert ckpt.restore_latest(abstract_of(make_state(1.0)))[0] == 1
  ckpt.close()


def test_every_checkpoint_damaged_is_one_line_naming_them(tmp_path):
  ckpt = save_steps(tmp_path)
  damage(tmp_path / "1")
  truncate(tmp_path / "2")
  with pytest.raises(checkpoint.CheckpointCorruptError) as e:
    ckpt.restore_latest(abstract_of(make_state(1.0)))
  assert str(e.value) == (f"every checkpoint in {tmp_path} is damaged ({tmp_path}/2, {tmp_path}/1); "
                          "delete them to start over, or restore them from a backup")
  assert "\n" not in str(e.value)
  ckpt.close()


def test_checkpoint_without_digest_restores_unverified(tmp_path, caplog):
  ckpt = save_steps(tmp_path, steps=(1,))
  shutil.rmtree(tmp_path / "1" / "digest")  # As written before digests existed.
  with caplog.at_level(logging.WARNING):
    step, _, _ = ckpt.restore_latest(abstract_of(make_state(1.0)))
  assert step == 1 and "has no digest" in caplog.text
  ckpt.close()


def test_other_dtype_is_a_mismatch_not_damage(tmp_path):
  ckpt = save_steps(tmp_path, steps=(1,))
  want = abstract_of(make_state(1.0))
  want["params"]["w_DF"] = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r"params/w_DF has dtype float32, but the config needs bfloat16; restoring converts "
                           r"no dtype"):
    ckpt.restore_latest(want)
  assert ckpt.all_steps() == [1]  # A config mismatch is not damage: nothing is set aside.
  ckpt.close()


def test_save_refuses_a_python_number_in_the_state(tmp_path):
  """A Python int would be written as int64 and the resume (no dtype conversion) would refuse it."""
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  state = make_state(1.0)
  state["step"] = 1
  with pytest.raises(TypeError, match=r"checkpoint step 1: state entry step is a Python int \(1\)"):
    ckpt.save(1, state, {"seed": 0})
  assert ckpt.all_steps() == []
  ckpt.close()


@pytest.mark.slow  # ~20 s: builds a whole run (eager parameter init, the sampler's compile).
def test_run_whose_last_step_made_no_update_resumes(tmp_path):
  """Step 0 keeps no group (every score fails), so no update runs; its checkpoint must hold
  the state's own int32 rollout_step, and the run resumes from it (restore checks every dtype)."""
  from configs import dapo_qwen2_5_32b
  from dapo_jax import builders
  cfg = dapo_qwen2_5_32b.get_config("runlocal")
  cfg.reward.update(fn="dapo_jax.testing:raising_reward", workers=1)
  cfg.dapo.max_gen_batches = 1
  workdir = str(tmp_path / "run")
  with builders.dapo(cfg, workdir) as run:
    m, _ = run.step(0)
    assert "actor/pg_loss" not in m  # No update ran.
    run.save(1)
    run.ckpt.wait()
    assert run.restore() == 1
    assert run.state.rollout_step.dtype == np.int32


def test_int64_scalar_counter_of_an_older_version_restores_as_int32(tmp_path, caplog):
  """Checkpoints written before the fix hold rollout_step as int64: they resume, with a warning."""
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  state = make_state(1.0)
  state["step"] = np.asarray(7, np.int64)
  ckpt.save(1, state, {"seed": 0})
  ckpt.wait()
  with caplog.at_level(logging.WARNING):
    _, restored, _ = ckpt.restore_latest(abstract_of(make_state(1.0)))
  assert restored["step"].dtype == np.int32 and int(restored["step"]) == 7
  assert "step was written as an int64 scalar" in caplog.text
  ckpt.close()
