"""Episodes on the engine: environments answer between turns; token-in/token-out.

The reference for log-probs is the teacher-forced forward of the whole episode (prompt, policy
turns and observations as one sequence): the engine's recorded log-probs of the policy's tokens
must equal it, and the observations' tokens must be exactly the template's rendering of them.
"""
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax import testing
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.envs import base as env_lib
from dapo_jax.envs import render
from dapo_jax.model import transformer as model
from dapo_jax.rollout import engine, episodes, sampling
from tests import vision_test


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
        on_samples=None, turn_stop_ids=(), env_error="mask"):
  cfg, params = setup
  # Half the vocabulary ends a turn, so a random model's turns are a few tokens long.
  eos = tuple(range(3, 160))
  sc = sampling.SamplerConfig(max_new_tokens=C, temperature=1.0, eos_ids=eos)
  driver = episodes.EpisodeDriver(tok, env_cls, episodes.EpisodeConfig(
      max_turns=max_turns, timeout_s=timeout_s, poll_steps=2, turn_stop_ids=turn_stop_ids, env_error=env_error),
      eos_ids=eos)
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
        # The turn ended on an end-of-turn token: the template's own (one of them) is not repeated.
        want = render.observation_tokens(tok, [{"role": "user", "content": f"again {i + 1}"}],
                                         ended_with=driver.eos_texts)
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


@pytest.mark.parametrize("env_error", ["mask", "score"])
@pytest.mark.parametrize("env_cls,counter,pred", [(Raises, "errors", "[ENV_ERROR]"),
                                                  (Garbage, "errors", "[ENV_ERROR]"),
                                                  (Hangs, "timeouts", "[ENV_TIMEOUT]")])
def test_a_failing_environment_ends_its_episodes_as_an_infrastructure_failure(tok, setup, env_cls, counter, pred,
                                                                              env_error):
  """`rollout.env_error`: "mask" marks the rows to leave the loss (and counts them), "score" gives them
  env_failure_score in the loss."""
  Hangs.release.clear()
  try:
    samples, stats, driver, _ = run(tok, setup, env_cls, Q=1, G=2, slots=2, timeout_s=0.5, env_error=env_error)
  finally:
    Hangs.release.set()  # The hung threads finish.
  assert [r["pred"] for r in stats["episode_rewards"]] == [pred, pred]
  assert all(r["score"] == -1.0 and not r["acc"] for r in stats["episode_rewards"])
  assert all(r.get("masked", False) == (env_error == "mask") for r in stats["episode_rewards"])
  assert driver.metrics()[f"env/{counter}"] == 2
  assert driver.metrics()["env/masked"] == (2 if env_error == "mask" else 0)


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


# --- one environment per episode, infrastructure failures, the length rule, metrics ------------------

def examples_of(n, first=0):
  from dapo_jax.data import prompts as data
  return [data.Example(messages=[{"role": "user", "content": f"What is {i} + {i}?"}], ground_truth=str(2 * i),
                       data_source="t", index=i) for i in range(first, first + n)]


def make_rollout(tok, setup, env, *, C=48, turn_tokens=6, **episode_kw):
  from dapo_jax import sharding
  from dapo_jax.rollout import rollout as rollout_lib
  cfg, _ = setup
  eos = tuple(range(3, 160))
  sc = sampling.SamplerConfig(max_new_tokens=C, temperature=1.0, eos_ids=eos)
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  ep_cfg = episodes.EpisodeConfig(**{"max_turns": 4, "poll_steps": 2, **episode_kw})
  return rollout_lib.Rollout(tok, cfg, mesh, rollout_lib.RolloutConfig(max_prompt_len=32, turn_tokens=turn_tokens,
                                                                       slots=4, filter_metric="score"),
                             sc, env=env, episode_cfg=ep_cfg)


