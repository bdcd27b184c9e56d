"""Our losses, corrections and estimators against verl's own functions.

verl's source (tests/data/verl/*.py.txt, verbatim at the commit in tests/data/verl/COMMIT) is read
with `ast`: only the functions compared here and the helpers they call are executed, with verl's
registry decorators dropped and its config objects replaced by the stand-ins below, in torch float64.
Inputs are random, with every clip, truncation and mask binding somewhere.
"""
import __future__

import ast
import collections
import math
import pathlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax import advantages, loss

torch = pytest.importorskip("torch")

DATA = pathlib.Path(__file__).parent / "data" / "verl"


def extract(filename: str, names: tuple[str, ...], namespace: dict) -> dict:
  """Executes the named top-level functions and assignments of a verl file in `namespace`."""
  tree = ast.parse((DATA / filename).read_text())
  picked, found = [], set()
  for node in tree.body:
    if isinstance(node, ast.FunctionDef) and node.name in names:
      node.decorator_list = []  # verl's registries and @deprecated
      picked.append(node)
      found.add(node.name)
    elif isinstance(node, (ast.Assign, ast.AnnAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      hit = {t.id for t in targets if isinstance(t, ast.Name)} & set(names)
      if hit:
        picked.append(node)
        found |= hit
  assert found == set(names), set(names) - found
  code = compile(ast.Module(body=picked, type_ignores=[]), str(DATA / filename), "exec",
                 flags=__future__.annotations.compiler_flag, dont_inherit=True)
  exec(code, namespace)  # noqa: S102 - verl's own source, stored with the tests
  return namespace


class Config(dict):
  """verl's ActorConfig / AlgoConfig / policy_loss config: attributes, .get and global_batch_info."""

  def __getattr__(self, name):
    try:
      return self[name]
    except KeyError:
      raise AttributeError(name) from None


class ActorConfig(Config):
  pass


class AlgoConfig(Config):
  pass


class DataProto:
  @staticmethod
  def from_dict(tensors):
    return types.SimpleNamespace(batch=tensors)


verl_F = types.SimpleNamespace(**{k: v for k, v in extract(
    "torch_functional.py.txt", ("masked_sum", "masked_mean", "masked_var", "masked_whiten", "entropy_from_logits"),
    {"torch": torch}).items() if not k.startswith("__")})
BASE = {"torch": torch, "np": np, "math": math, "verl_F": verl_F, "defaultdict": collections.defaultdict,
        "ActorConfig": ActorConfig, "AlgoConfig": AlgoConfig, "DataProto": DataProto}
LOSS_FNS = {m: f"compute_policy_loss_{m}" for m in ("vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov",
                                                      "geo_mean", "dro", "cispo", "dppo_tv", "dppo_kl", "reinforce")}
ADV_FNS = ("compute_reinforce_plus_plus_baseline_outcome_advantage", "compute_opo_outcome_advantage",
           "compute_gpg_outcome_advantage", "compute_reinforce_plus_plus_outcome_advantage",
           "compute_grpo_outcome_advantage", "compute_rloo_outcome_advantage", "compute_gae_advantage_return",
           "compute_grpo_passk_outcome_advantage", "compute_gdpo_outcome_advantage",
           "compute_optimal_token_baseline_advantage")
verl = extract("core_algos.py.txt", (*LOSS_FNS.values(), "agg_loss", *ADV_FNS, "kl_penalty_forward"), dict(BASE))
verl_rc = extract("rollout_corr_helper.py.txt", (
    "SAFETY_BOUND", "SUPPORTED_ROLLOUT_RS_OPTIONS", "TOKEN_LEVEL_ROLLOUT_RS_OPTIONS", "_parse_rollout_is_threshold",
    "_parse_rollout_rs_thresholds", "compute_rollout_rejection_mask", "compute_rs_metrics",
    "compute_rollout_correction_weights", "compute_is_metrics", "compute_rollout_correction_and_rejection_mask",
    "compute_offpolicy_metrics"), dict(BASE))

AGGS = {"token_mean": "token-mean", "token_sum": "token-sum", "seq_mean_token_mean": "seq-mean-token-mean",
        "seq_mean_token_sum": "seq-mean-token-sum", "seq_mean_token_sum_norm": "seq-mean-token-sum-norm"}
NORM_LEN = 11
B, C = 6, 9


def case(seed: int, scale: float = 0.6, empty_row: bool = True):
  """log π, log π_old, A per row, a mask with unequal lengths, a masked span mid-row and (optionally)
  an empty row; a few ratios far outside any clip range."""
  rng = np.random.default_rng(seed)
  logp = -rng.uniform(0.02, 3.0, size=(B, C))
  log_ratio = rng.normal(0.0, scale, size=(B, C))
  log_ratio[0, 1], log_ratio[2, 3], log_ratio[3, 0] = 1.6, -1.6, 1.3   # ratios 5, 0.2, 3.7
  old = logp - log_ratio
  adv = np.array([1.3, -0.8, 0.6, -1.7, 0.0, 2.1])
  lengths = [9, 7, 4, 9, 6, 0 if empty_row else 3]
  mask = np.arange(C)[None, :] < np.array(lengths)[:, None]
  mask[3, 3:5] = False  # a tool's reply inside an episode
  return logp, old, adv, mask


def ours(mode, logp, old, adv, mask, agg, weights=None, **knobs):
  """(loss, grad wrt logp, metrics) of loss.policy_loss in float64; adv [B] or per token [B, C]."""
  adv_B, adv_BC = (adv, None) if adv.ndim == 1 else (np.zeros(len(adv)), jnp.asarray(adv))
  with jax.enable_x64(True):
    f = lambda lp: loss.policy_loss(lp, jnp.asarray(old), jnp.asarray(adv_B), jnp.asarray(mask), agg=agg, mode=mode,
                                    adv_BC=adv_BC,
                                    norm_len=NORM_LEN, is_weights_BC=None if weights is None else jnp.asarray(weights),
                                    **knobs)
    (value, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp))
    return float(value), np.asarray(grad), {k: float(v) for k, v in metrics.items()}


def theirs(mode, logp, old, adv, mask, agg, weights=None, **knobs):
  """(loss, grad wrt logp, metrics) of verl's compute_policy_loss_<mode> in torch float64."""
  k = dict(knobs)
  cfg = ActorConfig(clip_ratio=0.2, clip_ratio_low=k.pop("eps_low"), clip_ratio_high=k.pop("eps_high"),
                    tau_pos=k.pop("tau_pos", 1.0), tau_neg=k.pop("tau_neg", 1.05),
                    global_batch_info={"loss_scale_factor": NORM_LEN} if agg == "seq_mean_token_sum_norm" else {},
                    policy_loss=Config({name: k.pop(name, None) for name in (
                        "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta")}))
  c = k.pop("clip_ratio_c", None)
  if mode == "vanilla":
    cfg["clip_ratio_c"] = 1e30 if c is None else c   # verl's dual clip is always on
  elif c is not None:
    cfg["clip_ratio_c"] = c
  assert not k, k
  t = lambda x: torch.tensor(np.asarray(x, np.float64))
  lp = t(logp).requires_grad_(True)
  A = t(np.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, logp.shape).copy())
  kw = dict(loss_agg_mode=AGGS[agg], config=cfg, rollout_is_weights=None if weights is None else t(weights))
  if mode == "reinforce":
    value, metrics = verl[LOSS_FNS[mode]](rollout_log_prob=t(old), log_prob=lp, advantages=A,
                                          response_mask=t(mask), **kw)
  else:
    value, metrics = verl[LOSS_FNS[mode]](t(old), lp, A, t(mask), **kw)
  value.backward()
  return float(value.detach()), lp.grad.numpy(), {k.removeprefix("actor/"): v for k, v in metrics.items()}


