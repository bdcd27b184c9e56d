"""The console helper: progress lines with hand-computed rates and ETAs on a fake clock; the
progress of SFT and the lines around a large checkpoint restore."""
import io

import jax
import jax.numpy as jnp
import numpy as np

from dapo_jax import checkpoint, console, sharding, testing
from dapo_jax.data import prompts as data
from dapo_jax.pipelines import sft


class Clock:
  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t


def test_progress_rate_eta_and_when_it_prints():
  clock, out = Clock(), io.StringIO()
  p = console.Progress(100, "eval", unit="sample", every_s=10, stream=out, clock=clock)
  clock.t = 30.0          # The first piece (a compile) took 30 s ...
  p.update(10)            # ... printed at once; its rate is over the whole phase: 10 / 30 s.
  clock.t = 35.0
  p.update(10)            # 5 s after the last line: silent.
  clock.t = 40.0
  p.update(20, loss=0.5)  # 10 s: printed; rate from the first update on: 30 samples / 10 s.
  clock.t = 50.0
  p.update(60)            # Done: printed, with the total time.
  p.close()               # Already printed: nothing more.
  lines = out.getvalue().splitlines()
  assert lines == [
      "eval [##..................]  10/100 sample  3 s/sample  ETA 4m30s",        # 90 left at 1/3 per s
      "eval [########............]  40/100 sample  3 sample/s  ETA 20s  loss 0.5",  # 60 left at 3/s
      "eval [####################] 100/100 sample  4.5 sample/s  in 50s  loss 0.5"]  # 90 in 20 s


def test_due_says_whether_update_prints_and_close_after_a_stop():
  clock, out = Clock(), io.StringIO()
  p = console.Progress(10, "SFT", unit="step", every_s=5, stream=out, clock=clock)
  assert p.due()          # The first update always prints.
  p.update(1)
  clock.t = 1.0
  assert not p.due()
  assert p.due(9)         # Reaching the total prints.
  p.update(2)
  clock.t = 6.0
  assert p.due()
  p.close()               # Stopped early: the last line says so instead of an ETA.
  assert out.getvalue().splitlines()[-1].endswith("3/10 step  3 s/step  stopped after 6s")  # 2 steps in 6 s


def test_disabled_progress_prints_nothing_and_formats():
  out = io.StringIO()
  with console.Progress(3, "x", stream=out, enabled=False) as p:
    p.update(3)
  assert out.getvalue() == ""
  assert [console.duration(s) for s in (4.4, 64, 3 * 3600 + 125)] == ["4s", "1m04s", "3h02m"]
  assert [console.size(b) for b in (512, 3 << 20, 5 << 30)] == ["512 B", "3.0 MB", "5.0 GB"]
  clock = Clock()
  p = console.Progress(5000, "GGUF tensors", unit="tensor", stream=out, clock=clock)
  clock.t = 0.5
  p.update(1000)
  assert p.line() == "GGUF tensors [####................] 1000/5000 tensor  2000 tensor/s  ETA 2s"
  assert console.bar(5, 20) == "[#####...............]" and console.bar(0, 0) == "[" + "#" * 20 + "]"


def test_large_checkpoint_restore_prints_size_and_seconds(tmp_path, capsys):
  state = {"w_DF": jnp.arange(4096, dtype=jnp.float32).reshape(64, 64)}
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  ckpt.save(1, state, {"seed": 0})
  ckpt.wait()
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  ckpt.restore(1, abstract)
  assert capsys.readouterr().out == ""   # Small: silent.
  ckpt.announce_bytes = 1
  restored, _ = ckpt.restore(1, abstract)
  ckpt.close()
  before, after = capsys.readouterr().out.splitlines()
  assert before.startswith(f"restoring checkpoint {tmp_path}/1 (") and before.endswith(" KB) ...")
  assert after.startswith(f"restoring checkpoint {tmp_path}/1 (") and ": done in " in after
  np.testing.assert_array_equal(restored["w_DF"], state["w_DF"])


def test_sft_prints_progress_with_loss(tmp_path, capsys):
  tok = testing.build_tokenizer(str(tmp_path / "tok"))
  examples = data.arith_examples(40, digits=1, seed=0)
  model_cfg = testing.tiny_model_config(vocab_size=((len(tok) + 63) // 64) * 64)
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
  sft.run(sft.SFTConfig(steps=3, batch_size=2, seq_len=32), model_cfg, tok, examples, mesh, str(tmp_path / "sft"))
  lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("SFT [")]
  assert lines[0].startswith("SFT [######..............] 1/3 step") and "loss" in lines[0]
  assert lines[-1].startswith("SFT [####################] 3/3 step") and "token acc" in lines[-1]
