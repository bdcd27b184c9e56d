"""The RLHF objectives against independent references: packed SFT == unpacked, the reward model's
pairwise loss == NumPy on per-row scores, the DPO step's loss == loss.dpo_loss on naive log-probs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax import loss, objectives, optim, rlhf_objectives, sharding, testing, train_step
from dapo_jax.data import conversations
from dapo_jax.datatypes import LMBatch, PackedLMBatch, PreferenceBatch
from dapo_jax.model import transformer as model

V = 64


def _params(cfg, seed, head="lm"):
  p = model.init_params(cfg, jax.random.key(seed), head)
  if head == "scalar":  # A zero head scores everything 0; make it informative.
    p["score_D"] = jax.random.normal(jax.random.key(seed + 100), p["score_D"].shape)
  return p


def _docs(rng, n=5):
  docs = []
  for _ in range(n):
    k = int(rng.integers(3, 12))
    ids = rng.integers(1, V, size=k).astype(np.int32)
    mask = rng.random(k) < 0.7
    docs.append(conversations.Document(ids, mask))
  return docs


def test_packed_loss_equals_unpacked():
  cfg = testing.tiny_model_config(V)
  params = _params(cfg, 0)
  docs = _docs(np.random.default_rng(0), 6)
  packed = conversations.pack(docs, seq_len=24)
  assert packed.tokens_BT.shape[0] < len(docs)  # Several documents share a row.
  pb = PackedLMBatch(packed.tokens_BT, packed.positions_BT, packed.segment_ids_BT, packed.loss_mask_BT)
  obj = rlhf_objectives.packed_language_model(cfg)
  got, m = obj.loss(params, pb, obj.counts(pb))

  # Reference: every document alone in its own left-padded row, the plain LM objective.
  T = max(len(d.ids) for d in docs)
  tokens = np.zeros((len(docs), T), np.int32)
  mask = np.zeros((len(docs), T), bool)
  lmask = np.zeros((len(docs), T), bool)
  for b, d in enumerate(docs):
    tokens[b, T - len(d.ids):], mask[b, T - len(d.ids):], lmask[b, T - len(d.ids):] = d.ids, True, d.loss_mask
    lmask[b, T - len(d.ids)] = False  # A document's first token has nothing to be predicted from.
  lb = LMBatch(tokens, mask, lmask)
  ref_obj = objectives.language_model(cfg)
  want, _ = ref_obj.loss(params, lb, ref_obj.counts(lb))
  np.testing.assert_allclose(float(got), float(want), atol=1e-5, rtol=1e-5)
  assert float(obj.counts(pb)["num_tokens"]) == float(ref_obj.counts(lb)["num_tokens"])
  # The held-out pass sums the same NLL.
  nll = np.asarray(rlhf_objectives.packed_nll(cfg)(params, pb))
  np.testing.assert_allclose(nll[:, 0].sum() / nll[:, 1].sum(), float(want), rtol=1e-5)


def _pairs(rng, n, P=6, C=5):
  """n preference pairs, interleaved, with left-padded prompts and right-padded responses."""
  tokens = np.zeros((2 * n, P + C), np.int32)
  mask = np.zeros((2 * n, P + C), bool)
  for i in range(n):
    p = int(rng.integers(2, P + 1))
    prompt = rng.integers(1, V, size=p)
    for j in range(2):
      c = int(rng.integers(1, C + 1))
      tokens[2 * i + j, P - p:P], mask[2 * i + j, P - p:P] = prompt, True
      tokens[2 * i + j, P:P + c], mask[2 * i + j, P:P + c] = rng.integers(1, V, size=c), True
  return PreferenceBatch(tokens, mask, mask[:, P:].copy(), np.zeros(2 * n, np.float32))


def _naive_rows(batch):
  """Each row's real tokens alone (no padding at all)."""
  return [batch.tokens_BT[b][batch.mask_BT[b]] for b in range(len(batch.tokens_BT))]


