"""On-policy distillation (`dapo.adv_estimator="distill"`): a teacher loaded from an HF directory
scores the policy's own samples; the per-token advantage is log π_teacher - log π, checked against
both models' teacher-forced logits; a run with it trains; a teacher of another vocabulary or
tokenizer is refused at start, naming both."""
import dataclasses
import json

import jax
import numpy as np
import pytest

from configs import dapo_qwen2_5_32b
from dapo_jax import advantages as adv_lib
from dapo_jax import builders, objectives, ppo, sharding, testing, train_step
from dapo_jax import optim as optim_lib
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.datatypes import Groups
from dapo_jax.hf import convert as hf
from dapo_jax.model import transformer as model_lib


def log_softmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_tokenizer_dir):
  """A student (the tiny config) and a wider teacher of the same tokenizer, saved as an HF dir."""
  tok = tokenizer_lib.load(tiny_tokenizer_dir)
  V = ((len(tok) + 63) // 64) * 64
  student_cfg = testing.tiny_model_config(vocab_size=V)
  teacher_cfg = testing.tiny_model_config(vocab_size=V, embed_dim=48, mlp_dim=96, num_layers=3)
  path = str(tmp_path_factory.mktemp("teacher"))
  teacher_params = testing.sharp_params(teacher_cfg, seed=5, scale=2.0)
  hf.save(path, teacher_cfg, jax.device_get(teacher_params), tokenizer=tok)
  cfg = dapo_qwen2_5_32b.get_config("runlocal")
  cfg.dapo.adv_estimator, cfg.dapo.teacher_dir = "distill", path
  return tok, student_cfg, teacher_cfg, teacher_params, path, cfg


def test_the_per_token_advantage_is_the_teachers_minus_the_students_log_prob(setup):
  tok, student_cfg, teacher_cfg, teacher_params, path, cfg = setup
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  pg = objectives.PGConfig(group_size=2, temperature=1.0)
  teacher = builders.teacher(cfg, student_cfg, tok, mesh, pg)
  trainer = train_step.Trainer(student_cfg, optim_lib.OptimConfig(lr=1e-3), mesh,
                               objectives.policy_gradient(student_cfg, pg))
  params = trainer.init(jax.random.key(0)).params
  logprobs = trainer.forward(objectives.completion_logprobs(student_cfg, 1.0, 2))
  rng = np.random.default_rng(0)
  Q, G, P, C = 2, 2, 5, 6
  prompt = rng.integers(4, 200, size=(Q, P)).astype(np.int32)
  lengths = np.array([[6, 3], [1, 4]])
  mask = np.arange(C)[None, None] < lengths[..., None]
  groups = Groups(prompt_QP=prompt, prompt_mask_QP=np.ones((Q, P), bool),
                  tokens_QGC=rng.integers(4, 200, size=(Q, G, C)).astype(np.int32), mask_QGC=mask,
                  length_QG=lengths, truncated_QG=np.zeros((Q, G), bool),
                  score_QG=np.array([[1.0, -1.0], [1.0, 1.0]]), acc_QG=np.ones((Q, G), bool),
                  filter_QG=np.ones((Q, G)), logp_QGC=np.zeros((Q, G, C), np.float32), carried_Q=np.zeros(Q, bool))
  batch, _ = adv_lib.to_train_batch(groups, Q, P, norm_adv_by_std=True, overlong_filter=False, estimator="distill")
  out, _, metrics = ppo.token_advantages(batch, groups, estimator="distill", logprobs=logprobs, trainer=trainer,
                                   params=params, ref_params=None, critic=None, kl_ctrl=None, Q=Q, G=G, gamma=1.0,
                                   lam=1.0, teacher=teacher)
  tokens, tmask = np.asarray(batch.tokens_BT), np.asarray(batch.mask_BT)
  picked = lambda cfg_, p: np.take_along_axis(log_softmax(np.asarray(model_lib.logits(cfg_, p, tokens, tmask),
                                                                       np.float64))[:, P - 1:-1],
                                              tokens[:, P:, None], -1)[..., 0]
  want = (picked(teacher_cfg, teacher_params) - picked(student_cfg, params)) * batch.loss_mask_BC
  np.testing.assert_allclose(out.adv_BC, want, atol=2e-5)
  assert (out.adv_BC[~batch.loss_mask_BC] == 0).all() and np.abs(want).max() > 0.1
  # Logged: what distillation minimises, the per-token reverse KL (k1) to the teacher.
  assert metrics["distill/reverse_kl"] == pytest.approx(-want.sum() / batch.loss_mask_BC.sum(), abs=1e-5)


def test_a_run_with_a_teacher_trains(setup, tmp_path, tiny_tokenizer_dir):
  *_, cfg = setup
  cfg = cfg.copy_and_resolve_references()
  cfg.tokenizer.path = tiny_tokenizer_dir  # The teacher's tokenizer.
  cfg.train.num_steps = 2
  cfg.dapo.dynamic_sampling = False
  with builders.dapo(cfg, str(tmp_path / "run")) as run:
    assert run.teacher is not None
    assert run.ref_params is None  # The teacher's log-probs are the advantage: no reference model to hold.
    run.run()
  rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  losses = [r["actor/pg_loss"] for r in rows if "actor/pg_loss" in r]
  assert losses and all(np.isfinite(losses))
  assert all(np.isfinite(r["distill/reverse_kl"]) for r in rows if "actor/pg_loss" in r)


def test_a_teacher_of_another_vocabulary_or_tokenizer_is_refused_naming_both(setup, tmp_path):
  tok, student_cfg, teacher_cfg, teacher_params, path, cfg = setup
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  other = dataclasses.replace(student_cfg, vocab_size=student_cfg.vocab_size + 64)
  with pytest.raises(ValueError, match=f"{path}.*vocabulary of {student_cfg.vocab_size}"):
    builders.teacher(cfg, other, tok, mesh, objectives.PGConfig())
  other_tok = testing.build_tokenizer(str(tmp_path / "tok"), vocab_size=260)
  with pytest.raises(builders.ConfigError, match="tokenizer is not the policy's"):
    builders.teacher(cfg, student_cfg, other_tok, mesh, objectives.PGConfig())


def test_a_packed_run_with_a_teacher_is_the_padded_run(setup, tmp_path, tiny_tokenizer_dir):
  """`train.packing=True`: the student's and the teacher's log-prob passes (the advantage) and the update
  run on packed rows; every logged value of two steps, and the params, are the padded run's (1e-5)."""
  *_, cfg = setup
  runs = {}
  for packing in (False, True):
    c = cfg.copy_and_resolve_references()
    c.tokenizer.path = tiny_tokenizer_dir
    c.train.update(num_steps=2, packing=packing, num_microbatches=0, eval_every=0)
    c.dapo.dynamic_sampling = False
    with builders.dapo(c, str(tmp_path / str(packing))) as run:
      run.run()
      runs[packing] = [json.loads(line) for line in open(tmp_path / str(packing) / "metrics.jsonl")], \
          jax.device_get(run.state.params)
  untimed = lambda row: {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/", "time"))}
  assert sum("distill/reverse_kl" in row for row in runs[False][0]) == 2
  for padded, packed in zip(*(runs[p][0] for p in (False, True))):
    padded, packed = untimed(padded), untimed(packed)
    assert padded.keys() == packed.keys()
    for k in padded:
      assert packed[k] == pytest.approx(padded[k], rel=1e-5, abs=1e-6), k
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), runs[True][1], runs[False][1])