KNOBS = {
    "vanilla": dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0),
    "vanilla_no_dual": dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=None),
    "gspo": dict(eps_low=3e-4, eps_high=4e-4),
    "sapo": dict(eps_low=0.2, eps_high=0.28, tau_pos=1.0, tau_neg=1.05),
    "gpg": dict(eps_low=0.2, eps_high=0.28),
    "reinforce": dict(eps_low=0.2, eps_high=0.28),
    # Every eligible token is cut (clip_num >= candidates), so verl's random choice among them is ours.
    "clip_cov": dict(eps_low=0.2, eps_high=0.28, clip_cov_ratio=0.5, clip_cov_lb=0.3, clip_cov_ub=1.5),
    "kl_cov": dict(eps_low=0.2, eps_high=0.28, kl_cov_ratio=0.2, ppo_kl_coef=0.7),
    "geo_mean": dict(eps_low=0.2, eps_high=0.28),
    "dro": dict(eps_low=0.2, eps_high=0.28, dro_beta=0.5),
    "cispo": dict(eps_low=0.2, eps_high=0.28),
    "dppo_tv": dict(eps_low=0.15, eps_high=0.1, clip_ratio_c=3.0),
    "dppo_tv_default_c": dict(eps_low=0.15, eps_high=0.1),
    "dppo_kl": dict(eps_low=0.05, eps_high=0.03, clip_ratio_c=3.0),
}


