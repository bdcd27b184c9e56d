"""Episodes on the engine: environments answer between turns; token-in/token-out.

The reference for log-probs is the teacher-forced forward of the whole episode (prompt, policy
turns and observations as one sequence): the engine's recorded log-probs of the policy's tokens
must equal it, and the observations' tokens must be exactly the template's rendering of them.
"""
import threading

import jax
import numpy as np
import pytest

from dapo_jax import testing
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.envs import base as env_lib
from dapo_jax.envs import render
from dapo_jax.model import transformer as model
from dapo_jax.rollout import engine, episodes, sampling


class Countdown(env_lib.Env):
  """Answers `turns - 1` times with a user message, then ends with score = the turn count."""
  turns = 3

  def reset(self, example):
    self.n = 0
    return [{"role": "user", "content": "count"}]

  def step(self, text):
    self.n += 1
    if self.n < self.turns:
      return [{"role": "user", "content": f"again {self.n}"}], None, {"seen_chars": len(text)}
    return None, {"score": float(self.n), "acc": True, "pred": text}, {}


class Blocker(Countdown):
  """Prompt 0's episodes wait in their environment until every other episode has ended: an engine
  that stalled on them would never let the others end (the wait times out and says so)."""
  turns = 2
  others_done = threading.Event()
  waited_for_others = []

  def reset(self, example):
    self.q = example
    return super().reset(example)

  def step(self, text):
    if self.q == 0 and self.n == 0:
      self.waited_for_others.append(self.others_done.wait(30))
    return super().step(text)


class Raises(Countdown):
  def step(self, text):
    raise RuntimeError("broken environment")


class Hangs(Countdown):
  release = threading.Event()

  def step(self, text):
    self.release.wait(10)
    return super().step(text)


