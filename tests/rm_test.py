"""Reward model: the HF ...ForSequenceClassification export scored by transformers, the directory
checks, the scorer for the RM server and the `rm:DIR` reward."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax import testing
from dapo_jax.hf import convert as hf
from dapo_jax.model import transformer as model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PAD = 0


def _scalar_params(cfg, seed=0):
  p = model.init_params(cfg, jax.random.key(seed), "scalar")
  p["score_D"] = jax.random.normal(jax.random.key(seed + 1), p["score_D"].shape)
  # Non-trivial norms so no parameter is a no-op.
  p["final_norm"]["scale_D"] = 1.0 + 0.1 * jax.random.normal(jax.random.key(seed + 2), p["final_norm"]["scale_D"].shape)
  return jax.device_get(p)


def _padded_rows(vocab, seed=0):
  """[left-padded prompt | right-padded response] rows, pad id 0 never a real token."""
  rng = np.random.default_rng(seed)
  P, C = 7, 6
  tokens = np.full((4, P + C), PAD, np.int64)
  mask = np.zeros((4, P + C), bool)
  for b, (p, c) in enumerate([(7, 6), (3, 2), (5, 6), (1, 1)]):
    tokens[b, P - p:P + c] = rng.integers(1, vocab, size=p + c)
    mask[b, P - p:P + c] = True
  return tokens, mask


@pytest.mark.parametrize("arch,bias,tied", [("qwen2", True, True), ("llama", False, False)])
def test_export_scores_like_transformers(tmp_path, arch, bias, tied):
  cfg = testing.tiny_model_config(97, arch=arch, qkv_bias=bias, tie_embeddings=tied)
  params = _scalar_params(cfg)
  out = str(tmp_path / "rm")
  hf.save_scalar(out, cfg, params, pad_token_id=PAD)
  hf_cfg = json.load(open(os.path.join(out, "config.json")))
  assert hf_cfg["architectures"] == [{"qwen2": "Qwen2ForSequenceClassification",
                                      "llama": "LlamaForSequenceClassification"}[arch]]
  assert hf_cfg["num_labels"] == 1
  tokens, mask = _padded_rows(97)
  ours = np.asarray(model.last_token_scores(cfg, params, jnp.asarray(tokens, jnp.int32), jnp.asarray(mask)))
  m = transformers.AutoModelForSequenceClassification.from_pretrained(out).float().eval()
  assert tuple(m.score.weight.shape) == (1, cfg.embed_dim)
  with torch.no_grad():
    theirs = m(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64))).logits
  np.testing.assert_allclose(ours, theirs.numpy()[:, 0], atol=1e-4, rtol=1e-4)
  # And back: load_scalar gives the same params.
  cfg2, params2 = hf.load_scalar(out)
  np.testing.assert_allclose(params2["score_D"], params["score_D"], rtol=1e-6)
  again = model.last_token_scores(cfg2, params2, jnp.asarray(tokens, jnp.int32), jnp.asarray(mask))
  np.testing.assert_allclose(np.asarray(again), ours, rtol=1e-5, atol=1e-6)


def test_directory_without_score_head_fails_naming_it(tmp_path):
  cfg = testing.tiny_model_config(97)
  lm_dir = str(tmp_path / "lm")
  hf.save(lm_dir, cfg, jax.device_get(model.init_params(cfg, jax.random.key(0))), pad_token_id=PAD)
  with pytest.raises(hf.CheckpointError, match=f"{lm_dir}: no score head"):
    hf.load_scalar(lm_dir)
  rm_dir = str(tmp_path / "rm")
  hf.save_scalar(rm_dir, cfg, _scalar_params(cfg), pad_token_id=PAD)
  with pytest.raises(hf.CheckpointError, match=f"{rm_dir}: a scalar-head model"):
    hf.load(rm_dir)


def test_scorer_and_rm_reward_score_responses(tmp_path, tiny_tokenizer_dir):
  from dapo_jax import rewards
  from dapo_jax.data import tokenizer as tokenizer_lib
  from dapo_jax.rewards import model as rm_model
  tok = tokenizer_lib.load(tiny_tokenizer_dir)
  cfg = testing.tiny_model_config(((len(tok) + 63) // 64) * 64)
  params = _scalar_params(cfg, 5)
  out = str(tmp_path / "rm")
  hf.save_scalar(out, cfg, params, tokenizer=tok)
  prompts = ["What is 12 + 30?", "What is 7 + 8?", "What is 100 + 1?"]
  responses = ["Answer: 42", "7 + 8 = 15\nAnswer: 15", "Answer: 3"]
  # Reference: each unpadded row [rendered prompt | response | EOS], the head at its last token.
  want = []
  for p, r in zip(prompts, responses):
    text = tokenizer_lib.render(tok, [{"role": "user", "content": p}])
    ids = tok(text, add_special_tokens=False)["input_ids"] + tok(r, add_special_tokens=False)["input_ids"]
    ids = jnp.asarray(ids + [tok.eos_token_id])[None]
    want.append(float(model.last_token_scores(cfg, params, ids, jnp.ones_like(ids, bool))[0]))
  score_fn = rm_model.scorer(out)
  np.testing.assert_allclose(score_fn(prompts, responses), want, rtol=1e-5, atol=1e-6)
  reward = rewards.make_reward(f"rm:{out}")
  got = reward(responses, ["42", "15", "101"], prompts)
  np.testing.assert_allclose([g["score"] for g in got], want, rtol=1e-5, atol=1e-6)
  assert [g["acc"] for g in got] == [w > 0 for w in want]
  assert reward.errors == reward.timeouts == 0
  # The same model behind the HTTP server (`launch.serve_rm`'s default scorer), on localhost.
  from dapo_jax.serve import rm_server
  with rm_server.RMServer(rm_server.load_scorer("dapo_jax.rewards.model:scorer", out)) as server:
    remote = rewards.HTTPReward(server.url)(responses, ["42", "15", "101"], prompts)
  np.testing.assert_allclose([g["score"] for g in remote], want, rtol=1e-5, atol=1e-6)
  # Weighted with another reward that judges the prompt: the sum of the parts.
  both = rewards.CombinedReward([(f"rm:{out}", 1.0), (f"rm:{out}", 0.5)])
  np.testing.assert_allclose([g["score"] for g in both(responses, ["42", "15", "101"], prompts)],
                             1.5 * np.asarray(want), rtol=1e-5, atol=1e-6)


def test_rm_reward_spec_without_directory_fails():
  from dapo_jax import rewards
  with pytest.raises(rewards.RewardConfigError, match="rm:DIR"):
    rewards.make_reward("rm:")
  with pytest.raises(hf.CheckpointError, match="no config.json"):
    rewards.make_reward("rm:/nonexistent/rm_model")


def test_pairwise_metrics_per_error_kind():
  from dapo_jax.pipelines import rm
  diff = [2.0, -1.0, 0.5, 3.0, -0.5]
  m = rm.pairwise_metrics(diff, ["sum", "sum", "carry", None, "carry"])
  assert m["accuracy"] == pytest.approx(3 / 5) and m["margin"] == pytest.approx(4.0 / 5)
  want_loss = np.mean([np.log1p(np.exp(-d)) for d in diff])
  assert m["loss"] == pytest.approx(want_loss)
  # Per kind: sum 1 of 2, carry 1 of 2; the row without a kind counts only in the total.
  assert (m["accuracy/sum"], m["accuracy/carry"]) == (0.5, 0.5)
  assert set(rm.pairwise_metrics(diff)) == {"accuracy", "margin", "loss"}


@pytest.mark.slow  # One DAPO step with its compiles and a reward model: ~20 s on 2 cores.
def test_dapo_loop_trains_on_a_reward_model(tmp_path, tiny_tokenizer_dir):
  """configs/default.py with reward.fn=rm:DIR: the loop scores every rollout with the reward model
  (prompts included) and logs its scores."""
  from configs import common, default
  from dapo_jax import builders, metrics
  from dapo_jax.data import tokenizer as tokenizer_lib
  from dapo_jax.rewards import model as rm_model
  tok = tokenizer_lib.load(tiny_tokenizer_dir)
  rm_dir = str(tmp_path / "rm")
  rm_cfg = testing.tiny_model_config(((len(tok) + 63) // 64) * 64)
  hf.save_scalar(rm_dir, rm_cfg, _scalar_params(rm_cfg, 3), tokenizer=tok)
  cfg = default.get_config()
  common.runlocal(cfg)
  cfg.reward.fn = f"rm:{rm_dir}"
  cfg.train.update(num_steps=1, log_samples_every=0)
  cfg.data.num_eval = 0
  with builders.dapo(cfg, str(tmp_path / "run")) as run:
    reward = run.rollout.reward
    assert isinstance(reward, rm_model.RMReward)
    calls = []
    score = reward.scorer
    def spy(prompts, responses):
      out = score(prompts, responses)
      calls.append((list(prompts), list(responses), list(out)))
      return out
    reward.scorer = spy
    run.run()
  assert calls and all(p.startswith("What is ") for ps, _, _ in calls for p in ps)
  # The loop's accuracy is the reward model's, the fraction of its scores above 0 (all of them for this
  # head), where the rule check would give the random tiny policy about none.
  scores = np.concatenate([np.asarray(got) for _, _, got in calls])
  m = metrics.read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))
  assert m[1]["rollout/acc_all"] == pytest.approx(np.mean(scores > 0))
