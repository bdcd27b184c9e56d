"""DPO on preference pairs against a frozen reference (the starting policy).

    params, ev = dpo.train(dpo.DPOTrainConfig(beta=0.1), model_cfg, params, tok, pairs, held, mesh, workdir,
                           evaluator=...)

The reference log-probs of every pair are computed once, before training, by a frozen copy of the
starting params (`Trainer.reference_params`: a copy, or with LoRA the base with the adapters
off; `Trainer.forward`), and travel in the batch
(`PreferenceBatch.ref_logp_B`); the reference copy is then freed. Logged: the DPO loss, the implicit
rewards β·(log π - log π_ref) of chosen and rejected responses, their accuracy and margin (train and
held-out pairs), and, with an `evaluate.Evaluator`, the rule-checked accuracy of the policy's own
answers to held-out prompts, before and after.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from dapo_jax import evaluate as evaluate_lib
from dapo_jax import optim, rlhf_objectives, train_step
from dapo_jax.model import lora as lora_lib
from dapo_jax.model import transformer as model_lib
from dapo_jax.pipelines import fit, pairs


@dataclasses.dataclass(frozen=True)
class DPOTrainConfig(pairs.PairTrainConfig):
  beta: float = 0.1              # β of the implicit reward
  loss_type: str = "sigmoid"     # sigmoid (DPO) | ipo
  label_smoothing: float = 0.0   # conservative DPO's ε (sigmoid only)
  rpo_alpha: float = 0.0         # RPO: + α · NLL of the chosen responses (0 = plain DPO)

  def __post_init__(self):
    from dapo_jax import loss as loss_lib
    if self.loss_type not in loss_lib.DPO_LOSS_TYPES:
      raise ValueError(f"dpo.loss_type={self.loss_type!r}; expected one of {loss_lib.DPO_LOSS_TYPES}")
    if self.beta <= 0:
      raise ValueError(f"dpo.beta={self.beta}; expected > 0")
    if self.rpo_alpha < 0:
      raise ValueError(f"dpo.rpo_alpha={self.rpo_alpha}; expected >= 0")


def train(c: DPOTrainConfig, model_cfg: model_lib.ModelConfig, params, tok, train_pairs, eval_pairs, mesh,
          workdir: str, evaluator: evaluate_lib.Evaluator | None = None,
          lora: lora_lib.LoraConfig | None = None) -> tuple[object, dict]:
  """DPO from `params` (also the reference); returns (params, the last held-out metrics). With
  `lora`, adapters train on the frozen `params` and the reference is that base with them off."""
  opt = optim.OptimConfig(lr=c.lr, warmup_steps=c.warmup_steps, weight_decay=c.weight_decay, grad_clip=c.grad_clip)
  dcfg = rlhf_objectives.DPOConfig(beta=c.beta, loss_type=c.loss_type, label_smoothing=c.label_smoothing,
                              rpo_alpha=c.rpo_alpha)
  trainer = train_step.Trainer(model_cfg, opt, mesh, rlhf_objectives.dpo(model_cfg, dcfg), num_microbatches=0,
                               microbatch_tokens=c.microbatch_tokens, lora=lora, seed=c.seed)
  logprobs = trainer.forward(rlhf_objectives.response_logprobs(model_cfg))
  params = trainer.place(params)
  ref = trainer.reference_params(params)
  data = pairs.pair_rows(tok, train_pairs, c)
  data = data.replace(ref_logp_B=pairs.chunked(logprobs, trainer, ref, data, c.batch_pairs).astype(np.float32))
  held = None
  if eval_pairs:
    held = pairs.pair_rows(tok, eval_pairs, c)
    held = held.replace(ref_logp_B=pairs.chunked(logprobs, trainer, ref, held, c.batch_pairs).astype(np.float32))
  del ref  # Every reference log-prob is computed: free its memory.

  def evaluate(p) -> dict:
    out = {}
    if held is not None:
      logp = pairs.chunked(logprobs, trainer, p, held, c.batch_pairs)
      r = c.beta * (logp - held.ref_logp_B)
      out.update({"val/dpo/rewards/accuracies": float(np.mean(r[0::2] > r[1::2])),
                  "val/dpo/rewards/margins": float(np.mean(r[0::2] - r[1::2])),
                  "val/dpo/rewards/chosen": float(np.mean(r[0::2])),
                  "val/dpo/rewards/rejected": float(np.mean(r[1::2]))})
    if evaluator is not None:
      out.update(evaluator.run(p))
    return out

  state = trainer.init(params=params)
  return fit.fit(c.fit_config(), trainer, state, pairs.batches(data, c), workdir, evaluate=evaluate, label="dpo",
                 prefix="dpo", console_keys={"loss": "loss", "rewards/accuracies": "acc", "rewards/margins": "margin"})
