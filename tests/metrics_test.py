"""Metric files read back with tensorboard's own event reader."""
import glob

from tensorboard.backend.event_processing import event_accumulator

from dapo_jax import metrics


def test_tensorboard_and_jsonl_round_trip(tmp_path):
  w = metrics.MetricWriter(str(tmp_path))
  w.scalars(1, {"critic/score/mean": 0.25, "actor/entropy": 1.5})
  w.scalars(2, {"critic/score/mean": 0.5, "actor/entropy": float("nan")})
  w.text(2, "samples", "PROMPT: 1+1\nRESPONSE: Answer: 2")
  w.close()
  acc = event_accumulator.EventAccumulator(glob.glob(str(tmp_path / "tb"))[0],
                                           size_guidance={event_accumulator.TENSORS: 0})
  acc.Reload()
  assert [(e.step, e.value) for e in acc.Scalars("critic/score/mean")] == [(1, 0.25), (2, 0.5)]
  texts = acc.Tensors("samples")
  assert texts[0].step == 2 and texts[0].tensor_proto.string_val[0].decode().startswith("PROMPT: 1+1")
  recs = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert recs[1]["critic/score/mean"] == 0.25 and recs[2]["actor/entropy"] == "nan"