def test_an_environment_whose_reset_outlives_the_timeout_never_plays_another_episode(tok, setup, tmp_path):
  """Five rollout steps (prompt ids restart at 0 in each) where every fourth reset outlives the
  timeout: each row of the dumps is scored against its own example (the environment's `pred` is the
  prompt it was reset with), and every environment is reset once, closed once, never stepped after."""
  from dapo_jax import dumps
  from dapo_jax.data import prompts as data
  from dapo_jax.rollout import dynamic_sampling
  Env = testing.SlowResetEnv
  Env.made.clear()
  Env.resets = 0
  _, params = setup
  r = make_rollout(tok, setup, lambda: Env(slow_s=0.8), timeout_s=0.25)
  recorder = dumps.RolloutRecorder(str(tmp_path), r, filter_groups=False)
  it = data.PromptIterator(examples_of(40), shuffle=False)
  for step in range(1, 6):
    with recorder.recording("step", step, step - 1):
      dynamic_sampling.stream_groups(r, params, it, 2, 2, jax.random.key(step), filter_groups=False)
    Env.settle()  # The update: meanwhile the slow resets return.
  r.episodes.close()
  Env.settle()
  played, timed_out = 0, 0
  for step in range(1, 6):
    rows = dumps.read(dumps.path(str(tmp_path), step))
    assert len(rows) == 4
    for row in rows:
      if row["pred"] == "[ENV_TIMEOUT]":
        timed_out += 1
        assert row.get("masked", True), row
      else:
        played += 1
        assert row["pred"] == row["prompt"], (step, row)   # Scored against its own example.
  assert timed_out >= 4 and played >= 12, (timed_out, played)
  episode_envs = [e for e in Env.made if e.in_worker]
  assert len(episode_envs) == played + timed_out
  assert all(e.n_resets == 1 and e.n_closes == 1 for e in episode_envs), \
      [(e.n_resets, e.n_steps, e.n_closes) for e in episode_envs]
  assert [e.n_steps for e in episode_envs if e.slow] == [0] * timed_out  # Closed once returned, never stepped.


def test_a_key_played_again_never_finds_the_environment_of_its_timed_out_episode(tok):
  """The driver alone: episode (0, 0) times out in its reset; the same key's next episode (prompt ids
  restart every rollout step) plays the example registered now, in a fresh environment, and the slow
  one is closed when its reset returns."""
  Env = testing.SlowResetEnv
  Env.made.clear()
  Env.resets = 0  # The first worker reset is a slow one.
  driver = episodes.EpisodeDriver(tok, lambda: Env(slow_s=0.5), episodes.EpisodeConfig(timeout_s=0.1),
                                  eos_ids=(tok.eos_token_id,))
  first, second = examples_of(2)

  def play(example):
    driver.register(0, example)
    end = tok.eos_token_id
    for turn in (1, 2):
      driver.submit((0, 0), [5, 6, end], ended_by_eos=True, turn=turn)
      while not (out := driver.ready()):
        driver.wait()
      (_, obs, reward), = out
      if reward is not None:
        return reward
    raise AssertionError("the episode did not end")

  assert play(first)["pred"] == "[ENV_TIMEOUT]"
  Env.settle()
  assert play(second)["pred"] == second.messages[-1]["content"]
  driver.close()
  slow, fresh = [e for e in Env.made if e.n_resets]
  assert (slow.n_resets, slow.n_steps, slow.n_closes) == (1, 0, 1)
  assert (fresh.example, fresh.n_steps, fresh.n_closes) == (second, 2, 1)


