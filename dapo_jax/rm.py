"""The reward model: training on preference pairs, export, and scoring (for the RM server and `rm:DIR`).

    params = rm.train(rm.RMConfig(steps=300), model_cfg, rm.from_lm(lm_params), tok, pairs, held, mesh, workdir)
    score_fn = rm.scorer("runs/rm/rm_model")        # score_fn(prompts, responses) -> [float]

The model is the policy's trunk with a scalar head (`model.Transformer(head="scalar")`, param
`score_D`) read at the last real token of prompt + response + EOS, trained with the pairwise loss
-log σ(r(x, y_c) - r(x, y_r)) (`objectives.reward_model`). `fit_pairs` is the loop shared with DPO:
pairs drawn per step from a seeded generator (so a resumed run draws the same ones), metrics to
TensorBoard and metrics.jsonl, orbax checkpoints that a rerun resumes from.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dapo_jax import checkpoint as ckpt_lib
from dapo_jax import hf, metrics, objectives, optim, preference, train_step
from dapo_jax import lora as lora_lib
from dapo_jax import model as model_lib
from dapo_jax import tokenizer as tokenizer_lib
from dapo_jax.datatypes import PreferenceBatch


@dataclasses.dataclass(frozen=True)
class PairTrainConfig:
  """The optimisation of a preference-pair objective (reward model or DPO)."""
  steps: int = 300
  batch_pairs: int = 32          # pairs per update
  lr: float = 1e-4
  warmup_steps: int = 10         # updates of linear warm-up
  weight_decay: float = 0.0
  grad_clip: float = 1.0
  prompt_len: int = 64           # tokens; longer prompts keep their end
  response_len: int = 64         # tokens including EOS; longer responses keep their start
  chat_template: bool = True
  eval_every: int = 50           # updates between held-out evaluations (0 = at the end only)
  ckpt_every: int = 100          # updates between checkpoints (0 = at the end only)
  keep_ckpts: int = 2
  microbatch_tokens: int = 2048  # automatic micro-batches of at most this many tokens
  seed: int = 0


@dataclasses.dataclass(frozen=True)
class RMConfig(PairTrainConfig):
  margin: float = 0.0            # m in -log σ(r_c - r_r - m)


def from_lm(params: dict) -> dict:
  """Reward-model params from a language model's: the same trunk, no unembedding, a zero score head
  (every response starts at score 0, as TRL's RewardTrainer initialises its head near zero)."""
  out = {k: v for k, v in params.items() if k != "unembed_DV"}
  out["score_D"] = np.zeros(np.shape(params["embed_VD"])[1], np.asarray(params["embed_VD"]).dtype)
  return out


def pair_rows(tok, pairs: Sequence[preference.PreferencePair], c: PairTrainConfig) -> PreferenceBatch:
  """Host `PreferenceBatch` of every pair (rows 2i chosen, 2i+1 rejected)."""
  pb = preference.pair_batch(tok, pairs, c.prompt_len, c.response_len, c.chat_template)
  return PreferenceBatch.from_pairs(pb.tokens_BT, pb.mask_BT, pb.response_mask_BC)


def take_pairs(batch: PreferenceBatch, idx: np.ndarray) -> PreferenceBatch:
  rows = np.stack([2 * idx, 2 * idx + 1], axis=1).reshape(-1)
  return jax.tree.map(lambda x: np.asarray(x)[rows], batch)


def pad_pairs(batch: PreferenceBatch, multiple: int) -> tuple[PreferenceBatch, int]:
  """Pads with copies of the last pair to a multiple of `multiple` pairs; returns (batch, real pairs)."""
  n = batch.tokens_BT.shape[0] // 2
  extra = -n % multiple
  idx = np.concatenate([np.arange(n), np.full(extra, n - 1)]).astype(int)
  return take_pairs(batch, idx), n


def chunked(fn: Callable, trainer: train_step.Trainer, params, batch: PreferenceBatch, pairs_per_call: int) -> np.ndarray:
  """`fn(params, batch) -> [B]` (a `Trainer.forward`) over every row of a host batch, in fixed-size calls."""
  padded, n = pad_pairs(batch, pairs_per_call)
  out = []
  for i in range(0, padded.tokens_BT.shape[0] // 2, pairs_per_call):
    part = take_pairs(padded, np.arange(i, i + pairs_per_call))
    out.append(np.asarray(jax.device_get(fn(params, trainer.put_batch(part)))))
  return np.concatenate(out)[: 2 * n]


def fit_pairs(c: PairTrainConfig, trainer: train_step.Trainer, params, data: PreferenceBatch, workdir: str,
              evaluate: Callable[[object], dict], prefix: str, console_keys: dict) -> tuple[object, dict]:
  """Trains `trainer`'s objective on random batches of `data`'s pairs for `c.steps` updates, resuming
  from WORKDIR/checkpoints; `evaluate(params) -> metrics` runs every `eval_every` and at the end.
  Returns (params, the last evaluation)."""
  writer = metrics.MetricWriter(workdir, enabled=jax.process_index() == 0)
  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), keep=c.keep_ckpts)
  num_pairs = data.tokens_BT.shape[0] // 2
  if num_pairs < c.batch_pairs:
    raise ValueError(f"{num_pairs} training pairs, fewer than batch_pairs={c.batch_pairs}")
  try:
    state = trainer.init(params=params)
    start = 0
    restored = ckpt.restore_latest(ckpt_lib.abstract(state, trainer.state_sharding))
    if restored is not None:
      start, state, _ = restored
      print(f"Resumed from {ckpt.directory} at update {start}.", flush=True)
    last_eval: dict = {}
    if start == 0:
      last_eval = evaluate(state.params)
      writer.scalars(0, last_eval)
      print(f"{prefix} before training: {metrics.format_eval(last_eval)}", flush=True)
    t0 = time.time()
    for step in range(start, c.steps):
      idx = np.random.default_rng([c.seed, step]).choice(num_pairs, c.batch_pairs, replace=False)
      batch = trainer.put_batch(take_pairs(data, idx))
      state, m = trainer.step(state.replace(rollout_step=step), batch)
      done = step + 1
      if done % 10 == 0 or done == c.steps:
        m = {f"{prefix}/{k}": float(v) for k, v in jax.device_get(m).items()}
        writer.scalars(done, m)
        metrics.console(done, c.steps, m | {"time_s": time.time() - t0},
                        {f"{prefix}/{k}": v for k, v in console_keys.items()} | {"time_s": "s"})
      if (c.eval_every and done % c.eval_every == 0) or done == c.steps:
        last_eval = evaluate(state.params)
        writer.scalars(done, last_eval)
        print(f"{prefix} update {done}: {metrics.format_eval(last_eval)}", flush=True)
      if (c.ckpt_every and done % c.ckpt_every == 0) or done == c.steps:
        ckpt.save(done, state, {"step": done})
    ckpt.wait()
    if not last_eval:  # Resumed at the end: evaluate what was restored.
      last_eval = evaluate(state.params)
    return state.params, last_eval
  finally:
    ckpt.close()
    writer.close()


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
  trainer = train_step.Trainer(model_cfg, opt, mesh, objectives.reward_model(model_cfg, c.margin), num_microbatches=0,
                               microbatch_tokens=c.microbatch_tokens, head="scalar", lora=lora, seed=c.seed)
  score = trainer.forward(objectives.reward_scores(model_cfg))
  data = pair_rows(tok, train_pairs, c)
  held = pair_rows(tok, eval_pairs, c) if eval_pairs else None
  errors = [p.error for p in eval_pairs or ()]

  def evaluate(p) -> dict:
    if held is None:
      return {}
    r = chunked(score, trainer, p, held, c.batch_pairs)
    return {f"val/rm/{k}": v for k, v in pairwise_metrics(r[0::2] - r[1::2], errors).items()}

  return fit_pairs(c, trainer, params, data, workdir, evaluate, "rm",
                   {"loss": "loss", "accuracy": "acc", "margin": "margin"})