class Garbage(Countdown):
  def step(self, text):
    return "not an observation"


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
  return tokenizer_lib.load(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def setup(tok):
  cfg = testing.tiny_model_config(vocab_size=320)
  params = testing.sharp_params(cfg, seed=3, scale=2.0)
  return cfg, params


def run(tok, setup, env_cls, *, Q=2, G=3, C=64, turn_tokens=6, slots=4, timeout_s=5.0, max_turns=4, seed=0,
        on_samples=None, turn_stop_ids=()):
  cfg, params = setup
  # Half the vocabulary ends a turn, so a random model's turns are a few tokens long.
  eos = tuple(range(3, 160))
  sc = sampling.SamplerConfig(max_new_tokens=C, temperature=1.0, eos_ids=eos)
  driver = episodes.EpisodeDriver(tok, env_cls, episodes.EpisodeConfig(
      max_turns=max_turns, timeout_s=timeout_s, poll_steps=2, turn_stop_ids=turn_stop_ids), eos_ids=eos)
  messages, _ = driver.prompt(0)
  for q in range(Q):
    driver.register(q, q)
  text = tokenizer_lib.render(tok, messages)
  prompt_QP, mask_QP = tokenizer_lib.encode_left_padded(tok, [text] * Q, 16)
  eng = engine.Engine(cfg, sc, slots=slots, prompt_len=16, turn_tokens=turn_tokens)
  samples, stats = eng.generate(params, prompt_QP, mask_QP, G, jax.random.key(seed), episodes=driver,
                                on_samples=on_samples)
  driver.close()
  return samples, stats, driver, (prompt_QP, mask_QP)


def test_recorded_logprobs_equal_the_teacher_forced_episode_and_observations_are_masked(tok, setup):
  samples, stats, driver, (prompt_QP, mask_QP) = run(tok, setup, Countdown)
  cfg, params = setup
  G = 3
  full = [r for r in stats["episode_rewards"] if r["pred"] != "[TURN_TOKENS]"]
  assert len(full) >= 3, stats["episode_rewards"]   # Most episodes play all three turns.
  prompt_BP = np.repeat(prompt_QP, G, 0)
  tokens_BT = np.concatenate([prompt_BP, samples.tokens_BC], 1)
  mask_BT = np.concatenate([np.repeat(mask_QP, G, 0), samples.mask_BC], 1)
  logits = np.asarray(model.logits(cfg, params, tokens_BT, mask_BT), np.float64)
  logp_BTV = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  P = prompt_BP.shape[1]
  checked = 0
  for b, reward in enumerate(stats["episode_rewards"]):
    n = int(samples.length_B[b])
    policy = samples.policy_BC[b, :n]
    pos = np.arange(n)[policy]
    ref = logp_BTV[b, P - 1 + pos, samples.tokens_BC[b, pos]]
    np.testing.assert_allclose(samples.logp_BC[b, pos], ref, atol=1e-5)
    if reward["score"] == 3.0:   # Three turns: two observations, each exactly the template's tokens.
      checked += 1
      gaps = np.flatnonzero(np.diff(policy.astype(int)) == -1) + 1  # Where observations start.
      assert len(gaps) == 2
      for i, start in enumerate(gaps):
        end = start + np.argmax(policy[start:])
        want = render.observation_tokens(tok, [{"role": "user", "content": f"again {i + 1}"}],
                                         ended_with=tok.decode(samples.tokens_BC[b, start - 1:start]))
        np.testing.assert_array_equal(samples.tokens_BC[b, start:end], want)
        assert (samples.logp_BC[b, start:end] == 0).all()
  assert checked >= 1
  assert stats["turns"].count(3) == checked


class Recorder(Countdown):
  """Countdown that keeps the text of every turn it was handed."""
  texts: list = []

  def step(self, text):
    self.texts.append(text)
    return super().step(text)


def test_a_turn_stop_token_ends_the_turn_and_stays_in_its_text(tok, setup):
  """`rollout.turn_stop`: a turn that ends on such a token (a tool call's closing tag) hands the
  environment its text with that token, and the observation then opens with the template's own end
  of the assistant turn (the policy did not write it); earlier tokens are never re-tokenised."""
  stop_ids = tuple(range(3, 160))  # Every token that ends a turn in `run` is a kept one here.
  Recorder.texts = []
  samples, stats, _, _ = run(tok, setup, Recorder, turn_stop_ids=stop_ids)
  checked = 0
  for b, reward in enumerate(stats["episode_rewards"]):
    n = int(samples.length_B[b])
    policy = samples.policy_BC[b, :n]
    for start in np.flatnonzero(np.diff(policy.astype(int)) == -1) + 1:  # Where observations start.
      last = int(samples.tokens_BC[b, start - 1])
      assert last in stop_ids
      end = start + np.argmax(policy[start:])
      turn = int(np.sum(~policy[:start]) > 0)  # Observations before this one (0 or 1): "again 1" or "again 2".
      want = render.observation_tokens(tok, [{"role": "user", "content": f"again {turn + 1}"}], ended_with="")
      np.testing.assert_array_equal(samples.tokens_BC[b, start:end], want)
      assert tok.decode(want).startswith(tok.eos_token)  # The template's end of turn comes first.
      checked += 1
  assert checked >= 2
  handed = [t for t in Recorder.texts if t]
  assert handed and all(any(t.endswith(tok.decode([i])) for i in stop_ids) for t in handed)


def test_a_slow_environment_does_not_stall_the_other_slots(tok, setup):
  """Prompt 0's environments answer only once every other episode has ended, so the engine must
  decode, refill and finish the others while they wait (8 slots, 16 episodes: slots are reused)."""
  Q, G = 4, 4
  ended = []
  Blocker.others_done.clear()
  Blocker.waited_for_others.clear()

  def on_samples(n):
    ended.append(n)
    if sum(ended) >= (Q - 1) * G:
      Blocker.others_done.set()

  try:
    samples, stats, driver, _ = run(tok, setup, Blocker, Q=Q, G=G, slots=8, timeout_s=60, on_samples=on_samples)
  finally:
    Blocker.others_done.set()
  assert Blocker.waited_for_others and all(Blocker.waited_for_others), Blocker.waited_for_others
  assert stats["samples"] == Q * G and driver.counts["timeouts"] == 0


@pytest.mark.parametrize("env_cls,counter,pred", [(Raises, "errors", "[ENV_ERROR]"),
                                                  (Garbage, "errors", "[ENV_ERROR]"),
                                                  (Hangs, "timeouts", "[ENV_TIMEOUT]")])
def test_a_failing_environment_ends_its_episodes_with_the_failure_reward(tok, setup, env_cls, counter, pred):
  Hangs.release.clear()
  try:
    samples, stats, driver, _ = run(tok, setup, env_cls, Q=1, G=2, slots=2, timeout_s=0.5)
  finally:
    Hangs.release.set()  # The hung threads finish.
  assert [r["pred"] for r in stats["episode_rewards"]] == [pred, pred]
  assert all(r["score"] == -1.0 and not r["acc"] for r in stats["episode_rewards"])
  assert driver.metrics()[f"env/{counter}"] == 2


def test_streamed_episode_groups_train_on_the_policy_tokens_only(tok, setup):
  """Through `Rollout` and streaming dynamic sampling: the environment's reward is the score, and
  the train batch's loss mask is the policy's tokens (observations and padding out)."""
  from dapo_jax import advantages, sharding
  from dapo_jax.data import prompts as data
  from dapo_jax.rollout import dynamic_sampling
  from dapo_jax.rollout import rollout as rollout_lib
  cfg, params = setup
  eos = tuple(range(3, 160))
  sc = sampling.SamplerConfig(max_new_tokens=48, temperature=1.0, eos_ids=eos)
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  r = rollout_lib.Rollout(tok, cfg, mesh, rollout_lib.RolloutConfig(max_prompt_len=16, turn_tokens=6, slots=4,
                                                                    filter_metric="score"),
                          sc, env=Countdown, episode_cfg=episodes.EpisodeConfig(max_turns=4, poll_steps=2))
  examples = [data.Example(messages=[{"role": "user", "content": "x"}], ground_truth="", data_source="t", index=i)
              for i in range(8)]
  groups, stats, info = dynamic_sampling.stream_groups(r, params, data.PromptIterator(examples, shuffle=False), 3, 2,
                                                       jax.random.key(1), filter_groups=False)
  r.episodes.close()
  assert len(groups) == 2
  assert set(np.unique(groups.score_QG)) <= {3.0, -1.0}   # Three turns played, or a turn cut at its budget.
  assert (groups.policy_QGC <= groups.mask_QGC).all() and (groups.policy_QGC < groups.mask_QGC).any()
  batch, _ = advantages.to_train_batch(groups, 2, 16, norm_adv_by_std=True, overlong_filter=False)
  np.testing.assert_array_equal(batch.loss_mask_BC, groups.policy_QGC.reshape(6, -1))
  np.testing.assert_array_equal(batch.mask_BT[:, 16:], groups.mask_QGC.reshape(6, -1))


def test_guess_the_number_on_the_engine_answers_each_guess_with_its_hint(tok, setup):
  """Feedback between turns: every observation the engine appended is the hint for the guess the
  policy made in the turn before it (higher / lower / a request for a number)."""
  from dapo_jax.envs import games
  cfg, params = setup
  eos = tuple(range(3, 160))
  sc = sampling.SamplerConfig(max_new_tokens=96, temperature=1.0, eos_ids=eos)
  examples = games.guess_number_examples(2, seed=0, max_guesses=4)
  driver = episodes.EpisodeDriver(tok, lambda: games.GuessNumberEnv(max_guesses=4),
                                  episodes.EpisodeConfig(max_turns=4, poll_steps=2), eos_ids=eos)
  prompts = []
  for q, ex in enumerate(examples):
    driver.register(q, ex)
    prompts.append(tokenizer_lib.render(tok, driver.prompt(ex)[0]))
  prompt_QP, mask_QP = tokenizer_lib.encode_left_padded(tok, prompts, 64)
  samples, stats = engine.Engine(cfg, sc, slots=4, prompt_len=64, turn_tokens=8).generate(
      params, prompt_QP, mask_QP, 2, jax.random.key(0), episodes=driver)
  driver.close()
  hints = 0
  for b in range(4):
    secret = int(examples[b // 2].ground_truth)
    n, policy = int(samples.length_B[b]), samples.policy_BC[b]
    runs = np.flatnonzero(np.diff(np.r_[0, policy[:n].astype(int), 0]))  # Starts and ends of policy turns.
    turns = list(zip(runs[::2], runs[1::2]))
    for (s0, e0), (s1, _) in zip(turns, turns[1:]):
      guess = games.last_integer(tok.decode(samples.tokens_BC[b, s0:e0 - 1]))
      want = "Answer with one integer." if guess is None else "higher" if secret > guess else "lower"
      assert want in tok.decode(samples.tokens_BC[b, e0:s1]), (guess, secret)
      hints += 1
  assert hints >= 4 and max(stats["turns"]) >= 3
