"""Teacher-forced scoring (`serve.scoring`): each token's log-prob and the top alternatives against the
log-softmax of the model's own logits, whatever the batch, length bucket and chunk."""
import jax
import numpy as np

from dapo_jax import testing
from dapo_jax.model import transformer as model_lib
from dapo_jax.serve import scoring

CFG = testing.tiny_model_config(vocab_size=97)


def reference(params, row):
  """[len(row), V] fp64 log-softmax of `model_lib.logits` on the row alone."""
  z = np.asarray(model_lib.logits(CFG, params, np.asarray([row], np.int32), np.ones((1, len(row)), bool)))[0]
  z = z.astype(np.float64)
  return z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))


def test_scores_equal_the_models_log_softmax_in_any_batch():
  params = model_lib.init_params(CFG, jax.random.key(0))
  rng = np.random.default_rng(0)
  rows = [rng.integers(0, 97, size=n).tolist() for n in (1, 7, 40, 33, 12, 64)]
  greedy = [5, 9]
  for _ in range(6):  # A row the model continues greedily: its tokens are the argmax.
    greedy.append(int(np.argmax(reference(params, greedy)[-1])))
  rows.append(greedy)
  scorer = scoring.Scorer(CFG, max_len=64, max_tokens=128, chunk=16, smallest=8)  # batches of several shapes
  scores = scorer(params, rows)
  alone = [scoring.Scorer(CFG, max_len=64, chunk=5)(params, [row])[0] for row in rows]  # chunks not dividing T
  for row, s, a in zip(rows, scores, alone):
    ref = reference(params, row)
    n = len(row)
    assert s.logp.shape == (n,) and np.isnan(s.logp[0]) and s.top_logp.shape == (n + 1, 20)
    np.testing.assert_allclose(s.logp[1:], ref[np.arange(n - 1), row[1:]], atol=1e-5)
    # Position j's alternatives are those of the distribution predicting token j (row n: after the row).
    np.testing.assert_allclose(s.top_logp[1:], -np.sort(-ref, axis=-1)[:, :20], atol=1e-5)
    np.testing.assert_array_equal(s.top_ids[1:], np.argsort(-ref, axis=-1, kind="stable")[:, :20])
    np.testing.assert_allclose(a.logp[1:], s.logp[1:], atol=1e-6)
    np.testing.assert_allclose(a.top_logp[1:], s.top_logp[1:], atol=1e-6)
    # The token's value and the alternatives come from one array: the argmax's value is the top one, exactly.
    argmax = [j for j in range(1, n) if row[j] == s.top_ids[j, 0]]
    assert all(s.logp[j] == s.top_logp[j, 0] for j in argmax)
  assert all(scores[-1].logp[j] == scores[-1].top_logp[j, 0] for j in range(2, len(greedy)))