@pytest.mark.parametrize("variant", list(KNOBS))
def test_policy_losses_match_verl(variant):
  """Every mode x aggregation x (no weights, IS weights): loss, gradient and verl's metrics, to 1e-5."""
  mode = variant.removesuffix("_no_dual").removesuffix("_default_c")
  # GSPO's narrow band needs sequence ratios near 1; geo_mean counts every row in verl's mean
  # (ours: rows with tokens), so its case has none empty.
  logp, old, adv, mask = case(1, scale=1e-3 if mode == "gspo" else 0.6, empty_row=mode != "geo_mean")
  weights = np.random.default_rng(2).uniform(0.3, 2.0, size=logp.shape)
  seen_clip = []
  for agg in AGGS:
    for w in (None, weights):
      want, want_grad, want_m = theirs(mode, logp, old, adv, mask, agg, w, **KNOBS[variant])
      got, got_grad, got_m = ours(mode, logp, old, adv, mask, agg, w, **KNOBS[variant])
      where = f"{variant} {agg} weights={w is not None}"
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=where)
      np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-7, err_msg=where)
      for k, v in want_m.items():
        np.testing.assert_allclose(got_m[k], v, rtol=1e-5, atol=1e-7, err_msg=f"{where} {k}")
      seen_clip.append(want_m.get("pg_clipfrac", 0.5))
  if mode in ("vanilla", "gspo", "clip_cov", "geo_mean", "cispo", "dppo_tv", "dppo_kl"):
    assert 0 < seen_clip[0] < 1, (variant, seen_clip[0])   # Some tokens clipped (masked), some not.
  if KNOBS[variant].get("clip_ratio_c") and mode != "sapo":
    assert want_m["pg_clipfrac_lower"] > 0, variant          # The dual clip / truncation binds.


@pytest.mark.parametrize("variant", ["vanilla", "gspo", "sapo", "clip_cov", "kl_cov", "geo_mean", "dro", "cispo",
                                     "dppo_tv", "dppo_kl", "reinforce"])
def test_policy_losses_with_token_advantages_match_verl(variant):
  """One advantage per token (PPO's GAE, REINFORCE++), IS weights on, token_mean."""
  logp, old, _, mask = case(8, scale=1e-3 if variant == "gspo" else 0.6, empty_row=variant != "geo_mean")
  rng = np.random.default_rng(9)
  adv_BC = rng.normal(size=logp.shape)
  weights = rng.uniform(0.3, 2.0, size=logp.shape)
  want, want_grad, want_m = theirs(variant, logp, old, adv_BC, mask, "token_mean", weights, **KNOBS[variant])
  got, got_grad, got_m = ours(variant, logp, old, adv_BC, mask, "token_mean", weights, **KNOBS[variant])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-7)
  for k, v in want_m.items():
    np.testing.assert_allclose(got_m[k], v, rtol=1e-5, atol=1e-7, err_msg=k)


