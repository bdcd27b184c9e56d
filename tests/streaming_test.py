"""Streaming dynamic sampling that admits ahead: the kept groups, and the data the step consumes,
are a function of the key and the data order alone (not of slots, admission or reward latency)."""
import tempfile

import jax
import numpy as np
import pytest

from dapo_jax import dumps, rewards, sharding, testing
from dapo_jax.data import prompts as data
from dapo_jax.data import tokenizer
from dapo_jax.rollout import dynamic_sampling, rollout, sampling

G, Q = 4, 3


@pytest.fixture(scope="module")
def setup(tiny_tokenizer_dir):
  tok = tokenizer.load(tiny_tokenizer_dir)
  cfg = testing.tiny_model_config(vocab_size=((len(tok) + 63) // 64) * 64)
  params = testing.sharp_params(cfg, seed=4, scale=2.0)
  sc = sampling.SamplerConfig(max_new_tokens=6, temperature=1.0, eos_ids=tokenizer.eos_ids(tok), pad_id=tok.pad_token_id)
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  pools = {name: rewards.RewardPool(f"dapo_jax.testing:{name}", timeout_s=10, workers=1)
           for name in ("length_reward", "slow_length_reward")}
  yield tok, cfg, params, sc, mesh, pools
  for p in pools.values():
    p.close()


def two_steps(setup, *, slots, ahead, reward="length_reward", keep_rate=None, margin=1.0):
  """Two streamed steps from one data stream: each step's groups and stats, the stream's state after,
  and the groups the stream's watchers heard of (`data.watch_scores`: the curriculum's pools) and the
  rollout dump holds."""
  tok, cfg, params, sc, mesh, pools = setup
  r = rollout.Rollout(tok, cfg, mesh, rollout.RolloutConfig(max_prompt_len=24, slots=slots), sc, pools[reward])
  it = data.PromptIterator(data.arith_examples(10, seed=0), seed=3)  # 10 prompts: the second step wraps an epoch
  heard = []
  data.watch_scores(r, lambda examples, acc, valid: heard.extend(
      (ex.messages[-1]["content"], tuple(a)) for ex, a in zip(examples, np.asarray(acc).tolist())))
  workdir = tempfile.mkdtemp()
  recorder = dumps.RolloutRecorder(workdir, r, filter_groups=True)
  out = []
  for step in range(2):
    with recorder.recording("step", step, step):
      groups, stats, _ = dynamic_sampling.stream_groups(r, params, it, G, Q, jax.random.key(step), ahead=ahead,
                                                        keep_rate=keep_rate, margin=margin)
    rows = dumps.read(dumps.path(workdir, step))
    dumped = [(row["group"], row["prompt"], row["response"], row["kept"]) for row in rows]
    out.append((groups, stats, dict(it.state()), list(heard) + dumped))
    heard.clear()
  return out


def test_kept_groups_and_consumed_prompts_do_not_depend_on_slots_admission_or_reward_latency(setup):
  ref = two_steps(setup, slots=4, ahead=False)
  runs = [two_steps(setup, slots=4, ahead=True),
          two_steps(setup, slots=32, ahead=True, keep_rate=dynamic_sampling.KeepRate(1.0, 20.0)),  # far ahead
          two_steps(setup, slots=12, ahead=True, reward="slow_length_reward"),
          two_steps(setup, slots=12, ahead=True, margin=0.0),  # no safety margin: more, smaller waves
          two_steps(setup, slots=32, ahead=True, margin=3.0)]
  for (groups, stats, state, heard), _ in zip(ref, range(2)):
    assert len(groups) == Q and stats.kept == Q and stats.returned == 0
    assert stats.admitted == stats.generated == len(heard) // (1 + G) >= Q  # Each group heard once, dumped G times.
  for run in runs:
    for (g, s, state, heard), (g_ref, s_ref, state_ref, heard_ref) in zip(run, ref):
      np.testing.assert_array_equal(g.prompt_QP, g_ref.prompt_QP)
      np.testing.assert_array_equal(g.tokens_QGC, g_ref.tokens_QGC)
      np.testing.assert_array_equal(g.score_QG, g_ref.score_QG)
      np.testing.assert_allclose(g.logp_QGC, g_ref.logp_QGC, rtol=1e-6, atol=1e-6)
      assert state == state_ref  # The prompts admitted past the step's prefix went back to the stream.
      assert heard == heard_ref  # Watchers and dumps: the consumed groups alone, in prompt order.
      for f in ("admitted", "generated", "kept", "all_correct", "all_wrong", "acc_sum", "cap_reached"):
        assert getattr(s, f) == getattr(s_ref, f), f
  assert sum(s.returned for _, s, _, _ in runs[1]) > 0  # Far ahead, some prompts were not needed.


def test_the_kept_groups_are_the_first_q_kept_in_prompt_order_of_the_reference(setup):
  """The reference: one generation batch of the same prompts, filtered; streaming keeps its first Q kept."""
  tok, cfg, params, sc, mesh, pools = setup
  r = rollout.Rollout(tok, cfg, mesh, rollout.RolloutConfig(max_prompt_len=24, slots=8), sc, pools["length_reward"])
  examples = data.arith_examples(12, seed=1)
  key = jax.random.key(5)
  ref, _ = r.groups(params, examples, G, key)
  keep = np.flatnonzero(dynamic_sampling.keep_groups(ref.filter_QG))
  assert len(keep) >= Q
  it = data.PromptIterator(examples, shuffle=False)
  got, stats, _ = dynamic_sampling.stream_groups(r, params, it, G, Q, key)
  np.testing.assert_array_equal(got.tokens_QGC, ref.tokens_QGC[keep[:Q]])
  assert stats.admitted == keep[Q - 1] + 1 and it.state() == {"epoch": 0, "position": keep[Q - 1] + 1}


def test_rewind_steps_back_across_an_epoch():
  it = data.PromptIterator([data.Example(messages=[{"role": "user", "content": str(i)}], ground_truth=str(i),
                                         data_source="t", index=i) for i in range(5)], seed=0)
  first = it.take(7)
  it.rewind(4)
  assert it.state() == {"epoch": 0, "position": 3}
  assert it.take(4) == first[3:]
  with pytest.raises(ValueError, match="cannot rewind 8 examples"):
    it.rewind(8)