# --- scoring ------------------------------------------------------------------------------------

def _bucket(n: int, lo: int = 16) -> int:
  """The power of two >= n (at least lo): few compiled shapes."""
  return max(lo, 1 << max(n - 1, 0).bit_length())


class Scorer:
  """Scores (prompt, response) pairs with a reward model on the accelerator, in the calling process.

  A prompt is the user's message (rendered with the tokenizer's chat template when it has one, as
  in training); the response is followed by EOS, as `preference.pair_batch` writes it. Batches are
  padded to power-of-two shapes so few programs compile.
  """

  def __init__(self, model_dir: str, max_prompt_len: int = 512, max_response_len: int = 1024,
               batch_size: int = 64, chat_template: bool | None = None, dtype: str = "float32"):
    self.model_cfg, params = hf.load_scalar(model_dir, param_dtype=dtype, dtype=dtype)
    self.tok = tokenizer_lib.load(model_dir)
    tokenizer_lib.check_vocab(self.tok, self.model_cfg.vocab_size, f"{model_dir}/config.json")
    self.chat_template = bool(getattr(self.tok, "chat_template", None)) if chat_template is None else chat_template
    self.max_prompt_len, self.max_response_len, self.batch_size = max_prompt_len, max_response_len, batch_size
    self.params = jax.device_put(params)
    cfg = self.model_cfg
    self._score = jax.jit(lambda p, t, m: objectives.last_token_scores(cfg, p, t, m))

  def encode(self, prompts: Sequence[str], responses: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """[left-padded prompt | response + EOS, right-padded] tokens and mask, bucketed lengths."""
    texts = [tokenizer_lib.render(self.tok, [{"role": "user", "content": p}], self.chat_template) for p in prompts]
    p_ids = self.tok(texts, add_special_tokens=False)["input_ids"]
    r_ids = self.tok(list(responses), add_special_tokens=False)["input_ids"]
    p_ids = [row[-self.max_prompt_len:] for row in p_ids]
    r_ids = [(list(row) + [self.tok.eos_token_id])[: self.max_response_len] for row in r_ids]
    P = _bucket(max(len(r) for r in p_ids))
    C = _bucket(max(len(r) for r in r_ids))
    tokens = np.full((len(texts), P + C), self.tok.pad_token_id, np.int32)
    mask = np.zeros((len(texts), P + C), bool)
    for b, (p, r) in enumerate(zip(p_ids, r_ids)):
      tokens[b, P - len(p):P + len(r)] = list(p) + list(r)
      mask[b, P - len(p):P + len(r)] = True
    return tokens, mask

  def __call__(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
    if len(prompts) != len(responses):
      raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
    out: list[float] = []
    for i in range(0, len(responses), self.batch_size):
      tokens, mask = self.encode(prompts[i:i + self.batch_size], responses[i:i + self.batch_size])
      n = len(tokens)
      rows = min(_bucket(n, 1), self.batch_size) if n < self.batch_size else n
      pad = rows - n
      if pad:  # Pad the batch to a power of two with copies of its last row.
        tokens, mask = np.concatenate([tokens, np.repeat(tokens[-1:], pad, 0)]), np.concatenate(
            [mask, np.repeat(mask[-1:], pad, 0)])
      out += [float(s) for s in np.asarray(self._score(self.params, jnp.asarray(tokens), jnp.asarray(mask)))[:n]]
    return out


def scorer(model_dir: str) -> Callable[[Sequence[str], Sequence[str]], list[float]]:
  """The RM server's factory (`launch.serve_rm --scorer=dapo_jax.rm:scorer`): score_fn(prompts, responses)."""
  if not model_dir:
    raise hf.CheckpointError("the reward-model scorer needs --model_dir (a directory written by launch.rm)")
  return Scorer(model_dir)


class RMReward:
  """`reward.fn=rm:DIR`: a reward model scoring rollouts in the training process, batched on the
  accelerator; the interface of `rewards.RewardPool` plus the prompts (`needs_prompts`).

  acc is score > acc_threshold; `errors` / `timeouts` stay 0 (a failing model is a bug, not a flaky
  service, and raises).
  """
  needs_prompts = True

  def __init__(self, model_dir: str, batch_size: int = 64, acc_threshold: float = 0.0, **scorer_kw):
    self.scorer = Scorer(model_dir, batch_size=batch_size, **scorer_kw)
    self.model_dir, self.acc_threshold = model_dir, acc_threshold
    self.errors = self.timeouts = 0
    self._warned = False

  def close(self) -> None:
    pass

  def __call__(self, responses: Sequence[str], ground_truths: Sequence[str],
               prompts: Sequence[str] | None = None) -> list[dict]:
    del ground_truths  # The model judges the response against the prompt alone.
    if prompts is None:
      if not self._warned:
        logging.warning("reward model %s is called without prompts; scoring responses alone", self.model_dir)
        self._warned = True
      prompts = [""] * len(responses)
    scores = self.scorer(list(prompts), list(responses))
    return [{"score": s, "acc": s > self.acc_threshold, "pred": f"{s:.4g}"} for s in scores]
