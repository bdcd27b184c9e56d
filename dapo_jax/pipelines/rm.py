"""The reward model: training on preference pairs (scoring lives in `rewards.model`).

    params, ev = rm.train(rm.RMConfig(steps=300), model_cfg, rm.from_lm(lm_params), tok, pairs, held, mesh, workdir)

The model is the policy's trunk with a scalar head (`model.Transformer(head="scalar")`, param
`score_D`) read at the last real token of prompt + response + EOS, trained with the pairwise loss
-log σ(r(x, y_c) - r(x, y_r)) (`rlhf_objectives.reward_model`) through `fit.fit`: resumable, logged
under rm/ and val/rm/.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from dapo_jax import optim, rlhf_objectives, train_step
from dapo_jax.model import lora as lora_lib
from dapo_jax.model import transformer as model_lib
from dapo_jax.pipelines import fit, pairs


@dataclasses.dataclass(frozen=True)
class RMConfig(pairs.PairTrainConfig):
  margin: float = 0.0            # m in -log σ(r_c - r_r - m)


def from_lm(params: dict) -> dict:
  """Reward-model params from a language model's: the same trunk, no unembedding, a zero score head
  (every response starts at score 0, as TRL's RewardTrainer initialises its head near zero)."""
  out = {k: v for k, v in params.items() if k != "unembed_DV"}
  out["score_D"] = np.zeros(np.shape(params["embed_VD"])[1], np.asarray(params["embed_VD"]).dtype)
  return out


def pairwise_metrics(diff_N: np.ndarray, errors: Sequence[str | None] = ()) -> dict:
  """accuracy, margin and loss of the score differences r(chosen) - r(rejected) of N pairs, and
  accuracy/<kind> over the pairs whose rejected answer names its kind of mistake (`errors`)."""
  diff_N = np.asarray(diff_N, np.float64)
  out = {"accuracy": float(np.mean(diff_N > 0)), "margin": float(np.mean(diff_N)),
         "loss": float(np.mean(np.logaddexp(0.0, -diff_N)))}
  errors = np.asarray(list(errors) or [None] * len(diff_N), dtype=object)
  for kind in sorted({e for e in errors if e is not None}):
    out[f"accuracy/{kind}"] = float(np.mean(diff_N[errors == kind] > 0))
  return out


def train(c: RMConfig, model_cfg: model_lib.ModelConfig, params, tok, train_pairs, eval_pairs, mesh,
          workdir: str, lora: lora_lib.LoraConfig | None = None) -> tuple[object, dict]:
  """Trains the reward model; returns (params, held-out metrics: val/rm/accuracy, margin, loss, and
  val/rm/accuracy/<kind> for held-out rows with an `error` field). With `lora`, adapters and the
  score head train on the frozen trunk of `params`."""
  opt = optim.OptimConfig(lr=c.lr, warmup_steps=c.warmup_steps, weight_decay=c.weight_decay, grad_clip=c.grad_clip)
  trainer = train_step.Trainer(model_cfg, opt, mesh, rlhf_objectives.reward_model(model_cfg, c.margin),
                               num_microbatches=0, microbatch_tokens=c.microbatch_tokens, head="scalar", lora=lora,
                               seed=c.seed)
  score = trainer.forward(rlhf_objectives.reward_scores(model_cfg))
  data = pairs.pair_rows(tok, train_pairs, c)
  held = pairs.pair_rows(tok, eval_pairs, c) if eval_pairs else None
  errors = [p.error for p in eval_pairs or ()]

  def evaluate(p) -> dict:
    if held is None:
      return {}
    r = pairs.chunked(score, trainer, p, held, c.batch_pairs)
    return {f"val/rm/{k}": v for k, v in pairwise_metrics(r[0::2] - r[1::2], errors).items()}

  state = trainer.init(params=params)
  return fit.fit(c.fit_config(), trainer, state, pairs.batches(data, c), workdir, evaluate=evaluate, label="RM",
                 prefix="rm", console_keys={"loss": "loss", "accuracy": "acc", "margin": "margin"})