def test_clip_cov_cuts_the_largest_covariances_when_candidates_exceed_the_budget():
  """Ours is deterministic where verl picks at random: the budget goes to the largest covariances."""
  logp, old, adv, mask = case(1)
  kw = dict(eps_low=0.2, eps_high=0.28, clip_cov_lb=0.3, clip_cov_ub=1.5)
  m = mask.astype(float)
  A = np.broadcast_to(adv[:, None], logp.shape)
  cov = (A - (A * m).sum() / m.sum()) * (logp - (logp * m).sum() / m.sum())
  r = np.exp(logp - old)
  unclipped = ~(((A > 0) & (r > 1.28)) | ((A < 0) & (r < 0.8)))
  eligible = mask & unclipped & (cov > 0.3) & (cov < 1.5)
  assert eligible.sum() >= 3
  budget = 0.05   # floor(0.05 * tokens) = 2 < eligible
  n_cut = max(int(budget * m.sum()), 1)
  assert n_cut < eligible.sum()
  _, _, metrics = ours("clip_cov", logp, old, adv, mask, "token_mean", clip_cov_ratio=budget, **kw)
  assert metrics["pg_clipfrac"] == pytest.approx(n_cut / m.sum())
  with jax.enable_x64(True):
    grad = np.asarray(jax.grad(lambda lp: loss.policy_loss(lp, old, adv, mask, clip_cov_ratio=budget, mode="clip_cov",
                                                           **kw)[0])(jnp.asarray(logp)))
  largest = np.argsort(-np.where(eligible, cov, -np.inf), axis=None)[:n_cut]
  assert (grad.reshape(-1)[largest] == 0).all()


def test_dro_needs_a_positive_beta():
  logp, old, adv, mask = case(1)
  with pytest.raises(ValueError, match="dro_beta=None"):
    loss.policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2, mode="dro")


@pytest.mark.parametrize("agg", list(AGGS))
def test_aggregations_match_verl_agg_loss(agg):
  logp, _, _, mask = case(3)
  want = float(verl["agg_loss"](torch.tensor(logp), torch.tensor(mask.astype(float)), AGGS[agg],
                                loss_scale_factor=NORM_LEN if agg.endswith("norm") else None))
  with jax.enable_x64(True):
    got = float(loss.aggregate(jnp.asarray(logp), jnp.asarray(mask), agg, norm_len=NORM_LEN))
  assert got == pytest.approx(want, rel=1e-7)


@pytest.mark.parametrize("agg", list(AGGS))
def test_the_entropy_term_matches_verls_value_and_gradient(agg):
  """`dapo.entropy_coeff`'s term: verl's actor subtracts entropy_coeff x agg_loss(entropy_from_logits(logits),
  response_mask, loss_agg_mode); ours aggregates `loss.entropy` alike. Values and gradients in the
  logits against verl's in float64 (ours computes the entropy in float32, as the train step does:
  1e-6 relative on the value, 1e-5 on each gradient entry's scale)."""
  _, _, _, mask = case(5)
  logits = np.random.default_rng(6).normal(0, 2.0, size=(*mask.shape, 13))
  scale = NORM_LEN if agg.endswith("norm") else None
  x = torch.tensor(logits, requires_grad=True)
  want = verl["agg_loss"](verl_F.entropy_from_logits(x), torch.tensor(mask.astype(float)), AGGS[agg],
                          loss_scale_factor=scale)
  want.backward()
  term = lambda z: loss.aggregate(loss.entropy(z), jnp.asarray(mask), agg, norm_len=NORM_LEN)
  with jax.enable_x64(True):
    got, grad = jax.value_and_grad(term)(jnp.asarray(logits))
  assert float(got) == pytest.approx(float(want), rel=1e-6)
  np.testing.assert_allclose(np.asarray(grad), x.grad.numpy(), rtol=0, atol=1e-5 * np.abs(x.grad.numpy()).max())