def test_reward_model_loss_matches_numpy():
  cfg = testing.tiny_model_config(V)
  params = _params(cfg, 1, "scalar")
  batch = _pairs(np.random.default_rng(1), 4)
  r = []
  for row in _naive_rows(batch):  # Score: the head at the last token of the unpadded row.
    t = jnp.asarray(row)[None]
    out = model.forward(cfg, params, t, jnp.arange(len(row))[None], model.causal_mask(jnp.ones_like(t, bool)),
                        head="scalar")
    r.append(float(out[0, -1]))
  r = np.asarray(r, np.float64)
  diff = r[0::2] - r[1::2]
  for margin in (0.0, 0.5):
    want = np.mean(np.log1p(np.exp(-(diff - margin))))
    obj = rlhf_objectives.reward_model(cfg, margin)
    got, m = obj.loss(params, batch, obj.counts(batch))
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    np.testing.assert_allclose(float(m["accuracy"]), np.mean(diff > 0))
    np.testing.assert_allclose(float(m["margin"]), np.mean(diff), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(rlhf_objectives.reward_scores(cfg)(params, batch)), r, rtol=1e-5, atol=1e-6)


def _trainer(cfg, objective, micro, head="lm"):
  mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1}, jax.devices()[:2])
  opt = optim.OptimConfig(lr=1e-3, warmup_steps=0, weight_decay=0.0)
  return train_step.Trainer(cfg, opt, mesh, objective, num_microbatches=micro, head=head)


def test_reward_model_step_is_the_same_in_microbatches():
  cfg = testing.tiny_model_config(V)
  params = _params(cfg, 2, "scalar")
  batch = _pairs(np.random.default_rng(2), 8)
  out = []
  for micro in (1, 2):
    tr = _trainer(cfg, rlhf_objectives.reward_model(cfg), micro, head="scalar")
    state = tr.init(params=params)
    state, m = tr.step(state, tr.put_batch(batch))
    out.append((jax.device_get(m), jax.device_get(state.params["score_D"])))
  for k in ("loss", "accuracy", "margin", "grad_norm"):
    np.testing.assert_allclose(out[0][0][k], out[1][0][k], rtol=1e-5, err_msg=k)
  np.testing.assert_allclose(out[0][1], out[1][1], rtol=1e-4, atol=1e-6)


def _naive_logp(cfg, params, batch):
  """Σ log π(response) of each row, from `model.logits` on the unpadded row."""
  P = batch.tokens_BT.shape[1] - batch.loss_mask_BC.shape[1]
  out = []
  for b in range(len(batch.tokens_BT)):
    prompt = batch.tokens_BT[b, :P][batch.mask_BT[b, :P]]
    resp = batch.tokens_BT[b, P:][batch.loss_mask_BC[b]]
    row = jnp.asarray(np.concatenate([prompt, resp]))[None]
    logits = np.asarray(model.logits(cfg, params, row, jnp.ones_like(row, bool)), np.float64)[0]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    out.append(sum(logp[len(prompt) - 1 + t, resp[t]] for t in range(len(resp))))
  return np.asarray(out)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_step_loss_matches_dpo_loss(loss_type):
  cfg = testing.tiny_model_config(V)
  policy, ref = _params(cfg, 3), _params(cfg, 4)
  batch = _pairs(np.random.default_rng(3), 4)
  ref_logp = _naive_logp(cfg, ref, batch)
  logp = _naive_logp(cfg, policy, batch)
  # The reference pass the driver runs (Trainer.forward) gives the same log-probs.
  dcfg = rlhf_objectives.DPOConfig(beta=0.2, loss_type=loss_type)
  tr = _trainer(cfg, rlhf_objectives.dpo(cfg, dcfg), 2)
  ref_fn = tr.forward(rlhf_objectives.response_logprobs(cfg))
  got_ref = np.asarray(jax.device_get(ref_fn(tr.copy_params(sharding.put(ref, tr.params_sharding)),
                                             tr.put_batch(batch))))
  np.testing.assert_allclose(got_ref, ref_logp, rtol=1e-5)
  batch = batch.replace(ref_logp_B=got_ref.astype(np.float32))
  n = batch.loss_mask_BC.sum(1) if loss_type == "ipo" else np.ones(len(logp))
  want, want_m = loss.dpo_loss(logp[0::2] / n[0::2], logp[1::2] / n[1::2], ref_logp[0::2] / n[0::2],
                               ref_logp[1::2] / n[1::2], 0.2, loss_type)
  state = tr.init(params=policy)
  _, m = tr.step(state, tr.put_batch(batch))
  m = jax.device_get(m)
  np.testing.assert_allclose(m["loss"], float(want), rtol=1e-5)
  for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies"):
    np.testing.assert_allclose(m[k], float(want_m[k]), rtol=1e-4, atol=1e-6, err_msg=k)