def test_the_overlong_penalty_of_an_episode_counts_its_observations(tok, setup):
  """One length rule (verl's): the whole response, observations included, against the episode's
  response budget. 2,048 tokens of budget, a 256-token buffer: 1,500 policy + 548 observation tokens
  = 2,048 -> -1.0; 1,500 + 400 = 1,900 -> -(1,900 - 1,792) / 256; 1,000 + 200 -> 0."""
  from dapo_jax import sharding
  from dapo_jax.rollout import rollout as rollout_lib
  cfg, _ = setup
  C = 2048
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  r = rollout_lib.Rollout(tok, cfg, mesh,
                          rollout_lib.RolloutConfig(max_prompt_len=32, turn_tokens=512, overlong_buffer=256,
                                                    overlong_penalty=1.0),
                          sampling.SamplerConfig(max_new_tokens=C, eos_ids=(3,)), env=Countdown)
  parts = [(1500, 548), (1500, 400), (1000, 200)]
  tokens, policy = np.full((3, C), 7, np.int32), np.zeros((3, C), bool)
  for b, (p, o) in enumerate(parts):
    policy[b, :p // 2], policy[b, p // 2 + o:p + o] = True, True   # a turn, an observation, a turn
  length = np.array([p + o for p, o in parts], np.int32)
  mask = np.arange(C)[None] < length[:, None]
  samples = sampling.Samples(tokens_BC=np.where(mask, tokens, 0), logp_BC=np.zeros((3, C), np.float32), mask_BC=mask,
                             length_B=length, truncated_B=np.zeros(3, bool), policy_BC=policy & mask)
  rewards = [{"score": 1.0, "acc": True, "pred": ""}] * 3
  out = r.score(examples_of(3), samples, 1, rewards)
  want = [1.0 - 1.0, 1.0 - (1900 - (C - 256)) / 256, 1.0]
  np.testing.assert_allclose(out["score"][:, 0], want)
  r.episodes.close()


def test_the_config_check_bounds_the_overlong_buffer_by_the_episode_budget_and_names_env_error():
  from configs import common
  from dapo_jax import builders

  def config(**rollout):
    c = common.base()
    common.runlocal(c)   # max_prompt_len 32, max_new_tokens 8
    c.rollout.update(env="dapo_jax.envs.games:GuessNumberEnv", max_turns=4, **rollout)
    return c

  c = config()
  c.dapo.overlong_buffer = 32  # > one turn's 8 tokens, = the episode's 4 x 8.
  builders.validate(c, num_devices=1)
  c.dapo.overlong_buffer = 33
  with pytest.raises(builders.ConfigError) as e:
    builders.validate(c, num_devices=1)
  assert str(e.value).startswith("dapo.overlong_buffer=33: expected from 0 to the episode's response budget of 32")
  c = config(max_episode_tokens=100)
  c.dapo.overlong_buffer = 68
  builders.validate(c, num_devices=1)
  assert builders.completion_len(c) == 68
  c = config(env_error="drop")
  with pytest.raises(builders.ConfigError) as e:
    builders.validate(c, num_devices=1)
  assert str(e.value).startswith("rollout.env_error='drop': expected 'mask'") and "\n" not in str(e.value)
  assert builders.episodes(config(env_error="score"))[1].env_error == "score"
  assert builders.episodes(config())[1].env_error == "mask"


def test_a_masked_row_leaves_the_groups_advantages_as_if_it_were_absent():
  """Group [1, -1, 1, 5 (masked)]: GRPO's advantages of the first three are those of [1, -1, 1] by
  hand (mean 1/3, unbiased std sqrt(4/3)); the masked row gets 0 and no loss token. Every sequence
  estimator gives the group without the row; dynamic sampling looks at the valid rows only."""
  from dapo_jax import advantages
  from dapo_jax.datatypes import Groups
  from dapo_jax.rollout import dynamic_sampling
  Q, G, C, P = 2, 4, 3, 2
  score = np.array([[1.0, -1.0, 1.0, 5.0], [1.0, 1.0, -1.0, 1.0]])
  valid = np.array([[True, True, True, False], [True, True, True, True]])
  mask = np.ones((Q, G, C), bool)
  groups = Groups(prompt_QP=np.ones((Q, P), np.int32), prompt_mask_QP=np.ones((Q, P), bool),
                  tokens_QGC=np.full((Q, G, C), 5, np.int32), mask_QGC=mask, length_QG=np.full((Q, G), C),
                  truncated_QG=np.zeros((Q, G), bool), score_QG=score, acc_QG=score > 0, filter_QG=score,
                  logp_QGC=np.zeros((Q, G, C), np.float32), carried_Q=np.zeros(Q, bool), valid_QG=valid)
  batch, adv = advantages.to_train_batch(groups, Q, P, norm_adv_by_std=True, overlong_filter=False)
  mean, std = 1 / 3, np.sqrt(((1 - 1 / 3) ** 2 * 2 + (-1 - 1 / 3) ** 2) / 2)
  np.testing.assert_allclose(adv[0], [(1 - mean) / (std + 1e-6), (-1 - mean) / (std + 1e-6),
                                      (1 - mean) / (std + 1e-6), 0.0], rtol=1e-6)
  np.testing.assert_allclose(adv[1], advantages.group_advantages(score[1:])[0])
  np.testing.assert_array_equal(batch.loss_mask_BC.reshape(Q, G, C).any(-1), valid)
  lengths = np.array([[3, 1, 2, 3], [3, 3, 3, 3]])
  for est in ("grpo", "rloo", "gpg", "reinforce_pp_baseline", "opo", "grpo_passk", "gdpo"):
    got = advantages.sequence_advantages(est, score[:1], lengths_QG=lengths[:1], valid_QG=valid[:1])
    want = advantages.sequence_advantages(est, score[:1, :3], lengths_QG=lengths[:1, :3])
    np.testing.assert_allclose(got[0, :3], want[0], rtol=1e-6, err_msg=est)
    assert got[0, 3] == 0, est
  # [1, 1, 1, 5 (masked)]: no variance among the rows that count, so dynamic sampling drops it.
  assert not dynamic_sampling.keep_groups([[1.0, 1.0, 1.0, 5.0]], [[True, True, True, False]])[0]
  assert dynamic_sampling.keep_groups([[1.0, 1.0, 1.0, 5.0]])[0]
  assert not dynamic_sampling.keep_groups([[1.0, 1.0]], [[False, False]])[0]


class Flaky(Countdown):
  """Countdown whose every third step (over all episodes) raises."""
  turns = 2
  calls = 0
  lock = threading.Lock()

  def step(self, text):
    with Flaky.lock:
      Flaky.calls += 1
      fail = Flaky.calls % 3 == 0
    if fail:
      raise RuntimeError("the tool server is down")
    return super().step(text)


@pytest.mark.parametrize("env_error", ["mask", "score"])
def test_rows_of_failed_environments_leave_the_loss_and_their_groups_statistics(tok, setup, env_error):
  """Through `Rollout.groups`: rows whose environment raised are masked (loss mask empty, advantages
  by hand over the group's other rows), or with env_error="score" trained on with env_failure_score."""
  from dapo_jax import advantages
  _, params = setup
  Flaky.calls = 0
  r = make_rollout(tok, setup, Flaky, env_error=env_error)
  G = 4
  groups, _ = r.groups(params, examples_of(3), G, jax.random.key(3))
  rewards = r.last_stats["episode_rewards"]
  r.episodes.close()
  failed = np.array([x["pred"] == "[ENV_ERROR]" for x in rewards]).reshape(3, G)
  assert failed.any() and not failed.all()
  np.testing.assert_array_equal(groups.valid_QG, ~failed if env_error == "mask" else np.ones_like(failed))
  batch, adv = advantages.to_train_batch(groups, 3, 32, norm_adv_by_std=True, overlong_filter=False)
  for q in range(3):
    rows = ~failed[q] if env_error == "mask" else np.ones(G, bool)
    s = groups.score_QG[q, rows]
    if len(s) > 1:
      want = (s - s.mean()) / (np.sqrt(((s - s.mean()) ** 2).sum() / (len(s) - 1)) + 1e-6)
    else:
      want = s / (1 + 1e-6)   # A group of one: mean 0, std 1.
    np.testing.assert_allclose(adv[q, rows], want, rtol=1e-5, atol=1e-6)
    assert (adv[q, ~rows] == 0).all()
    in_loss = batch.loss_mask_BC.reshape(3, G, -1)[q].any(-1)
    np.testing.assert_array_equal(in_loss, rows)
  if env_error == "score":
    assert (groups.score_QG[failed] == -1.0).all()


class FailsOnOdd(Countdown):
  """Countdown whose environment raises on the examples of odd index."""
  turns = 2

  def reset(self, example):
    self.index = example.index
    return super().reset(example)

  def step(self, text):
    if self.index % 2:
      raise RuntimeError("down")
    return super().step(text)


def test_env_metrics_count_each_rollout_and_the_evaluation_apart(tok, setup):
  """env/* are one rollout step's (`loop.DAPO.collect`), not running totals; an evaluation's
  episodes are val/env/* and do not reach the next step's env/*."""
  import types

  from dapo_jax import evaluate, loop
  from dapo_jax.data import prompts as data
  from dapo_jax.rollout import dynamic_sampling
  _, params = setup
  r = make_rollout(tok, setup, FailsOnOdd)
  G = 2
  cfg = loop.LoopConfig(num_steps=3, prompts_per_step=2, group_size=G, gen_prompts=2, dynamic_sampling=False,
                        max_gen_batches=1, on_cap="train", carry_over=False, norm_adv_by_std=True,
                        overlong_filter=False, minibatches=1, ppo_epochs=1, reference=False, length_buckets=(),
                        shared_prefix=0, seed=0, ckpt_every=0, eval_every=0, log_samples_every=0)
  dapo = types.SimpleNamespace(cfg=cfg, key=jax.random.key(0), rollout=r, state=types.SimpleNamespace(params=params),
                               data_iter=data.PromptIterator(examples_of(8), shuffle=False),
                               keep_rate=dynamic_sampling.KeepRate(), carry=None)
  evaluator = evaluate.Evaluator(r, examples_of(3, first=10), k=2, sampler_cfg=r.sampler_cfg)
  seen = []
  for step in range(3):
    _, _, info = loop.DAPO.collect(dapo, step)
    seen.append(info["env"])
    ev = evaluator.run(params)
    assert ev["val/env/errors"] == 2 and ev["val/env/masked"] == 2   # Example 11, twice.
    assert not any(k.startswith("env/") for k in ev)
  r.episodes.close()
  for m in seen:  # Each step: prompts 2s (even: played) and 2s + 1 (odd: fails), G episodes each.
    assert (m["env/errors"], m["env/masked"], m["env/timeouts"]) == (G, G, 0), seen
    assert 1.0 <= m["env/turns_per_episode"] <= 1.5   # 2 turns (or 1, cut) for even prompts, 1 for odd.


def test_a_turn_ended_on_any_end_of_turn_token_gets_no_second_one(tok):
  """A turn that ended on <|endoftext|> (an EOS id, not the template's <|im_end|>) is not followed by
  the template's end-of-turn: the observation opens where it would after <|im_end|>. A turn cut at
  its budget, or ended on a kept turn-stop token, gets the template's end-of-turn first."""
  eot, eos = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
  stop = tok.convert_tokens_to_ids("!")
  obs = [{"role": "user", "content": "again 1"}]
  after_eot = render.observation_tokens(tok, obs, ended_with="<|im_end|>")
  assert after_eot[0] != eot and render.observation_tokens(tok, obs)[0] == eot

  def observation(last, ended_by_eos=True):
    driver = episodes.EpisodeDriver(tok, Countdown, episodes.EpisodeConfig(turn_stop_ids=(stop,), max_turns=4),
                                    eos_ids=(eot, eos, stop))
    driver.register(0, None)
    driver.submit((0, 0), [20, 21, last], ended_by_eos=ended_by_eos, turn=1)
    while not (out := driver.ready()):
      driver.wait()
    driver.close()
    return out[0][1]

  assert observation(eos) == after_eot
  assert observation(eot) == after_eot
  assert observation(stop) == render.observation_tokens(tok, obs)   # "</tool_call>"-like: the template's end.


@pytest.mark.slow
def test_a_command_line_run_scores_every_episode_against_its_own_example(tmp_path):
  """`launch.train` (a tiny recipe, 4 rollout steps, an evaluation every 2) with an environment a
  quarter of whose resets outlive `rollout.env_timeout_s`: every row of every step's dump is scored
  against its own example or masked as a timeout, and each step's env/timeouts are that step's alone
  (its dump's timed-out rows), evaluations' apart (val/env/*)."""
  import os
  import subprocess
  import sys

  from dapo_jax import dumps
  from dapo_jax import metrics as metrics_lib
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  workdir = str(tmp_path / "run")
  args = [f"--config={root}/configs/dapo_qwen2_5_32b.py:runlocal", f"--workdir={workdir}",
          "--config.rollout.env=dapo_jax.testing:SlowResetEnv", '--config.rollout.env_args={"slow_s": 0.5, "turns": 1}',
          "--config.rollout.env_timeout_s=0.2", "--config.rollout.env_workers=64", "--config.train.num_steps=4",
          "--config.train.dump_rollouts_every=1", "--config.train.eval_every=2"]
  env = dict(os.environ, XLA_FLAGS=testing.FAST_COMPILE_XLA_FLAGS, JAX_PLATFORMS="cpu", PYTHONPATH=root)
  out = subprocess.run([sys.executable, "-m", "launch.train", *args], cwd=root, env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  logged = metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  played = timed_out = 0
  for step in range(1, 5):
    rows = dumps.read(dumps.path(workdir, step))
    for row in rows:
      if row["pred"] == "[ENV_TIMEOUT]":
        assert row["masked"], row
      else:
        assert row["pred"] == row["prompt"] and not row["masked"], (step, row)
    step_timeouts = sum(row["pred"] == "[ENV_TIMEOUT]" for row in rows)
    assert logged[step]["env/timeouts"] == logged[step]["env/masked"] == step_timeouts, (step, logged[step])
    played += len(rows) - step_timeouts
    timed_out += step_timeouts
  assert timed_out >= 4 and played >= 2 * timed_out, (played, timed_out)   # About a quarter time out.
  assert {k for k in logged[2] if k.startswith("val/env/")} >= {"val/env/timeouts", "val/env/masked"}


@pytest.mark.parametrize("read,kv_pages", [("gather", 0), ("ragged", 40)])
def test_episodes_on_a_paged_cache_are_the_dense_engines(tok, setup, read, kv_pages, monkeypatch):
  """The same episodes on pages (`rollout.kv_layout="paged"`): observations and replies written into
  each episode's own pages as it grows, the prompt's pages shared by its group. The dense engine's
  tokens, turns and rewards, and its log-probs (to rounding through the ragged read). A pool of 40
  pages (two episodes' budgets) starts an episode only where its whole budget fits: none is ever
  pre-empted, and every page is free again at the end."""
  dense, dense_stats, _, _ = run(tok, setup, Countdown)
  original = engine.Engine.__init__
  monkeypatch.setattr(engine.Engine, "__init__", lambda self, *a, **kw: original(
      self, *a, **kw, kv_layout="paged", page_size=4, paged_attention=read, kv_pages=kv_pages))
  paged, stats, _, _ = run(tok, setup, Countdown)
  np.testing.assert_array_equal(paged.tokens_BC, dense.tokens_BC)
  np.testing.assert_array_equal(paged.policy_BC, dense.policy_BC)
  np.testing.assert_allclose(paged.logp_BC, dense.logp_BC, rtol=0, atol=2e-6)
  assert stats["turns"] == dense_stats["turns"] and stats["episode_rewards"] == dense_stats["episode_rewards"]
  assert stats["preempted"] == 0 and stats["kv_pages_used"] == 0 and stats["prompt_pages_shared"] > 0
  if kv_pages:
    assert stats["kv_pages_peak"] <= kv_pages - 1, stats


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
def test_a_vision_language_policy_plays_episodes_with_its_prompts_images(tok, family):
  """Episodes of a vision-language policy (Gemma 3: bidirectional attention inside an image; Qwen2.5-VL:
  M-RoPE) on the engine: the prompt's image vectors placed once, text observations fed as text, and every
  policy token's recorded log-prob that of a teacher-forced forward of prompt + images + the whole episode."""
  from dapo_jax.model.config import ModelConfig, VisionConfig
  V, M = len(tok) + 3, 4  # Image tokens outside the tokenizer's ids: no text becomes one.
  ids = dict(boi_token_id=V - 3, eoi_token_id=V - 2, image_token_id=V - 1)
  if family == "gemma3":
    cfg = ModelConfig(vocab_size=V, embed_dim=32, mlp_dim=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      arch="gemma3", qk_norm=True, local_layers=(0,), sliding_window=12, query_scale=8.0,
                      vision=VisionConfig(image_size=8, patch_size=2, embed_dim=16, mlp_dim=24, num_layers=1,
                                          num_heads=2, tokens_per_image=M, **ids))
  else:
    cfg = ModelConfig(vocab_size=V, embed_dim=32, mlp_dim=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      qkv_bias=True, arch="qwen2", mrope_section=(2, 1, 1),
                      vision=VisionConfig(kind="qwen2_5_vl", image_size=8, patch_size=2, embed_dim=16, mlp_dim=24,
                                          num_layers=2, num_heads=2, tokens_per_image=M, window_size=4,
                                          full_attention_layers=(1,), **ids))
  params = testing.sharp_params(cfg, seed=3, scale=2.0)
  eos = tuple(range(3, 160))
  Q, G, C = 2, 3, 48
  driver = episodes.EpisodeDriver(tok, Countdown, episodes.EpisodeConfig(max_turns=4, timeout_s=5.0, poll_steps=2),
                                  eos_ids=eos, image_token_id=cfg.vision.image_token_id)
  messages, _ = driver.prompt(0)
  text = tok(tokenizer_lib.render(tok, messages), add_special_tokens=False)["input_ids"]
  image = [ids["boi_token_id"]] + [ids["image_token_id"]] * M + [ids["eoi_token_id"]]
  rows = [image + text, text[:1] + image + text[1:]]  # The image first, or after the first token.
  P = len(rows[0]) + 2  # Left padding.
  prompt_QP = np.array([[0] * (P - len(r)) + r for r in rows], np.int32)
  mask_QP = np.array([[0] * (P - len(r)) + [1] * len(r) for r in rows], np.int32)
  images_QMD = jax.random.normal(jax.random.key(1), (Q, M, cfg.embed_dim))
  if family == "qwen2_5_vl":  # Its vectors end with their image's tokens a row (`vision.image_features`).
    images_QMD = jnp.concatenate([images_QMD, jnp.full((Q, M, 1), 2.0)], axis=-1)
  for q in range(Q):
    driver.register(q, q)
  sc = sampling.SamplerConfig(max_new_tokens=C, temperature=1.0, eos_ids=eos)
  eng = engine.Engine(cfg, sc, slots=4, prompt_len=P, turn_tokens=6)
  samples, stats = eng.generate(params, prompt_QP, mask_QP, G, jax.random.key(0), episodes=driver,
                                images_QMD=images_QMD)
  driver.close()
  assert stats["prefilled_prompts"] == Q and max(stats["turns"]) >= 2, stats["turns"]
  observed = ~np.asarray(samples.policy_BC) & np.asarray(samples.mask_BC)
  assert observed.any() and (np.asarray(samples.tokens_BC)[observed] < len(tok)).all()
  images_BMD = np.repeat(np.asarray(images_QMD), G, 0)
  teacher = vision_test.teacher_log_probs(cfg, params, prompt_QP, mask_QP, images_BMD, samples.tokens_BC,
                                          samples.mask_BC)
  policy = np.asarray(samples.policy_BC) & np.asarray(samples.mask_BC)
  np.testing.assert_allclose(np.where(policy, samples.logp_BC, 0), np.where(policy, teacher, 0), atol=1e-5)
  # The images matter: without them the teacher-forced log-probs differ.
  blind = vision_test.teacher_log_probs(cfg, params, prompt_QP, mask_QP, 0 * images_BMD, samples.tokens_BC,
                                        samples.mask_BC)
  assert np.abs(np.where(policy, blind - teacher, 0)).max() > 1e-3


class ShowsAPlaceholder(Countdown):
  """Answers with text that tokenizes to the policy's image placeholder (e.g. a tool printing it)."""
  text = ""

  def step(self, text):
    return [{"role": "user", "content": self.text}], None, {}


class ShowsAPicture(Countdown):
  def step(self, text):
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "look"}]}], None, {}