# --- rollout correction -------------------------------------------------------------------------

CORRECTIONS = [
    dict(rollout_is="token", rollout_is_threshold=2.0),
    dict(rollout_is="token", rollout_is_threshold="0.5_1.8"),                 # IcePop
    dict(rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True),
    dict(rollout_is="sequence", rollout_is_threshold=3.0),
    dict(rollout_is="sequence", rollout_is_threshold="0.3_4.0", rollout_is_batch_normalize=True),
    dict(rollout_rs="token_k1", rollout_rs_threshold=1.8),
    dict(rollout_rs="token_k2,token_k3", rollout_rs_threshold="0.15,0.2"),
    dict(rollout_rs="seq_sum_k1", rollout_rs_threshold="0.4_3.0"),
    dict(rollout_rs="seq_sum_k2,seq_sum_k3", rollout_rs_threshold=0.5),
    dict(rollout_rs="seq_mean_k1,seq_mean_k2,seq_mean_k3", rollout_rs_threshold="1.3,0.05,0.06"),
    dict(rollout_rs="seq_max_k2,seq_max_k3", rollout_rs_threshold="0.3,0.4"),
    dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k3,token_k1",
         rollout_rs_threshold="0.05,2.0"),
    dict(),
]


@pytest.mark.parametrize("options", CORRECTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "off")
def test_rollout_correction_matches_verl(options):
  """Weights, keep mask and every metric verl reports, on rows that all have tokens."""
  _, _, _, mask = case(4, empty_row=False)
  rng = np.random.default_rng(5)
  rollout = -rng.uniform(0.02, 3.0, size=mask.shape)
  old = rollout + rng.normal(0.0, 0.5, size=mask.shape)
  t = lambda x: torch.tensor(np.asarray(x, np.float64))
  want_w, want_keep, want_m = verl_rc["compute_rollout_correction_and_rejection_mask"](
      t(old), t(rollout), t(mask), **options)
  with jax.enable_x64(True):
    got_w, got_keep, got_m = loss.rollout_correction(jnp.asarray(old), jnp.asarray(rollout), jnp.asarray(mask),
                                                     **options)
    got_m = {k: float(v) for k, v in got_m.items()}
  assert (want_w is None) == (got_w is None)
  if got_w is not None:
    np.testing.assert_allclose(np.asarray(got_w), want_w.batch["rollout_is_weights"].numpy(), rtol=1e-6, atol=1e-9)
  np.testing.assert_array_equal(np.asarray(got_keep), want_keep.numpy() > 0)
  assert sorted(got_m) == sorted(want_m)
  for k, v in want_m.items():
    np.testing.assert_allclose(got_m[k], v, rtol=1e-5, atol=1e-7, err_msg=k)
  if "rollout_rs" in options:   # Something is rejected, not everything.
    assert 0 < want_m["rollout_corr/rollout_rs_masked_fraction"] < 1
  if "rollout_is" in options:   # The truncation or the band binds.
    assert want_m["rollout_corr/rollout_is_ratio_fraction_high"] > 0


@pytest.mark.parametrize("bad,match", [(dict(rollout_is="seq"), "rollout_is='seq'"),
                                       (dict(rollout_is="token", rollout_is_threshold="2_1"), "rollout_is_threshold"),
                                       (dict(rollout_rs="token_k4", rollout_rs_threshold=1.0), "rollout_rs='token_k4'"),
                                       (dict(rollout_rs="token_k2"), "rollout_rs_threshold=None"),
                                       (dict(rollout_rs="token_k2", rollout_rs_threshold="0.1_2"), "k2 / k3")])
def test_rollout_correction_refuses_bad_options(bad, match):
  _, _, _, mask = case(4, empty_row=False)
  with pytest.raises(ValueError, match=match):
    loss.rollout_correction(np.zeros(mask.shape), np.zeros(mask.shape), mask, **bad)


# --- advantage estimators -------------------------------------------------------------------------

