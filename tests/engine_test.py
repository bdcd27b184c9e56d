"""The continuous-batching engine against the static sampler and the training forward; streaming
dynamic sampling against the reference (whole generation batches, then the filter)."""
import os

import jax
import numpy as np
import pytest

from dapo_jax import objectives, rewards, sharding, testing
from dapo_jax.data import prompts as data
from dapo_jax.datatypes import RLBatch
from dapo_jax.model import transformer as model
from dapo_jax.rollout import dynamic_sampling, engine, rollout, sampling
from dapo_jax.rollout import slots as slots_lib

CFG = testing.tiny_model_config(vocab_size=64)
PARAMS = testing.sharp_params(CFG, seed=2)


def prompts(Q=5, P=7, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(4, 64, size=(Q, P)).astype(np.int32)
  mask = np.ones((Q, P), bool)
  mask[1, :3] = False  # Prompts of different lengths (left padding).
  mask[3, :5] = False
  return tokens, mask


def test_greedy_equals_the_static_sampler_for_any_number_of_slots():
  """Rows end at different steps (EOS forced at random steps, some never: truncated); greedy
  tokens and log-probs are the static sampler's whatever the number of slots."""
  tokens, mask = prompts()
  G, C = 3, 12
  stop_at_B = np.random.default_rng(1).integers(2, C + 2, size=len(tokens) * G)
  sc = sampling.SamplerConfig(max_new_tokens=C, temperature=0.0, eos_ids=(1,))
  ref = jax.device_get(sampling.generate(CFG, sc, PARAMS, tokens, mask, jax.random.key(0), num_samples=G,
                                         stop_at_B=stop_at_B))
  np.testing.assert_array_equal(ref.length_B, np.minimum(stop_at_B, C))
  assert ref.truncated_B.any() and not ref.truncated_B.all()
  for slots in (1, 2, 4, 16):  # Refilled one by one, in rounds, or all at once.
    out, stats = engine.Engine(CFG, sc, slots=slots, prompt_len=7).generate(PARAMS, tokens, mask, G,
                                                                            jax.random.key(0), stop_at_B)
    np.testing.assert_array_equal(out.tokens_BC, ref.tokens_BC)
    np.testing.assert_array_equal(out.length_B, ref.length_B)
    np.testing.assert_array_equal(out.truncated_B, ref.truncated_B)
    np.testing.assert_allclose(out.logp_BC, ref.logp_BC, atol=1e-5)
    assert stats["samples"] == len(tokens) * G and stats["generated_tokens"] == ref.length_B.sum()


def test_prefill_in_chunks_of_prefill_tokens_gives_the_same_samples(monkeypatch):
  """16 slots, G=1: all five prompts start in one insert. With prefill_tokens=14 (two 7-token
  prompts) they are prefilled two at a time, with 6 one at a time, and the samples do not change."""
  tokens, mask = prompts()
  sc = sampling.SamplerConfig(max_new_tokens=8, temperature=1.0, eos_ids=(5,))
  widths = []
  prefill = slots_lib.prefill
  monkeypatch.setattr(slots_lib, "prefill", lambda cfg, p, prompt_UP, mask_UP: widths.append(
      int((np.asarray(mask_UP).sum(1) > 1).sum())) or prefill(cfg, p, prompt_UP, mask_UP))
  outs = {}
  for budget in (10_000, 14, 6):
    widths.clear()
    outs[budget] = engine.Engine(CFG, sc, slots=16, prompt_len=7, prefill_tokens=budget).generate(
        PARAMS, tokens, mask, 1, jax.random.key(4))[0]
    # Real prompts per prefill (padding rows hold one token): all, pairs, or one by one.
    assert widths == {10_000: [5], 14: [2, 2, 1], 6: [1] * 5}[budget]
  for budget in (14, 6):
    np.testing.assert_array_equal(outs[budget].tokens_BC, outs[10_000].tokens_BC)
    np.testing.assert_allclose(outs[budget].logp_BC, outs[10_000].logp_BC, atol=1e-5)
  with pytest.raises(ValueError, match="rollout.prefill_tokens=0"):
    engine.Engine(CFG, sc, slots=16, prompt_len=7, prefill_tokens=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_samples_depend_on_key_prompt_and_index_not_on_slots_and_logps_match_training(temperature):
  tokens, mask = prompts()
  G, C = 4, 10
  sc = sampling.SamplerConfig(max_new_tokens=C, temperature=temperature, eos_ids=(5, 9), pad_id=0)
  runs = [engine.Engine(CFG, sc, slots=s, prompt_len=7).generate(PARAMS, tokens, mask, G, jax.random.key(3))
          for s in (1, 3, 8)]  # One group's samples split across rounds (3 slots), or spread.
  outs = [o for o, _ in runs]
  for o in outs[1:]:
    np.testing.assert_array_equal(o.tokens_BC, outs[0].tokens_BC)
  # A group started over several rounds (one slot: 4 rounds per prompt) prefills its prompt once.
  assert [stats["prefilled_prompts"] for _, stats in runs] == [len(tokens)] * 3
  out = outs[1]
  assert out.length_B.min() < out.length_B.max() and out.truncated_B.any()  # EOS at different steps.
  # The sampler's log-probs are the training forward's (temperature-scaled) on the same rows.
  batch = RLBatch(tokens_BT=np.concatenate([np.repeat(tokens, G, 0), out.tokens_BC], 1),
                  mask_BT=np.concatenate([np.repeat(mask, G, 0), out.mask_BC], 1), loss_mask_BC=out.mask_BC,
                  old_logp_BC=out.logp_BC, adv_B=np.zeros(len(out.length_B), np.float32), ref_logp_BC=out.logp_BC)
  logp = objectives.completion_logprobs(CFG, temperature)(PARAMS, batch)
  np.testing.assert_allclose(np.where(out.mask_BC, logp, 0), np.where(out.mask_BC, out.logp_BC, 0), atol=2e-5)


def test_compaction_keeps_the_samples_and_counts_the_rows_it_computes():
  """Once the queue is empty the busy rows move into smaller decode widths (their cache rows
  copied): the same tokens and log-probs as without compaction (greedy: the static sampler's), and
  slot-steps count the rows each step computed. By hand, 4 slots and samples of 1, 2, 3 and 10
  tokens: widths 4, 3, 2, 1 run 1, 1, 1 and 7 steps, 16 rows for 16 tokens; one width runs 10 x 4.
  With min_compact_steps=10 the last move is skipped (the 10-token sample, 3 tokens drawn, may
  draw 9 more of the 12): widths 4, 3, 2 run 1, 1, 8 steps, 4 + 3 + 16 = 23 rows."""
  tokens, mask = prompts(Q=4)  # Prompts of different lengths.
  stop_at_B = np.array([1, 2, 3, 10])
  sc = sampling.SamplerConfig(max_new_tokens=12, temperature=0.0, eos_ids=(1,))
  ref = jax.device_get(sampling.generate(CFG, sc, PARAMS, tokens, mask, jax.random.key(0), stop_at_B=stop_at_B))
  np.testing.assert_array_equal(ref.length_B, stop_at_B)
  for widths, min_steps, slot_steps in ((None, 0, 16), ((4,), 0, 40), (None, 10, 23)):
    e = engine.Engine(CFG, sc, slots=4, prompt_len=7, widths=widths, min_compact_steps=min_steps)
    out, stats = e.generate(PARAMS, tokens, mask, 1, jax.random.key(0), stop_at_B)
    np.testing.assert_array_equal(out.tokens_BC, ref.tokens_BC)
    np.testing.assert_allclose(out.logp_BC, ref.logp_BC, atol=1e-5)
    assert (stats["decode_steps"], stats["slot_steps"], stats["generated_tokens"]) == (10, slot_steps, 16)
    assert stats["slot_utilisation"] == 16 / slot_steps
  assert engine.decode_widths(16) == [1, 2, 3, 4, 6, 8, 12, 16]
  assert engine.decode_widths(16, shards=4) == [4, 8, 12, 16] and engine.decode_widths(16, thirds=False) == [1, 2, 4, 8, 16]
  # Sampled: samples of one group end at different steps, some while others still wait for a slot.
  sc = sampling.SamplerConfig(max_new_tokens=10, temperature=1.0, eos_ids=(5, 9), pad_id=0)  # As above: compiled once.
  tokens, mask = prompts()
  stop_at_B = np.random.default_rng(2).integers(1, 12, size=20)
  outs = [engine.Engine(CFG, sc, slots=8, prompt_len=7, widths=w, min_compact_steps=0).generate(PARAMS, tokens, mask, 4, jax.random.key(1),
                                                                          stop_at_B) for w in (None, (8,))]
  (a, stats), (b, _) = outs
  assert stats["resizes"] >= 3 and a.length_B.min() < a.length_B.max()
  np.testing.assert_array_equal(a.tokens_BC, b.tokens_BC)
  np.testing.assert_allclose(a.logp_BC, b.logp_BC, atol=1e-6)


def test_a_session_still_being_fed_returns_as_rows_end_and_a_closed_one_at_its_tail():
  """Four samples ending after 2, 5, 8 and 11 tokens fill four slots. While the session may still be
  fed (a stream), a round returns as soon as a row ends, though nothing waits: its caller may add
  samples or stop. Closed, with no compaction worth its copy, it decodes until all have ended."""
  tokens, mask = prompts(Q=4)
  sc = sampling.SamplerConfig(max_new_tokens=12, temperature=0.0, eos_ids=(1,))
  e = engine.Engine(CFG, sc, slots=4, prompt_len=7)
  stop_at_B = np.array([2, 5, 8, 11])
  for closed, rounds in ((False, [[2], [5], [8], [11]]), (True, [[2, 5, 8, 11]])):
    s = e.session(PARAMS, jax.random.key(0))
    s.add(list(range(4)), tokens, mask, 1, stop_at_B)
    if closed:
      s.close()
    ended = []
    while s.busy:
      ended.append(sorted(f.length for f in s.step()))
    assert ended == rounds
    assert s.stats()["decode_steps"] == 11


def test_sample_distribution_is_the_models():
  """The first token of 4000 samples of one prompt (200 slots, refilled 20 times) follows softmax."""
  cfg = testing.tiny_model_config(vocab_size=16)
  params = model.init_params(cfg, jax.random.key(1))
  tokens, mask = np.array([[3, 7, 2]], np.int32), np.ones((1, 3), bool)
  sc = sampling.SamplerConfig(max_new_tokens=1, temperature=1.0)
  out, _ = engine.Engine(cfg, sc, slots=200, prompt_len=3).generate(params, tokens, mask, 4000, jax.random.key(0))
  p = np.asarray(jax.nn.softmax(model.logits(cfg, params, tokens, mask)[0, -1]))
  freq = np.bincount(out.tokens_BC[:, 0], minlength=16) / 4000
  assert np.all(np.abs(freq - p) <= 4 * np.sqrt(p * (1 - p) / 4000) + 1e-3), (freq, p)


def test_sharded_slots_match_one_device():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices")
  tokens, mask = prompts(Q=4)
  sc = sampling.SamplerConfig(max_new_tokens=8, temperature=1.0, eos_ids=(5,))
  one, _ = engine.Engine(CFG, sc, slots=4, prompt_len=7).generate(PARAMS, tokens, mask, 2, jax.random.key(0))
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  r = rollout.Rollout(None, CFG, mesh, rollout.RolloutConfig(max_prompt_len=7), sc)
  params = sharding.put(PARAMS, r.params_sharding)
  out, _ = engine.Engine(CFG, sc, slots=4, prompt_len=7, mesh=mesh).generate(params, tokens, mask, 2, jax.random.key(0))
  np.testing.assert_array_equal(out.tokens_BC, one.tokens_BC)
  with pytest.raises(ValueError, match=r"rollout.slots=6 does not split over the 4 data shards"):
    engine.Engine(CFG, sc, slots=6, prompt_len=7, mesh=mesh)


def test_prompts_longer_than_the_cache_are_refused():
  tokens, mask = prompts(P=9)
  e = engine.Engine(CFG, sampling.SamplerConfig(max_new_tokens=4), slots=2, prompt_len=7)
  with pytest.raises(ValueError, match="prompts of 9 tokens do not fit the engine's 7-token prompt cache"):
    e.generate(PARAMS, tokens, mask, 1, jax.random.key(0))


@pytest.fixture(scope="module")
def arith_rollout(tiny_tokenizer_dir):
  from dapo_jax.data import tokenizer
  tok = tokenizer.load(tiny_tokenizer_dir)
  cfg = testing.tiny_model_config(vocab_size=((len(tok) + 63) // 64) * 64)
  params = testing.sharp_params(cfg, seed=4, scale=2.0)
  sc = sampling.SamplerConfig(max_new_tokens=6, temperature=1.0, eos_ids=tokenizer.eos_ids(tok), pad_id=tok.pad_token_id)
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  pool = rewards.RewardPool("dapo_jax.testing:length_reward", timeout_s=10, workers=1)
  r = rollout.Rollout(tok, cfg, mesh, rollout.RolloutConfig(max_prompt_len=24, slots=8), sc, pool)
  yield r, params
  pool.close()


def test_streaming_keeps_the_groups_the_reference_keeps_and_stops_at_the_cap_alike(arith_rollout):
  r, params = arith_rollout
  examples = data.arith_examples(64, seed=0)
  key, G = jax.random.key(7), 4

  def reference(Q, gen_prompts, max_gen_batches):
    it = iter(range(0, 10_000, gen_prompts))
    gen = lambda i: r.groups(params, examples[next(it):][:gen_prompts], G, key, first_prompt_id=i * gen_prompts)[0]
    return dynamic_sampling.fill_batch(None, gen, Q, filter_groups=True, max_gen_batches=max_gen_batches,
                                 on_cap="train", carry_over=False)

  def streamed(Q, max_prompts):
    return dynamic_sampling.stream_groups(r, params, data.PromptIterator(examples, shuffle=False), G, Q, key,
                                          max_prompts=max_prompts)

  for Q, cap_batches in ((3, 8), (40, 2)):  # Filled; and cut short by the cap (16 prompts).
    ref, _, ref_stats = reference(Q, 8, cap_batches)
    got, stats, _ = streamed(Q, 8 * cap_batches)
    assert len(got) == len(ref) and stats.cap_reached == ref_stats.cap_reached
    np.testing.assert_array_equal(got.prompt_QP, ref.prompt_QP)
    np.testing.assert_array_equal(got.tokens_QGC, ref.tokens_QGC)
    np.testing.assert_array_equal(got.score_QG, ref.score_QG)
    # Both keep the sampler's log-probs (π_old should a group be carried over); none is carried yet.
    np.testing.assert_allclose(got.logp_QGC, ref.logp_QGC, rtol=1e-6, atol=1e-6)
    assert got.logp_QGC.dtype == np.float32 and (got.logp_QGC[got.mask_QGC] <= 0).all()
    assert not got.logp_QGC[~got.mask_QGC].any() and not got.carried_Q.any() and not ref.carried_Q.any()
    assert stats.admitted <= ref_stats.gen_batches * 8  # Streaming consumes no more than whole batches.
  assert stats.cap_reached and stats.admitted == 16


def test_eval_of_the_aime_file_samples_its_960_rows_once(tiny_tokenizer_dir):
  """30 problems x 32 copies at k=1: one pass of 960 sampled rows gives avg/best/maj@32 per problem."""
  from dapo_jax import evaluate
  from dapo_jax.data import tokenizer
  path = os.path.join(os.path.dirname(__file__), "data", "aime-2024.parquet")
  examples = data.load_file(path)
  assert len(examples) == 960
  tok = tokenizer.load(tiny_tokenizer_dir)
  cfg = testing.tiny_model_config(vocab_size=((len(tok) + 63) // 64) * 64)
  sc = sampling.SamplerConfig(max_new_tokens=4, temperature=1.0, eos_ids=tokenizer.eos_ids(tok), pad_id=tok.pad_token_id)
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  pool = rewards.RewardPool("dapo_jax.rewards:math_dapo", timeout_s=10, workers=1)
  try:
    r = rollout.Rollout(tok, cfg, mesh, rollout.RolloutConfig(max_prompt_len=512, slots=64), sc, pool)
    ev = evaluate.Evaluator(r, examples, k=1, sampler_cfg=sc)
    m = ev.run(model.init_params(cfg, jax.random.key(0)))
  finally:
    pool.close()
  assert ev.copies == [32] * 30 and ev.sampled_rows == 960
  assert set(m) == {"val/acc/mean@32", "val/acc/best@32", "val/acc/maj@32"}


@pytest.mark.parametrize("layout", [dict(), dict(kv_layout="paged", page_size=2, kv_pages=13),
                                    dict(kv_layout="paged", page_size=2, kv_pages=13, paged_attention="ragged")],
                         ids=["dense", "paged", "paged_ragged"])
def test_updated_params_take_over_the_samples_in_flight_and_each_token_keeps_its_samplers_logprob(layout):
  """Partial rollouts: after a round, `update_params(B)`; the samples in flight draw their remaining
  tokens with B (their cache kept), the queued ones start with B. B differs from A in the final norm
  alone, so the KV cache is the same under both and each token's recorded log-prob can be checked
  against a teacher-forced forward: A's before the sample's switch, B's from it on. Paged, on a pool of
  about two samples: those pre-empted after the switch are drawn again by B alone (switch 0)."""
  tokens, mask = prompts()
  G, C, T = 4, 10, 1.0
  B = dict(PARAMS, final_norm={"scale_D": PARAMS["final_norm"]["scale_D"] * 1.7})
  sc = sampling.SamplerConfig(max_new_tokens=C, temperature=T, eos_ids=(5, 9), pad_id=0)
  session = engine.Engine(CFG, sc, slots=3, prompt_len=7, **layout).session(PARAMS, jax.random.key(3))
  session.add(list(range(5)), tokens, mask, G)
  session.close()
  finished = session.step(round_steps=3)
  session.update_params(B)
  while session.busy:
    finished += session.step()
  assert len(finished) == 5 * G
  if layout:
    assert session.stats()["preempted"] > 0 and session.stats()["kv_pages_used"] == 0
  switch = np.array([f.switch_at for f in finished])
  length = np.array([f.length for f in finished])
  assert ((0 < switch) & (switch < length)).any() and (switch == 0).sum() >= 5 * G - 3  # Mid-sample and queued.
  rows = sorted(finished, key=lambda f: (f.prompt_id, f.sample))
  out = engine.stack(rows, C)
  np.testing.assert_array_equal(out.switch_B, [f.switch_at for f in rows])
  batch = RLBatch(tokens_BT=np.concatenate([np.repeat(tokens, G, 0), out.tokens_BC], 1),
                  mask_BT=np.concatenate([np.repeat(mask, G, 0), out.mask_BC], 1), loss_mask_BC=out.mask_BC,
                  old_logp_BC=out.logp_BC, adv_B=np.zeros(len(out.length_B), np.float32), ref_logp_BC=out.logp_BC)
  logp_A, logp_B = (np.asarray(objectives.completion_logprobs(CFG, T)(p, batch)) for p in (PARAMS, B))
  by_B = np.arange(C)[None, :] >= out.switch_B[:, None]
  expected = np.where(by_B, logp_B, logp_A)
  np.testing.assert_allclose(np.where(out.mask_BC, expected, 0), np.where(out.mask_BC, out.logp_BC, 0), atol=2e-5)
  assert np.abs(np.where(out.mask_BC & by_B, logp_A - logp_B, 0)).max() > 1e-2  # B is not A on those tokens.


class _FeedAfter(dynamic_sampling.PolicyFeed):
  """A feed whose newer params arrive at the rollout's `at`-th round (as an update ending then would)."""

  def __init__(self, params, newer, at: int):
    super().__init__(params)
    self.newer, self.at, self.rounds = newer, at, 0

  def take(self):
    self.rounds += 1
    return self.newer if self.rounds == self.at else None


def test_a_streamed_rollout_takes_newer_params_mid_step_and_marks_each_row(arith_rollout):
  """Partial rollouts through streaming dynamic sampling: the groups carry each row's switch
  (`Groups.switch_QG`), the rows that started after it are the newer params' alone, and every
  recorded log-prob is its sampler's (teacher-forced: the older params before the switch, the newer
  from it; they differ in the final norm only, so the cache is the same under both)."""
  r, params = arith_rollout
  newer = dict(params, final_norm={"scale_D": params["final_norm"]["scale_D"] * 1.7})
  examples = data.arith_examples(64, seed=0)
  feed = _FeedAfter(params, newer, at=2)
  got, stats, _ = dynamic_sampling.stream_groups(r, feed, data.PromptIterator(examples, shuffle=False), 4, 6,
                                                 jax.random.key(7))
  switch = got.switch_QG
  # Groups sampled before the switch, and after it (here every sample of a round ends in it: the
  # mid-sample switch is the engine test's above).
  assert (switch == -1).any() and (switch == 0).any() and feed.rounds > 2, switch
  Q, G, C = got.tokens_QGC.shape
  batch = RLBatch(tokens_BT=np.concatenate([np.repeat(got.prompt_QP, G, 0), got.tokens_QGC.reshape(-1, C)], 1),
                  mask_BT=np.concatenate([np.repeat(got.prompt_mask_QP, G, 0), got.mask_QGC.reshape(-1, C)], 1),
                  loss_mask_BC=got.mask_QGC.reshape(-1, C), old_logp_BC=got.logp_QGC.reshape(-1, C),
                  adv_B=np.zeros(Q * G, np.float32), ref_logp_BC=got.logp_QGC.reshape(-1, C))
  old, new = (np.asarray(objectives.completion_logprobs(r.model_cfg, 1.0)(p, batch)) for p in (params, newer))
  s_B = switch.reshape(-1, 1)
  by_new = (s_B >= 0) & (np.arange(C)[None, :] >= s_B)
  mask = batch.loss_mask_BC
  np.testing.assert_allclose(np.where(mask, np.where(by_new, new, old), 0), np.where(mask, batch.old_logp_BC, 0),
                             atol=2e-5)
  # The metrics: the share of rows that switched, and per-token staleness below the rows'.
  from dapo_jax import metrics, pipelining
  pipelining.stamp(got, 3)
  m = metrics.step_metrics(got, stats, {"gen_tokens": 1, "gen_s": 1.0, "reward_s": 0.0}, {}, {}, np.zeros(0), 1.0,
                           max_new_tokens=6, group_size=4, reward=r.reward, skipped=0, truncated_prompts=0,
                           policy_version=4)
  assert m["rollout/staleness_max"] == 1 and m["rollout/partial_rows"] == float((switch >= 0).mean())
  expected = float((1 - by_new.reshape(Q, G, C))[got.mask_QGC].mean())
  assert m["rollout/staleness_token_mean"] == pytest.approx(expected) and expected < 1
