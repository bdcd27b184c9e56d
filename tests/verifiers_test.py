"""Environments of the `verifiers` library in training (`serve.verifiers_env`): a verifiers
SingleTurnEnv drives each episode through the episode gateway with the official `openai` client; its
rubric's reward is the episode's score (checked against the sampled text by hand), the trained row
is what the engine sampled (log-probs teacher-forced), and a command-line run trains with it."""
import functools
import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from dapo_jax import sharding, testing
from dapo_jax.data import prompts as data
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.model import transformer as model_lib
from dapo_jax.rollout import episodes, rollout, sampling

vf = pytest.importorskip("verifiers")
from dapo_jax.serve import verifiers_env  # noqa: E402 (after the skip)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QA = [("What is 12 + 5?", "17"), ("What is 40 + 2?", "42"), ("What is 3 + 4?", "7")]
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """A tiny chat policy that has learnt two of the three answers ("Answer: N" then the end of turn)."""
  tok = tokenizer_lib.train_bpe(str(tmp_path_factory.mktemp("tok")), testing.corpus(), vocab_size=300,
                                chat_template=True)
  eos = tokenizer_lib.eos_ids(tok)
  ids = lambda q: tok(tokenizer_lib.render(tok, [{"role": "user", "content": q}], True),
                      add_special_tokens=False)["input_ids"]
  rows = [(ids(q), tok(f"Answer: {a}", add_special_tokens=False)["input_ids"] + [eos[0]]) for q, a in QA[:2]]
  cfg = testing.tiny_model_config(vocab_size=len(tok), embed_dim=64, mlp_dim=128)
  params, loss = testing.memorized_model(cfg, rows, steps=200)
  assert loss < 0.05
  return tok, cfg, params


def test_a_verifiers_environment_scores_what_the_engine_sampled(setup):
  tok, cfg, params = setup
  eos = tokenizer_lib.eos_ids(tok)
  sc = sampling.SamplerConfig(max_new_tokens=24, temperature=TEMPERATURE, eos_ids=eos, pad_id=tok.pad_token_id)
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  env = functools.partial(verifiers_env.VerifiersEnv, environment="dapo_jax.serve.verifiers_env:arith_exact_match",
                          timeout_s=60)
  r = rollout.Rollout(tok, cfg, mesh, rollout.RolloutConfig(max_prompt_len=64, turn_tokens=24, slots=4,
                                                            filter_metric="score"),
                      sc, env=env, episode_cfg=episodes.EpisodeConfig(max_turns=1, timeout_s=60, poll_steps=4))
  examples = [data.Example(messages=[{"role": "user", "content": q}], ground_truth=a, data_source="t", index=i)
              for i, (q, a) in enumerate(QA)]
  G = 2
  groups, _ = r.groups(params, examples, G, jax.random.key(0))
  r.episodes.close()
  assert r.episodes.counts["errors"] == 0 and r.episodes.counts["timeouts"] == 0, r.episodes.last_error
  tokens, mask = groups.tokens_QGC.reshape(len(QA) * G, -1), groups.mask_QGC.reshape(len(QA) * G, -1)
  texts = [tok.decode([t for t in tokens[b, :mask[b].sum()] if t not in eos], skip_special_tokens=True)
           for b in range(len(tokens))]
  # The rubric's reward is the exact match of the sampled text, by hand.
  by_hand = [float(t.strip().rsplit("Answer:", 1)[-1].strip() == QA[b // G][1]) if "Answer:" in t else 0.0
             for b, t in enumerate(texts)]
  np.testing.assert_array_equal(groups.score_QG.reshape(-1), by_hand)
  assert sum(by_hand) >= 3, texts  # The two learnt questions are answered.
  # The prompt is the run's example rendered by the template; the log-probs are teacher-forced.
  P = groups.prompt_QP.shape[1]
  tokens_BT = np.concatenate([np.repeat(groups.prompt_QP, G, 0), tokens], 1)
  mask_BT = np.concatenate([np.repeat(groups.prompt_mask_QP, G, 0), mask], 1)
  logits = np.asarray(model_lib.logits(cfg, params, tokens_BT, mask_BT), np.float64) / TEMPERATURE
  ref = logits - logits.max(-1, keepdims=True)
  ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
  logp = groups.logp_QGC.reshape(len(tokens), -1)
  for b in range(len(tokens)):
    pos = np.flatnonzero(mask[b])
    np.testing.assert_allclose(logp[b, pos], ref[b, P - 1 + pos, tokens[b, pos]], atol=2e-5)


def test_an_environment_that_is_not_one_is_refused_and_the_trainers_signal_handlers_stay():
  """A verifiers Environment's constructor installs SIGINT and SIGTERM handlers: built for a run, it
  leaves the trainer's in place (here on the main thread, where it could)."""
  with pytest.raises(TypeError, match="gave a dict, not a verifiers Environment"):
    verifiers_env.VerifiersEnv(environment="builtins:dict")
  before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
  env = verifiers_env.VerifiersEnv(environment="dapo_jax.serve.verifiers_env:arith_exact_match",
                                   env_args={"system_prompt": "Be brief."})
  assert isinstance(env.environment, vf.SingleTurnEnv)
  assert {s: signal.getsignal(s) for s in before} == before


@pytest.mark.slow
def test_a_command_line_run_trains_with_a_verifiers_environment(tmp_path):
  """Two steps of the runlocal job (its untrained model) with the arithmetic task's exact match as a
  verifiers rubric: every episode scored, an empty reply included (no environment errors), the
  rubric's rewards in the metrics (`rollout/acc_all`)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, XLA_FLAGS=testing.FAST_COMPILE_XLA_FLAGS)
  out = subprocess.run([sys.executable, "-m", "launch.train", "--config=configs/default.py:runlocal",
                        "--config.rollout.env=dapo_jax.serve.verifiers_env:VerifiersEnv",
                        '--config.rollout.env_args={"environment": "dapo_jax.serve.verifiers_env:arith_exact_match"}',
                        "--config.train.num_steps=2", f"--workdir={tmp_path / 'run'}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  steps = [r for r in rows if "env/errors" in r]
  assert len(steps) == 2 and all(r["env/errors"] == 0 and r["env/timeouts"] == 0 for r in steps), rows[-1]
  assert all(r["rollout/samples"] > 0 and 0 <= r["rollout/acc_all"] <= 1 for r in steps), rows[-1]