def outcome_case(seed: int, Q: int = 4, G: int = 5):
  """Scores with zeros (GPG counts them) and ties, lengths from 1 to C, a group of one separately."""
  rng = np.random.default_rng(seed)
  score_QG = rng.choice([0.0, 1.0, 0.5, -1.0], size=(Q, G))
  score_QG[0] = 0.0                       # a group with nothing to learn
  lengths_QG = rng.integers(1, C + 1, size=(Q, G))
  mask_BC = np.arange(C)[None, :] < lengths_QG.reshape(-1, 1)
  token_rewards_BC = np.zeros(mask_BC.shape)
  token_rewards_BC[np.arange(Q * G), lengths_QG.reshape(-1) - 1] = score_QG.reshape(-1)
  return score_QG, lengths_QG, mask_BC, token_rewards_BC


@pytest.mark.parametrize("estimator,fn", [
    ("grpo", "compute_grpo_outcome_advantage"), ("rloo", "compute_rloo_outcome_advantage"),
    ("reinforce_pp_baseline", "compute_reinforce_plus_plus_baseline_outcome_advantage"),
    ("opo", "compute_opo_outcome_advantage"), ("gpg", "compute_gpg_outcome_advantage")])
@pytest.mark.parametrize("G", [5, 1])
def test_sequence_estimators_match_verl(estimator, fn, G):
  score_QG, lengths_QG, mask_BC, token_rewards_BC = outcome_case(6, G=G)
  Q = score_QG.shape[0]
  index = np.repeat(np.arange(Q), G)
  want_BC, _ = verl[fn](token_level_rewards=torch.tensor(token_rewards_BC), response_mask=torch.tensor(
      mask_BC.astype(float)), index=index, config=AlgoConfig(norm_adv_by_std_in_grpo=True))
  got_QG = advantages.sequence_advantages(estimator, score_QG, lengths_QG=lengths_QG)
  np.testing.assert_allclose(np.broadcast_to(got_QG.reshape(-1, 1), mask_BC.shape) * mask_BC, want_BC.numpy(),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_passk_matches_verl(norm_by_std):
  """Only each group's best response moves (r_max - r_second_max); ties and an all-equal group give 0."""
  score_QG, lengths_QG, mask_BC, token_rewards_BC = outcome_case(6)
  Q, G = score_QG.shape
  want_BC, _ = verl["compute_grpo_passk_outcome_advantage"](
      token_level_rewards=torch.tensor(token_rewards_BC), response_mask=torch.tensor(mask_BC.astype(float)),
      index=np.repeat(np.arange(Q), G), config=AlgoConfig(norm_adv_by_std_in_grpo=norm_by_std))
  got_QG = advantages.sequence_advantages("grpo_passk", score_QG, norm_by_std)
  np.testing.assert_allclose(np.broadcast_to(got_QG.reshape(-1, 1), mask_BC.shape) * mask_BC, want_BC.numpy(),
                             rtol=1e-5, atol=1e-6)
  assert np.count_nonzero(got_QG) == sum(np.sort(r)[-1] != np.sort(r)[-2] for r in score_QG) > 0
  with pytest.raises(ValueError, match="at least 2 samples"):
    verl["compute_grpo_passk_outcome_advantage"](
        token_level_rewards=torch.tensor(token_rewards_BC[:1]), response_mask=torch.tensor(mask_BC[:1] * 1.0),
        index=np.arange(1), config=AlgoConfig(norm_adv_by_std_in_grpo=True))
  with pytest.raises(ValueError, match="grpo_passk"):
    advantages.sequence_advantages("grpo_passk", score_QG[:, :1])


@pytest.mark.parametrize("weights", [(), (1.0, 0.5, 2.0)])
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_gdpo_matches_verl(weights, norm_by_std):
  """Three components, one far larger than the others (which GDPO keeps from drowning them), ties in
  some groups, unequal lengths (the batch whitening weighs a response by its tokens)."""
  score_QG, lengths_QG, mask_BC, _ = outcome_case(7)
  Q, G = score_QG.shape
  rng = np.random.default_rng(8)
  parts_QGK = np.stack([score_QG, 50.0 * rng.choice([0.0, 1.0], size=(Q, G)), rng.normal(size=(Q, G))], -1)
  keys = ("accuracy", "format", "style")
  P = 3
  attention_BT = np.concatenate([np.ones((Q * G, P)), mask_BC], 1).astype(np.int64)
  want_BC, _ = verl["compute_gdpo_outcome_advantage"](
      token_level_rewards=torch.zeros(mask_BC.shape, dtype=torch.float64), response_mask=torch.tensor(mask_BC * 1.0),
      index=np.repeat(np.arange(Q), G), norm_adv_by_std_in_grpo=norm_by_std,
      config=AlgoConfig(gdpo_reward_keys=keys, gdpo_reward_weights=weights or None,
                        norm_adv_by_std_in_grpo=norm_by_std),
      non_tensor_batch={k: parts_QGK[..., i].reshape(-1) for i, k in enumerate(keys)},
      batch={"prompts": torch.zeros((Q * G, P)), "attention_mask": torch.tensor(attention_BT)})
  got_QG = advantages.sequence_advantages("gdpo", score_QG, norm_by_std, lengths_QG=lengths_QG, parts_QGK=parts_QGK,
                                          part_weights=weights)
  np.testing.assert_allclose(np.broadcast_to(got_QG.reshape(-1, 1), mask_BC.shape) * mask_BC, want_BC.numpy(),
                             rtol=1e-5, atol=1e-5)
  grpo_sum = sum(w * advantages.group_advantages(parts_QGK[..., k], norm_by_std)
                 for k, w in enumerate(weights or (1.0,) * 3))
  assert not np.allclose(got_QG, grpo_sum, atol=1e-3)  # The batch whitening moved them.


def test_gdpo_without_components_whitens_the_grpo_advantage_of_the_reward_as_verl():
  score_QG, lengths_QG, mask_BC, token_rewards_BC = outcome_case(9)
  Q, G = score_QG.shape
  want_BC, _ = verl["compute_gdpo_outcome_advantage"](
      token_level_rewards=torch.tensor(token_rewards_BC), response_mask=torch.tensor(mask_BC * 1.0),
      index=np.repeat(np.arange(Q), G))
  got_QG = advantages.sequence_advantages("gdpo", score_QG, lengths_QG=lengths_QG)
  np.testing.assert_allclose(np.broadcast_to(got_QG.reshape(-1, 1), mask_BC.shape) * mask_BC, want_BC.numpy(),
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="2 weights for 1 components"):
    advantages.sequence_advantages("gdpo", score_QG, lengths_QG=lengths_QG, part_weights=(1.0, 2.0))


@pytest.mark.parametrize("G", [4, 1])
@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("is_weights", [False, True])
def test_optimal_token_baseline_matches_verl(G, zero_tail, is_weights):
  """Groups with one longest row (its tail gets no baseline), with a tie for the longest, a masked span
  mid-row, rewards on several tokens; and groups of one (no baseline); with rollout importance weights."""
  rng = np.random.default_rng(11)
  Q = 3 if G > 1 else 6
  lengths_B = rng.integers(1, C + 1, size=Q * G)
  if G > 1:
    lengths_B[:G] = [C, 5, 3, 5]       # one longest
    lengths_B[G:2 * G] = [7, 7, 2, 4]  # a tie
  mask_BC = np.arange(C)[None, :] < lengths_B[:, None]
  mask_BC[-1, 1:3] &= False            # a masked span (a tool's reply)
  rewards_BC = np.where(rng.random((Q * G, C)) < 0.2, rng.normal(size=(Q * G, C)), 0.0)
  rewards_BC[np.arange(Q * G), lengths_B - 1] += rng.choice([-1.0, 1.0], size=Q * G)
  logp_BC = np.log(rng.uniform(0.05, 1.0, size=(Q * G, C)))
  sum_pi_sq_BC = rng.uniform(0.05, 1.0, size=(Q * G, C))
  w_BC = np.where(rng.random((Q * G, C)) < 0.2, 0.0, rng.uniform(0.5, 2.0, size=(Q * G, C))) if is_weights else None
  want_adv, want_ret = verl["compute_optimal_token_baseline_advantage"](
      token_level_rewards=torch.tensor(rewards_BC), response_mask=torch.tensor(mask_BC * 1.0),
      index=np.repeat(np.arange(Q), G), old_log_probs=torch.tensor(logp_BC), sum_pi_squared=torch.tensor(sum_pi_sq_BC),
      rollout_is_weights=None if w_BC is None else torch.tensor(w_BC), handle_zero_tail=zero_tail)
  got_adv, got_ret = advantages.optimal_token_baseline(rewards_BC, mask_BC, logp_BC, sum_pi_sq_BC, G, zero_tail,
                                                       is_weights_BC=w_BC)
  np.testing.assert_allclose(np.asarray(got_adv), want_adv.numpy(), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got_ret), want_ret.numpy(), rtol=1e-5, atol=1e-5)
  if G > 1 and zero_tail:  # The longest row's advantage past the second-longest is its return.
    np.testing.assert_allclose(np.asarray(got_adv)[0, 5:], want_ret.numpy()[0, 5:], rtol=1e-5)


