"""How far SmolLM2-135M's int8 base (`model.base_quant=int8`) is from the fp32 model, on the
held-out problems of configs/smollm2_135m_arith.py: each model's greedy answers are scored, and
the fp32 model's greedy completions are scored token by token under both (teacher forcing).
Run from the repository root (about a minute on 2 CPU cores):

  python docs/scripts/int8_error.py
"""
import os
import sys

sys.path.insert(0, os.getcwd())


def main():
  import jax
  import jax.numpy as jnp
  import numpy as np

  from configs import smollm2_135m_arith as C
  from dapo_jax import builders, rewards
  from dapo_jax.data import tokenizer as tok_lib
  from dapo_jax.hf import convert as hf
  from dapo_jax.model import quant
  from dapo_jax.model import transformer as model
  from dapo_jax.rollout import sampling
  cfg = C.get_config()
  workdir = "/tmp/int8_error"
  tok = builders.tokenizer(cfg, workdir)
  model_dir = builders.gguf_model_dir(cfg, workdir)
  mc, fp32 = hf.load(model_dir, **builders.runtime_overrides(cfg))
  int8 = quant.quantize_base(fp32)
  _, heldout = builders.datasets(cfg)
  texts = [tok_lib.render(tok, ex.messages) for ex in heldout]
  P = max(len(tok(t)["input_ids"]) for t in texts)
  prompt, pmask = tok_lib.encode_left_padded(tok, texts, P)
  sc = builders.sampler_config(cfg, tok, model_dir)
  greedy = sampling.SamplerConfig(**{**sc.__dict__, "temperature": 0.0})
  outs = {name: sampling.generate(mc, greedy, p, prompt, pmask, jax.random.key(0))
          for name, p in (("fp32", fp32), ("int8", int8))}
  for name, out in outs.items():
    answers = tok_lib.decode(tok, np.asarray(out.tokens_BC), np.asarray(out.mask_BC))
    acc = np.mean([rewards.math_dapo(a, ex.ground_truth)["acc"] for a, ex in zip(answers, heldout)])
    print(f"{name}: greedy held-out accuracy {acc:.1%}")
  comp, cmask = np.asarray(outs["fp32"].tokens_BC), np.asarray(outs["fp32"].mask_BC)
  tokens = jnp.concatenate([prompt, comp], 1)
  mask = jnp.concatenate([pmask, cmask], 1)
  logp = {}
  for name, p in (("fp32", fp32), ("int8", int8)):
    z = model.logits(mc, p, tokens[:, :-1], mask[:, :-1], logits_from=P - 1)
    logp[name] = np.asarray(jax.nn.log_softmax(z, -1))
  picked = {n: np.take_along_axis(lp, comp[..., None], -1)[..., 0] for n, lp in logp.items()}
  d = np.abs(picked["int8"] - picked["fp32"])[cmask]
  kl = np.sum(np.exp(logp["fp32"]) * (logp["fp32"] - logp["int8"]), -1)[cmask]
  top1 = (np.argmax(logp["int8"], -1) == np.argmax(logp["fp32"], -1))[cmask]
  print(f"{cmask.sum()} completion tokens of the fp32 model's greedy answers: |log p int8 - log p fp32| "
        f"mean {d.mean():.4f}, median {np.median(d):.4f}, max {d.max():.3f}; KL(fp32 || int8) mean {kl.mean():.4f} "
        f"nats; same top-1 token {top1.mean():.1%}")


if __name__ == "__main__":
  main()
