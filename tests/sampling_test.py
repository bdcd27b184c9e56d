"""The jitted KV-cache sampler against teacher-forced references."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax import loss, testing
from dapo_jax.model import transformer as model
from dapo_jax.rollout import sampling

CFG = testing.tiny_model_config(vocab_size=50)
PARAMS = testing.sharp_params(CFG, seed=3)


def prompts(lengths, P=8, seed=0):
  rng = np.random.default_rng(seed)
  tokens = np.zeros((len(lengths), P), np.int32)
  mask = np.zeros((len(lengths), P), bool)
  for b, n in enumerate(lengths):
    tokens[b, P - n:] = rng.integers(5, CFG.vocab_size, size=n)
    mask[b, P - n:] = True
  return tokens, mask


def teacher_forced_logits(prompt, pmask, completion):
  tokens = np.concatenate([prompt, completion], axis=1)
  mask = np.concatenate([pmask, np.ones_like(completion, bool)], axis=1)
  return np.asarray(model.logits(CFG, PARAMS, jnp.asarray(tokens), jnp.asarray(mask)))


def test_greedy_decode_equals_teacher_forced_argmax():
  prompt, pmask = prompts([8, 5, 2])
  out = sampling.generate(CFG, sampling.SamplerConfig(max_new_tokens=10, temperature=0.0), PARAMS,
                          prompt, pmask, jax.random.key(0))
  comp = np.asarray(out.tokens_BC)
  logits = teacher_forced_logits(prompt, pmask, comp)
  P = prompt.shape[1]
  # Logits at position P-1+t predict completion token t.
  np.testing.assert_array_equal(np.argmax(logits[:, P - 1:-1], -1), comp)
  # No EOS ids: every row runs to the budget and is truncated.
  assert np.asarray(out.truncated_B).all() and (np.asarray(out.length_B) == 10).all()


def test_logp_equals_teacher_forced_logp():
  prompt, pmask = prompts([8, 6, 3, 1])
  cfg = sampling.SamplerConfig(max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=20)
  out = sampling.generate(CFG, cfg, PARAMS, prompt, pmask, jax.random.key(1))
  comp = np.asarray(out.tokens_BC)
  logits = teacher_forced_logits(prompt, pmask, comp)
  P = prompt.shape[1]
  ref = loss.token_logprobs(jnp.asarray(logits[:, P - 1:-1]) / 0.7, jnp.asarray(comp))
  np.testing.assert_allclose(np.asarray(out.logp_BC), np.asarray(ref), atol=1e-5, rtol=0)


def test_greedy_independent_of_padding_and_batch():
  cfg = sampling.SamplerConfig(max_new_tokens=8, temperature=0.0)
  prompt, pmask = prompts([4, 7, 2], P=8, seed=5)
  batched = np.asarray(sampling.generate(CFG, cfg, PARAMS, prompt, pmask, jax.random.key(0)).tokens_BC)
  for b in range(3):
    n = int(pmask[b].sum())
    for P in (n, n + 5):  # Alone, with no padding and with extra padding.
      alone = np.zeros((1, P), np.int32)
      amask = np.zeros((1, P), bool)
      alone[0, P - n:] = prompt[b, -n:]
      amask[0, P - n:] = True
      got = np.asarray(sampling.generate(CFG, cfg, PARAMS, alone, amask, jax.random.key(0)).tokens_BC)
      np.testing.assert_array_equal(got[0], batched[b])


def _eos_pair(free):
  """EOS ids from a free-running output such that rows 0 and 1 stop at different steps via
  different ids, and row 2 (containing neither) runs out of budget; None if there are none."""
  for t0 in range(1, 10):
    for t1 in range(1, 10):
      a, b = free[0, t0], free[1, t1]
      if (t0 != t1 and a != b and a not in free[0, :t0] and b not in free[1, :t1]
          and a not in free[1, :t1 + 1] and b not in free[0, :t0 + 1]
          and a not in free[2] and b not in free[2]):
        return int(a), int(b), t0, t1
  return None


def test_several_eos_ids_and_truncation():
  prompt, pmask = prompts([8, 6, 4], seed=7)
  # Sampling at T=1 gives varied tokens; with the same key, a row's tokens do not depend on
  # whether other rows have stopped.
  for seed in range(10):
    key = jax.random.key(seed)
    free = np.asarray(sampling.generate(CFG, sampling.SamplerConfig(max_new_tokens=10), PARAMS, prompt,
                                        pmask, key).tokens_BC)
    eos = _eos_pair(free)
    if eos:
      break
  assert eos is not None, "test model produced no usable tokens; change the seed"
  a, b, t0, t1 = eos
  cfg = sampling.SamplerConfig(max_new_tokens=10, eos_ids=(a, b), pad_id=0)
  out = sampling.generate(CFG, cfg, PARAMS, prompt, pmask, key)
  np.testing.assert_array_equal(np.asarray(out.length_B), [t0 + 1, t1 + 1, 10])
  np.testing.assert_array_equal(np.asarray(out.truncated_B), [False, False, True])
  mask = np.asarray(out.mask_BC)
  tokens = np.asarray(out.tokens_BC)
  for row, n in enumerate([t0 + 1, t1 + 1, 10]):
    assert mask[row, :n].all() and not mask[row, n:].any()
    np.testing.assert_array_equal(tokens[row, :n], free[row, :n])   # the EOS itself is included
    assert (tokens[row, n:] == 0).all() and (np.asarray(out.logp_BC)[row, n:] == 0).all()


def test_budget_and_prompts_do_not_recompile():
  cfg = sampling.SamplerConfig(max_new_tokens=6, temperature=1.0)
  prompt, pmask = prompts([8, 3])
  sampling.generate(CFG, cfg, PARAMS, prompt, pmask, jax.random.key(0))
  n = sampling.generate_jit._cache_size()
  prompt2, pmask2 = prompts([2, 5], seed=9)
  out = sampling.generate(CFG, cfg, PARAMS, prompt2, pmask2, jax.random.key(4), max_new_tokens=3)
  assert sampling.generate_jit._cache_size() == n
  assert (np.asarray(out.length_B) == 3).all()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.0, 3, 1.0),
                                                     (1.0, 0, 0.8), (2.0, 4, 0.9)])
def test_token_distribution(temperature, top_k, top_p):
  logits = np.array([2.0, 1.5, 1.0, 0.3, 0.0, -1.0], np.float32)
  # The intended distribution, computed independently in NumPy.
  z = logits / temperature
  order = np.argsort(-z)
  keep = np.zeros_like(z, bool)
  keep[order[: top_k or len(z)]] = True
  p = np.where(keep, np.exp(z - z.max()), 0)
  p /= p.sum()
  if top_p < 1:
    mass_before = np.cumsum(p[order]) - p[order]
    nucleus = np.zeros_like(keep)
    nucleus[order[mass_before < top_p]] = True
    p = np.where(nucleus, p, 0)
    p /= p.sum()
  n = 200_000
  cfg = sampling.SamplerConfig(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
  tok, logp = jax.jit(sampling.choose, static_argnums=2)(
      jnp.broadcast_to(jnp.asarray(logits), (n, 6)), jax.random.uniform(jax.random.key(42), (n,)), cfg)
  freq = np.bincount(np.asarray(tok), minlength=6) / n
  # 5 standard errors of a binomial proportion: a false alarm has probability < 1e-5 per token.
  bound = 5 * np.sqrt(p * (1 - p) / n) + 1e-12
  assert np.all(np.abs(freq - p) <= bound), (freq, p, bound)
  # logp is the temperature-scaled log-softmax before truncation.
  ref_logp = z - np.log(np.exp(z).sum())
  np.testing.assert_allclose(np.asarray(logp)[:100], ref_logp[np.asarray(tok)[:100]], atol=1e-5)


def test_samples_per_prompt_share_one_prefill():
  # G samples of one prompt row == the same prompt repeated G times (same key, same rows).
  cfg = sampling.SamplerConfig(max_new_tokens=6, temperature=1.0)
  prompt, pmask = prompts([5, 3], seed=3)
  shared = sampling.generate(CFG, cfg, PARAMS, prompt, pmask, jax.random.key(2), num_samples=3)
  repeated = sampling.generate(CFG, cfg, PARAMS, np.repeat(prompt, 3, 0), np.repeat(pmask, 3, 0),
                               jax.random.key(2))
  np.testing.assert_array_equal(np.asarray(shared.tokens_BC), np.asarray(repeated.tokens_BC))
  np.testing.assert_allclose(np.asarray(shared.logp_BC), np.asarray(repeated.logp_BC), atol=1e-6)
  assert len(set(map(tuple, np.asarray(shared.tokens_BC)[:3]))) > 1  # The samples differ.


def test_per_row_choice_equals_choose_with_each_rows_config():
  """A server's rows carry their own temperature and top-p: each row gets exactly what `choose`
  gives it with that row's SamplerConfig (tokens and log-probs), greedy rows included."""
  B, V = 6, 300
  logits_BV = jax.random.normal(jax.random.key(1), (B, V)) * 3.0
  u_B = jax.random.uniform(jax.random.key(2), (B,))
  temperature_B = np.array([0.0, 1.0, 0.7, 1.3, 1.0, 0.0], np.float32)
  top_p_B = np.array([1.0, 1.0, 0.9, 0.5, 0.95, 0.3], np.float32)
  for top_k in (0, 20):
    tok_B, logp_B = jax.jit(sampling.choose_rows, static_argnums=4)(logits_BV, u_B, temperature_B, top_p_B, top_k)
    for b in range(B):
      cfg = sampling.SamplerConfig(max_new_tokens=1, temperature=float(temperature_B[b]), top_p=float(top_p_B[b]),
                                   top_k=top_k)
      want_tok, want_logp = sampling.choose(logits_BV[b:b + 1], u_B[b:b + 1], cfg)
      assert int(tok_B[b]) == int(want_tok[0]), (b, top_k)
      np.testing.assert_allclose(float(logp_B[b]), float(want_logp[0]), rtol=1e-6, atol=1e-6)
  # Without truncation anywhere the nucleus branch is skipped and the draws are the same.
  tok_B, _ = sampling.choose_rows(logits_BV, u_B, temperature_B, np.ones(B, np.float32))
  for b in range(B):
    cfg = sampling.SamplerConfig(max_new_tokens=1, temperature=float(temperature_B[b]))
    assert int(tok_B[b]) == int(sampling.choose(logits_BV[b:b + 1], u_B[b:b + 1], cfg)[0][0])