def test_reinforce_pp_carries_returns_across_masked_spans_as_verl():
  """Rewards on several tokens, γ < 1 and masked spans mid-row (tool replies): verl #7278."""
  rng = np.random.default_rng(7)
  mask_BC = np.arange(C)[None, :] < np.array([9, 8, 5, 9])[:, None]
  mask_BC[0, 2:4] = mask_BC[1, 5:7] = mask_BC[3, 1:6] = False
  rewards_BC = rng.normal(size=mask_BC.shape) * mask_BC
  rewards_BC[3, 3] = 0.0
  want_adv, want_ret = verl["compute_reinforce_plus_plus_outcome_advantage"](
      torch.tensor(rewards_BC), torch.tensor(mask_BC.astype(float)), config=AlgoConfig(gamma=0.9))
  got_adv, got_ret = advantages.reinforce_pp(rewards_BC, mask_BC, 0.9)
  np.testing.assert_allclose(np.asarray(got_ret), want_ret.numpy(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got_adv), want_adv.numpy(), rtol=1e-5, atol=1e-5)
  assert np.asarray(got_ret)[3, 0] != 0   # The return reached the token before the masked span.


def test_gae_matches_verl():
  rng = np.random.default_rng(10)
  mask_BC = np.arange(C)[None, :] < np.array([9, 6, 3, 8])[:, None]
  mask_BC[0, 4:6] = False
  rewards_BC, values_BC = rng.normal(size=mask_BC.shape) * mask_BC, rng.normal(size=mask_BC.shape)
  want_adv, want_ret = verl["compute_gae_advantage_return"](torch.tensor(rewards_BC), torch.tensor(values_BC),
                                                            torch.tensor(mask_BC.astype(float)), 0.95, 0.9)
  got_adv, got_ret = advantages.gae(rewards_BC, values_BC, mask_BC, 0.95, 0.9)
  np.testing.assert_allclose(np.asarray(got_ret), want_ret.numpy(), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got_adv), want_adv.numpy() * mask_BC, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_penalty_matches_verl(estimator):
  rng = np.random.default_rng(11)
  logp, ref = -rng.uniform(0.1, 3, size=(B, C)), -rng.uniform(0.1, 3, size=(B, C))
  ref[0, 0] = logp[0, 0] + 25.0   # beyond verl's ±20 clamp of k3
  want = verl["kl_penalty_forward"](torch.tensor(logp), torch.tensor(ref), estimator).numpy()
  with jax.enable_x64(True):
    got = np.asarray(loss.kl_penalty(jnp.asarray(logp), jnp.asarray(ref), estimator))
  np.testing.assert_allclose(got, want, rtol=1e-7)