@pytest.mark.slow  # Naive per-row log-probs of two models (~25 s on 2 cores).
def test_rpo_adds_alpha_times_the_chosen_token_mean_nll():
  # RPO (TRL's rpo_alpha): mean_pairs(-log σ(β h)) + α · (-Σ log π(chosen tokens) / #chosen tokens).
  cfg = testing.tiny_model_config(V)
  policy, ref = _params(cfg, 3), _params(cfg, 4)
  batch = _pairs(np.random.default_rng(5), 2)
  logp, ref_logp = _naive_logp(cfg, policy, batch), _naive_logp(cfg, ref, batch)
  batch = batch.replace(ref_logp_B=ref_logp.astype(np.float32))
  beta, alpha = 0.2, 0.7
  h = (logp[0::2] - logp[1::2]) - (ref_logp[0::2] - ref_logp[1::2])
  nll = -logp[0::2].sum() / batch.loss_mask_BC[0::2].sum()
  want = np.mean(np.log1p(np.exp(-beta * h))) + alpha * nll
  obj = rlhf_objectives.dpo(cfg, rlhf_objectives.DPOConfig(beta=beta, rpo_alpha=alpha))
  counts = obj.counts(batch)
  # Two micro-batches of one pair each, with the mini-batch's counts, add up to the whole.
  halves = [jax.tree.map(lambda x: x[rows], batch) for rows in (slice(0, 2), slice(2, 4))]
  loss_fn = jax.jit(obj.loss)
  outs = [loss_fn(policy, half, counts) for half in halves]
  np.testing.assert_allclose(sum(float(v) for v, _ in outs), want, rtol=1e-5)
  np.testing.assert_allclose(sum(float(m["nll_loss"]) for _, m in outs), nll, rtol=1e-5)
  plain = rlhf_objectives.dpo(cfg, rlhf_objectives.DPOConfig(beta=beta))
  np.testing.assert_allclose(float(plain.loss(policy, batch, plain.counts(batch))[0]), want - alpha * nll, rtol=1e-5)


def test_from_pairs_interleaves():
  tokens = np.arange(8)[:, None] * np.ones((1, 3), np.int32)
  b = PreferenceBatch.from_pairs(tokens, tokens > 0, tokens[:, 1:] > 0)
  assert b.tokens_BT[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_value_model_loss_matches_value_loss_on_naive_values():
  from dapo_jax.datatypes import ValueBatch
  cfg = testing.tiny_model_config(V)
  params = _params(cfg, 5, "scalar")
  pairs = _pairs(np.random.default_rng(5), 2)  # Rows 2i, 2i+1 share a prompt: groups of G=2.
  P = pairs.tokens_BT.shape[1] - pairs.loss_mask_BC.shape[1]
  C = pairs.loss_mask_BC.shape[1]
  naive = np.zeros((len(pairs.tokens_BT), C))
  for b in range(len(naive)):  # V(s_t): the head at the position of the token before completion token t.
    prompt = pairs.tokens_BT[b, :P][pairs.mask_BT[b, :P]]
    row = jnp.asarray(np.concatenate([prompt, pairs.tokens_BT[b, P:]]))[None]
    v = np.asarray(model.forward(cfg, params, row, jnp.arange(row.shape[1])[None],
                                 model.causal_mask(jnp.ones_like(row, bool)), head="scalar"))[0]
    naive[b] = v[len(prompt) - 1:len(prompt) - 1 + C]
  rng = np.random.default_rng(6)
  batch = ValueBatch(pairs.tokens_BT, pairs.mask_BT, pairs.loss_mask_BC,
                     (naive + 0.3 * rng.standard_normal(naive.shape)).astype(np.float32),
                     rng.standard_normal(naive.shape).astype(np.float32))
  m = pairs.loss_mask_BC
  for G in (0, 2):
    got_v = np.asarray(rlhf_objectives.completion_values(cfg, G)(params, batch))
    np.testing.assert_allclose(np.where(m, got_v, 0), np.where(m, naive, 0), rtol=1e-5, atol=1e-5)
    obj = rlhf_objectives.value_model(cfg, clip_range=0.2, group_size=G)
    got, _ = obj.loss(params, batch, obj.counts(batch))
    want, _ = loss.value_loss(jnp.asarray(naive), batch.old_values_BC, batch.returns_BC, m, 0.2)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