@pytest.mark.parametrize("env_cls", [ShowsAPlaceholder, ShowsAPicture])
def test_an_observation_with_an_image_ends_its_episode_as_the_environments_failure(tok, setup, env_cls):
  """Observations carry text only: an image part, or a text whose tokens hold the image placeholder,
  ends the episode as an environment failure (masked, counted, said in one line)."""
  placeholder = tok("look", add_special_tokens=False)["input_ids"][0]
  ShowsAPlaceholder.text = tok.decode([placeholder])
  cfg, params = setup
  eos = tuple(range(3, 160))
  driver = episodes.EpisodeDriver(tok, env_cls, episodes.EpisodeConfig(timeout_s=5.0, poll_steps=2), eos_ids=eos,
                                  image_token_id=placeholder)
  messages, _ = driver.prompt(0)
  driver.register(0, 0)
  prompt_QP, mask_QP = tokenizer_lib.encode_left_padded(tok, [tokenizer_lib.render(tok, messages)], 16)
  eng = engine.Engine(cfg, sampling.SamplerConfig(max_new_tokens=32, temperature=1.0, eos_ids=eos), slots=2,
                      prompt_len=16, turn_tokens=6)
  samples, stats = eng.generate(params, prompt_QP, mask_QP, 2, jax.random.key(0), episodes=driver)
  driver.close()
  ended_in_turn = [r for r in stats["episode_rewards"] if r["pred"] != "[TURN_TOKENS]"]
  assert ended_in_turn and all(r["pred"] == "[ENV_ERROR]" and r["masked"] for r in ended_in_turn)
  assert not (~np.asarray(samples.policy_BC) & np.asarray(samples.mask_BC)).any()  # No observation was fed.
  assert "observations carry text only" in driver.last_error and driver.counts["errors"] == len(ended_in_turn)
