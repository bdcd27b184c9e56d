"""Bitwise fingerprint of a small run: init params, logits, sampler tokens, two DAPO steps, a short
SFT. Run it before and after a refactor and compare the two files:

  python docs/scripts/equivalence.py /tmp/before.npz
  python docs/scripts/equivalence.py /tmp/after.npz --compare=/tmp/before.npz
"""
import argparse
import hashlib
import os
import tempfile

import jax
import numpy as np

from configs import default
from dapo_jax import builders, sharding


def digest(tree) -> dict:
  leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(tree))
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


def tiny_rl_config(**overrides):
  cfg = default.get_config()
  cfg.model.init = "random"
  cfg.dapo.update(prompts_per_step=4, gen_prompts=6, max_gen_batches=2)
  cfg.rollout.update(group_size=4, max_new_tokens=16)
  cfg.train.update(num_steps=2, ckpt_every=0, eval_every=0, log_samples_every=0)
  cfg.data.num_eval = 8
  cfg.reward.fn = "dapo_jax.testing:length_reward"  # mixed groups from a random policy: real updates
  for k, v in overrides.items():
    group, field = k.split("__")
    cfg[group][field] = v
  return cfg


def two_steps(workdir: str, name: str, **overrides) -> dict:
  """Two DAPO steps of a variant (the reference's static path, PPO): the trained params and losses."""
  out = {}
  with builders.dapo(tiny_rl_config(**overrides), workdir) as run:
    for step in range(2):
      m, _ = run.step(step)
      out[f"{name}_step{step}_loss"] = np.float64(m.get("actor/pg_loss", np.nan))
      if "critic/vf_loss" in m:
        out[f"{name}_step{step}_vf_loss"] = np.float64(m["critic/vf_loss"])
    out.update({name + k: v for k, v in digest(run.state.params).items()})
  return out


def fingerprint(workdir: str) -> dict:
  cfg = tiny_rl_config()
  out = {}
  mesh = sharding.make_mesh(cfg.mesh)
  with builders.dapo(cfg, workdir, mesh) as run:
    out.update({"init" + k: v for k, v in digest(run.state.params).items()})
    tokens, mask = run.rollout.encode(["What is 12 + 30?", "What is 7 + 5?"])
    from dapo_jax import model as model_lib
    out["logits"] = np.asarray(model_lib.logits(run.rollout.model_cfg, run.state.params, tokens, mask))
    samples = run.rollout.generate(run.rollout.sampling_params(run.state.params), ["What is 12 + 30?"], 4,
                                   jax.random.key(3))
    out["sampler_tokens"] = np.asarray(samples.tokens_BC)
    out["sampler_logp"] = np.asarray(samples.logp_BC)
    for step in range(2):
      m, _ = run.step(step)
      out[f"step{step}_loss"] = np.float64(m.get("actor/pg_loss", np.nan))
    out.update({"trained" + k: v for k, v in digest(run.state.params).items()})
  return out


def sft_fingerprint(workdir: str) -> dict:
  cfg = default.get_config()
  cfg.sft.update(steps=6, probe_every=3, num_examples=512, batch_size=8, seq_len=64)
  train, _ = builders.datasets(cfg)
  tok = builders.tokenizer(cfg, workdir, train)
  model_cfg = builders.model_config(cfg, ((len(tok) + 63) // 64) * 64)
  try:
    from dapo_jax.pipelines import sft
  except ImportError:
    from dapo_jax import sft
  mesh = sharding.make_mesh(cfg.mesh)
  try:
    params = sft.run(builders.sft_config(cfg), model_cfg, tok, train, mesh, os.path.join(workdir, "run"))
  except TypeError:  # Before the shared supervised loop.
    params = sft.run(builders.sft_config(cfg), model_cfg, tok, train, mesh)
  return {"sft" + k: v for k, v in digest(params).items()}


if __name__ == "__main__":
  ap = argparse.ArgumentParser()
  ap.add_argument("out")
  ap.add_argument("--compare", default="")
  a = ap.parse_args()
  with tempfile.TemporaryDirectory() as d:
    fp = {}
    fp.update(fingerprint(os.path.join(d, "rl")))
    fp.update(two_steps(os.path.join(d, "static"), "static", rollout__engine="static", dapo__streaming=False,
                        train__length_buckets=0))
    fp.update(two_steps(os.path.join(d, "ppo"), "ppo", dapo__adv_estimator="gae", ppo__kl_coef=0.05,
                        dapo__streaming=False))
    fp.update(sft_fingerprint(os.path.join(d, "sft")))
  np.savez(a.out, **fp)
  print(f"{len(fp)} arrays, sha256 {hashlib.sha256(b''.join(np.ascontiguousarray(v).tobytes() for v in fp.values())).hexdigest()[:16]}")
  if a.compare:
    ref = dict(np.load(a.compare))
    assert sorted(ref) == sorted(fp), set(ref) ^ set(fp)
    bad = [k for k in ref if not np.array_equal(ref[k], fp[k], equal_nan=True)]
    print("bitwise equal" if not bad else f"DIFFER: {bad[:10]}")
