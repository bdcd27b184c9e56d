"""The DAPO loop, the only module that knows the order of the steps (ARCHITECTURE.md data flow):

  prompts -> sampler.generate -> rewards (pool) -> dynamic sampling (refill until Q groups)
  -> advantages -> old log-probs -> train_step x (epochs x mini-batches) -> metrics -> checkpoint

π_old: the rollout policy's log-probs are recomputed by one training forward pass of the
current params (as the reference does) rather than taken from the sampler, so both sides of the
ratio come from the same program. When a rollout step makes a single update (one mini-batch, one
epoch) π_old is exactly the current policy, and that forward pass is skipped.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from collections import Counter

import jax
import numpy as np

from dapo_jax import advantages as adv_lib
from dapo_jax import checkpoint as ckpt_lib
from dapo_jax import data as data_lib
from dapo_jax import from_config, optim, sampling, sharding, train_step
from dapo_jax import metrics as metrics_lib
from dapo_jax import rewards as rewards_lib
from dapo_jax import tokenizer as tokenizer_lib
from dapo_jax.datatypes import RLBatch


class TrainingError(RuntimeError):
  pass


@dataclasses.dataclass
class Groups:
  """Scored rollouts on the host, one leading entry per prompt group (Q), G responses each."""
  prompt_QP: np.ndarray      # left-padded to data.max_prompt_len
  prompt_mask_QP: np.ndarray
  tokens_QGC: np.ndarray
  mask_QGC: np.ndarray
  length_QG: np.ndarray
  truncated_QG: np.ndarray
  score_QG: np.ndarray       # correctness score + overlong penalty: the reward
  acc_QG: np.ndarray         # correctness alone: what dynamic sampling filters on

  def __len__(self) -> int:
    return len(self.prompt_QP)

  def take(self, idx) -> "Groups":
    return Groups(*(getattr(self, f.name)[idx] for f in dataclasses.fields(self)))

  @staticmethod
  def concat(parts: list["Groups"]) -> "Groups":
    return Groups(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(Groups)))

  def to_json(self) -> dict:
    return {f.name: getattr(self, f.name).tolist() for f in dataclasses.fields(self)} | {
        "dtypes": {f.name: str(getattr(self, f.name).dtype) for f in dataclasses.fields(self)}}

  @staticmethod
  def from_json(d: dict) -> "Groups":
    return Groups(*(np.asarray(d[f.name], dtype=d["dtypes"][f.name]) for f in dataclasses.fields(Groups)))


class _StopFlag:
  """SIGTERM / SIGINT ask the loop to stop at the next safe point (after a step)."""

  def __init__(self):
    self.signal = None
    self._old = {}

  def __enter__(self):
    for s in (signal.SIGTERM, signal.SIGINT):
      try:
        self._old[s] = signal.signal(s, self._handle)
      except ValueError:  # Not the main thread (e.g. a notebook worker): no handler.
        pass
    return self

  def _handle(self, signum, frame):
    self.signal = signal.Signals(signum).name

  def __exit__(self, *exc):
    for s, h in self._old.items():
      signal.signal(s, h)


class DAPO:
  """Holds everything one run needs; `run()` executes it."""

  def __init__(self, cfg, workdir: str, mesh=None):
    self.cfg, self.workdir = cfg, workdir
    self.mesh = mesh if mesh is not None else sharding.make_mesh(cfg.mesh)
    os.makedirs(workdir, exist_ok=True)
    # Fail fast on configuration mistakes, before any compile or generation.
    from_config.validate(cfg)
    self.reward_pool = rewards_lib.RewardPool(cfg.reward.fn, cfg.reward.timeout_s, cfg.reward.workers)
    self.train_examples, self.eval_examples = from_config.datasets(cfg)
    self.tok = from_config.tokenizer(cfg, workdir, self.train_examples)
    for ex in self.train_examples[:1]:
      tokenizer_lib.render(self.tok, ex.messages, cfg.data.chat_template)  # Template errors now.
    self.model_cfg, params = from_config.initial_model(cfg, workdir, self.tok, self.mesh, self.train_examples)
    d = cfg.dapo
    self.updates_per_step = cfg.train.minibatches * cfg.train.ppo_epochs
    self.pg_cfg = train_step.PGConfig(
        eps_low=d.eps_low, eps_high=d.eps_high, clip_ratio_c=d.clip_ratio_c or None, loss_agg=d.loss_agg,
        verl_microbatch_weighting=d.verl_microbatch_weighting, temperature=cfg.rollout.temperature or 1.0,
        kl_coef=d.kl_coef, kl_estimator=d.kl_estimator, old_is_current=self.updates_per_step == 1,
        group_size=cfg.rollout.group_size if cfg.train.share_prompt else 0)
    self.trainer = train_step.Trainer(self.model_cfg, optim.OptimConfig(**cfg.optim), self.mesh,
                                      pg_cfg=self.pg_cfg, num_microbatches=cfg.train.num_microbatches,
                                      microbatch_tokens=cfg.train.microbatch_tokens)
    self.state = self.trainer.init(params=params)
    self.ref_params = sharding.fetch(self.state.params) if d.kl_coef else None  # Baselines with a KL term.
    del params
    self.eos_ids = tokenizer_lib.eos_ids(self.tok)
    r = cfg.rollout
    self.sampler_cfg = sampling.SamplerConfig(
        max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
        eos_ids=self.eos_ids, pad_id=self.tok.pad_token_id)
    e = cfg.eval
    self.eval_sampler_cfg = dataclasses.replace(
        self.sampler_cfg, temperature=e.temperature, top_p=e.top_p, top_k=0,
        max_new_tokens=e.max_new_tokens or r.max_new_tokens)
    self.data_iter = data_lib.PromptIterator(self.train_examples, seed=cfg.seed,
                                             process_index=jax.process_index(),
                                             process_count=jax.process_count())
    self.carry: Groups | None = None
    self.truncated_prompts = 0
    self.key = jax.random.key(cfg.seed)
    self.writer = metrics_lib.MetricWriter(workdir, enabled=jax.process_index() == 0)
    self.ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), keep=cfg.train.keep_ckpts)
    self.buckets = sorted(cfg.data.prompt_buckets or [cfg.data.max_prompt_len])

  # --- generation and scoring --------------------------------------------------------------

  def _encode(self, examples) -> tuple[np.ndarray, np.ndarray]:
    texts = [tokenizer_lib.render(self.tok, ex.messages, self.cfg.data.chat_template) for ex in examples]
    tokens, mask = tokenizer_lib.encode_left_padded(self.tok, texts, self.cfg.data.max_prompt_len)
    if mask[:, 0].any():  # A full row may have been cut: check the real lengths once.
      n = sum(len(ids) > self.cfg.data.max_prompt_len
              for ids in self.tok(texts, add_special_tokens=False)["input_ids"])
      if n:
        self.truncated_prompts += n
        logging.warning("%d prompts longer than data.max_prompt_len=%d lost their beginning",
                        n, self.cfg.data.max_prompt_len)
    return tokens, mask

  def _bucketed(self, prompt_mask_QP: np.ndarray) -> int:
    return tokenizer_lib.bucket(int(prompt_mask_QP.sum(1).max()), self.buckets)

  def generate(self, params, prompt_QP, prompt_mask_QP, G: int, key, sampler_cfg):
    """G samples per prompt (rows interleaved: prompt q's samples are rows qG..qG+G-1)."""
    P = self._bucketed(prompt_mask_QP)
    prompt_QP, prompt_mask_QP = prompt_QP[:, -P:], prompt_mask_QP[:, -P:]
    Q = len(prompt_QP)
    chunk = self.cfg.rollout.rows_per_call or Q * G  # Bounds the KV cache of one sampler call.
    if chunk % G or (Q * G) % chunk:
      raise ValueError(f"rollout.rows_per_call={chunk} must be a multiple of rollout.group_size={G} "
                       f"and divide the {Q * G} rows of a generation batch")
    per_call = chunk // G
    shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    # Prompts are split over the data shards when they divide evenly, else every shard holds them all.
    placement = self.trainer.batch_sharding if per_call % shards == 0 else self.trainer.replicated
    outs = []
    for i in range(0, Q, per_call):
      part = sharding.put((prompt_QP[i:i + per_call], prompt_mask_QP[i:i + per_call]), placement)
      k = key if per_call == Q else jax.random.fold_in(key, i)
      outs.append(sharding.fetch(sampling.generate(self.model_cfg, sampler_cfg, params, *part, k, num_samples=G)))
    return outs[0] if len(outs) == 1 else jax.tree.map(lambda *xs: np.concatenate(xs), *outs)

  def score(self, examples, tokens_BC, mask_BC, length_B, G: int) -> dict:
    """Rewards of this host's rows (its examples x G); correctness + overlong penalty."""
    texts = tokenizer_lib.decode(self.tok, tokens_BC, mask_BC)
    gts = [ex.ground_truth for ex in examples for _ in range(G)]
    results = self.reward_pool(texts, gts)
    d = self.cfg.dapo
    penalty = np.array([rewards_lib.overlong_penalty(int(n), self.sampler_cfg.max_new_tokens,
                                                     d.overlong_buffer, d.overlong_penalty)
                        for n in length_B])
    Q = len(examples)
    return {"score": (np.array([r["score"] for r in results]) + penalty).reshape(Q, G),
            "acc": np.array([r["acc"] for r in results], bool).reshape(Q, G),
            "pred": [r["pred"] for r in results], "texts": texts}

  def sampling_params(self):
    """The policy placed for the sampler: FSDP shards gathered once per rollout step."""
    if self.mesh.shape["fsdp"] > 1:
      return jax.device_put(self.state.params, self.trainer.sampling_params_sharding)
    return self.state.params

  def rollout_batch(self, key, examples, params) -> tuple[Groups, dict]:
    """Generates for the global batch (every host's prompts); each host scores its own rows."""
    G = self.cfg.rollout.group_size
    local_QP, local_mask_QP = self._encode(examples)
    prompt_QP, pmask_QP = sharding.gather_hosts(local_QP), sharding.gather_hosts(local_mask_QP)
    t0 = time.perf_counter()
    samples = self.generate(params, prompt_QP, pmask_QP, G, key, self.sampler_cfg)
    t1 = time.perf_counter()
    rows = slice(jax.process_index() * len(examples) * G, (jax.process_index() + 1) * len(examples) * G)
    local = self.score(examples, samples.tokens_BC[rows], samples.mask_BC[rows], samples.length_B[rows], G)
    # Dynamic sampling and advantages need every group, identically on every host.
    scored = {"score": sharding.gather_hosts(local["score"]), "acc": sharding.gather_hosts(local["acc"]),
              "texts": local["texts"]}
    t2 = time.perf_counter()
    Q, C = len(prompt_QP), self.sampler_cfg.max_new_tokens
    groups = Groups(prompt_QP=prompt_QP, prompt_mask_QP=pmask_QP,
                    tokens_QGC=samples.tokens_BC.reshape(Q, G, C), mask_QGC=samples.mask_BC.reshape(Q, G, C),
                    length_QG=samples.length_B.reshape(Q, G), truncated_QG=samples.truncated_B.reshape(Q, G),
                    score_QG=scored["score"], acc_QG=scored["acc"])
    info = {"gen_s": t1 - t0, "reward_s": t2 - t1, "texts": scored["texts"],
            "gen_tokens": int(samples.length_B.sum())}
    return groups, info

  def collect(self, step: int) -> tuple[Groups | None, dict]:
    """Dynamic sampling (DAPO_SPEC §2.2): generate, keep groups with mixed correctness, refill."""
    d, Q = self.cfg.dapo, self.cfg.dapo.prompts_per_step
    gen_prompts = d.gen_prompts if d.dynamic_sampling else Q
    kept = [self.carry] if (self.carry is not None and len(self.carry)) else []
    n_kept = sum(len(k) for k in kept)
    stats = Counter()
    first_texts, first_groups = None, None
    n_gen = 0
    params = self.sampling_params() if n_kept < Q else None
    while n_kept < Q:
      if d.dynamic_sampling and d.max_gen_batches > 0 and n_gen >= d.max_gen_batches:
        if d.on_cap == "raise":
          raise TrainingError(f"dynamic sampling: {n_gen} generation batches (dapo.max_gen_batches) kept "
                              f"only {n_kept} of {Q} groups; the data is too easy or too hard")
        logging.warning("step %d: dynamic sampling reached dapo.max_gen_batches=%d with %d/%d groups; "
                        "training on what was kept", step, n_gen, n_kept, Q)
        stats["cap_reached"] = 1
        break
      key = jax.random.fold_in(jax.random.fold_in(self.key, step), n_gen)
      groups, info = self.rollout_batch(key, self.data_iter.next_batch(gen_prompts), params)
      n_gen += 1
      stats["gen_s"] += info["gen_s"]
      stats["reward_s"] += info["reward_s"]
      stats["gen_tokens"] += info["gen_tokens"]
      stats["groups_generated"] += len(groups)
      stats["acc_all_sum"] += float(groups.acc_QG.mean()) * len(groups)
      if first_texts is None:
        first_texts, first_groups = info["texts"], groups
      keep = adv_lib.keep_groups(groups.acc_QG) if d.dynamic_sampling else np.ones(len(groups), bool)
      stats["groups_kept"] += int(keep.sum())
      stats["groups_all_correct"] += int(groups.acc_QG.all(1).sum())
      stats["groups_all_wrong"] += int((~groups.acc_QG).all(1).sum())
      if keep.any():
        kept.append(groups.take(np.flatnonzero(keep)))
        n_kept += int(keep.sum())
    stats["num_gen_batches"] = n_gen
    stats["texts"], stats["first_groups"] = first_texts, first_groups
    if not kept:
      self.carry = None
      return None, stats
    batch = Groups.concat(kept)
    self.carry = batch.take(slice(Q, None)) if d.carry_over and len(batch) > Q else None
    return batch.take(slice(0, Q)), stats

  # --- the update ----------------------------------------------------------------------------

  def make_batch(self, groups: Groups) -> tuple[RLBatch, np.ndarray]:
    """Host arrays of the train batch: [Q*G, P+C] rows; groups short of Q are masked padding."""
    Q, G = self.cfg.dapo.prompts_per_step, self.cfg.rollout.group_size
    n = len(groups)
    adv_QG = adv_lib.group_advantages(groups.score_QG, self.cfg.dapo.norm_adv_by_std)
    real_Q = np.arange(Q) < n
    if n < Q:  # Static shapes: repeat real groups as padding with an all-zero loss mask.
      groups = groups.take(np.arange(Q) % n)
      adv_QG = adv_QG[np.arange(Q) % n]
    P = self._bucketed(groups.prompt_mask_QP)
    C = groups.tokens_QGC.shape[-1]
    prompt_BP = np.repeat(groups.prompt_QP[:, -P:], G, axis=0)
    pmask_BP = np.repeat(groups.prompt_mask_QP[:, -P:], G, axis=0)
    cmask_BC = groups.mask_QGC.reshape(-1, C)
    loss_mask_BC = cmask_BC & np.repeat(real_Q, G)[:, None]
    if self.cfg.dapo.overlong_filter:  # §3.3: truncated samples leave the loss and its denominator.
      loss_mask_BC &= ~groups.truncated_QG.reshape(-1, 1)
    batch = RLBatch(tokens_BT=np.concatenate([prompt_BP, groups.tokens_QGC.reshape(-1, C)], 1).astype(np.int32),
                    mask_BT=np.concatenate([pmask_BP, cmask_BC], 1),
                    loss_mask_BC=loss_mask_BC,
                    old_logp_BC=np.zeros(cmask_BC.shape, np.float32),
                    adv_B=adv_QG.reshape(-1).astype(np.float32),
                    ref_logp_BC=np.zeros(cmask_BC.shape, np.float32))
    return batch, adv_QG[real_Q]

  def update(self, batch: RLBatch) -> tuple[dict, dict]:
    t = self.cfg.train
    timing = {}
    # An async checkpoint may still be reading the state's buffers, which the train step donates
    # (and overwrites). It has had the whole rollout phase to finish.
    self.ckpt.wait()
    t0 = time.perf_counter()
    if self.updates_per_step > 1:  # Otherwise π_old is the current policy (see the module doc).
      old = self.trainer.logprobs(self.state.params, self.trainer.put_batch(batch))
      batch = batch.replace(old_logp_BC=sharding.fetch(old))
    if self.ref_params is not None:
      ref = self.trainer.logprobs(sharding.put(self.ref_params, self.trainer.params_sharding),
                                  self.trainer.put_batch(batch))
      batch = batch.replace(ref_logp_BC=sharding.fetch(ref))
    t1 = time.perf_counter()
    timing["old_log_prob_s"] = t1 - t0
    B = batch.adv_B.shape[0]
    mb = B // t.minibatches
    all_metrics = []
    for _ in range(t.ppo_epochs):
      for i in range(t.minibatches):
        part = jax.tree.map(lambda x: x[i * mb:(i + 1) * mb], batch)
        self.state, m = self.trainer.step(self.state, self.trainer.put_batch(part))
        all_metrics.append(m)
    all_metrics = sharding.fetch(all_metrics)  # One host sync for the whole step.
    timing["update_actor_s"] = time.perf_counter() - t1
    mean = {k: float(np.mean([m[k] for m in all_metrics])) for k in all_metrics[0]}
    mean["update_skipped"] = float(np.sum([m["update_skipped"] for m in all_metrics]))
    return mean, timing


  # --- evaluation ----------------------------------------------------------------------------

  def evaluate(self, params=None, examples=None, k: int | None = None, key=None) -> dict:
    """Held-out accuracy: mean@k, best@k (pass@k), maj@k with the eval sampler; greedy if asked."""
    params = self.state.params if params is None else params
    examples = self.eval_examples if examples is None else examples
    if not examples:
      return {}
    k = k or self.cfg.eval.k
    key = jax.random.key(self.cfg.seed + 1) if key is None else key
    out = {}
    acc, preds = self._eval_samples(params, examples, k, key, self.eval_sampler_cfg)
    out[f"val/acc/mean@{k}"] = float(acc.mean())
    out[f"val/acc/best@{k}"] = float(acc.any(1).mean())
    maj = []
    for q in range(len(examples)):
      top = Counter(preds[q]).most_common(1)[0][0]
      maj.append(acc[q][preds[q].index(top)])
    out[f"val/acc/maj@{k}"] = float(np.mean(maj))
    if self.cfg.eval.greedy:
      greedy_cfg = dataclasses.replace(self.eval_sampler_cfg, temperature=0.0, top_p=1.0)
      acc_g, _ = self._eval_samples(params, examples, 1, key, greedy_cfg)
      out["val/acc/greedy"] = float(acc_g.mean())
    return out

  def _eval_samples(self, params, examples, k, key, sampler_cfg):
    # Chunks of the rollout's row count, so the compiled sampler shapes are few.
    rows = max(self.cfg.dapo.gen_prompts * self.cfg.rollout.group_size // k, 1)
    accs, preds = [], []
    for i in range(0, len(examples), rows):
      chunk = list(examples[i:i + rows])
      n = len(chunk)
      chunk += [chunk[-1]] * (rows - n)  # Pad the last chunk to the static shape.
      prompt_QP, pmask_QP = self._encode(chunk)
      samples = self.generate(params, prompt_QP, pmask_QP, k, jax.random.fold_in(key, i), sampler_cfg)
      texts = tokenizer_lib.decode(self.tok, samples.tokens_BC, samples.mask_BC)
      res = self.reward_pool(texts, [ex.ground_truth for ex in chunk for _ in range(k)])
      accs.append(np.array([r["acc"] for r in res]).reshape(rows, k)[:n])
      preds += [[res[q * k + j]["pred"] for j in range(k)] for q in range(n)]
    return np.concatenate(accs), preds

  # --- checkpoints ---------------------------------------------------------------------------

  def save(self, next_step: int) -> None:
    extra = {"rollout_step": next_step, "data": self.data_iter.state(), "seed": self.cfg.seed,
             "carry": self.carry.to_json() if self.carry is not None else None}
    self.ckpt.save(next_step, self.state, extra)

  def restore(self) -> int:
    abstract = ckpt_lib.abstract(self.state, self.trainer.state_sharding)
    restored = self.ckpt.restore_latest(abstract)  # The newest intact checkpoint.
    if restored is None:
      return 0
    step, self.state, extra = restored
    if extra["seed"] != self.cfg.seed:
      raise ckpt_lib.CheckpointMismatchError(
          f"checkpoint {self.ckpt.directory}/{step} was written with seed={extra['seed']}, config has "
          f"seed={self.cfg.seed}")
    self.data_iter.restore(extra["data"])
    self.carry = Groups.from_json(extra["carry"]) if extra["carry"] else None
    return int(extra["rollout_step"])

  # --- the run -------------------------------------------------------------------------------

  def log_samples(self, step: int, texts, groups: Groups | None) -> None:
    if texts is None or groups is None:
      return
    G = self.cfg.rollout.group_size
    lines = []
    for q in range(min(2, len(groups))):
      prompt = self.tok.decode(groups.prompt_QP[q][groups.prompt_mask_QP[q]], skip_special_tokens=True)
      for g in range(min(2, G)):
        lines.append(f"PROMPT: {prompt!r}\nRESPONSE: {texts[q * G + g]!r}  score={groups.score_QG[q, g]:+.2f}")
    self.writer.text(step, "samples", "\n\n".join(lines))

  def train_step(self, step: int) -> tuple[dict, dict]:
    """One rollout step: collect a filtered batch, update on it. Returns (metrics, collect stats)."""
    t_step = time.perf_counter()
    self.state = self.state.replace(rollout_step=step)  # Sets this step's learning rate.
    groups, stats = self.collect(step)
    if groups is None:
      logging.warning("step %d: no group with mixed correctness; no update", step)
      train_metrics, timing, adv = {}, {}, np.zeros((0,))
    else:
      batch, adv = self.make_batch(groups)
      train_metrics, timing = self.update(batch)
    step_s = time.perf_counter() - t_step
    return self._step_metrics(groups, stats, train_metrics, timing, adv, step_s), stats

  def run(self) -> dict:
    cfg = self.cfg
    total = cfg.train.num_steps
    start = self.restore()
    if start:
      print(f"Resumed from {self.ckpt.directory} at rollout step {start}.", flush=True)
    else:
      ev = self.evaluate()
      self.writer.scalars(0, ev)
      print("Held-out before RL: " + _fmt(ev), flush=True)
    last = {}
    with _StopFlag() as stop:
      for step in range(start, total):
        m, stats = self.train_step(step)
        if int(self.state.bad_streak) >= cfg.train.max_bad_steps:
          self.ckpt.wait()
          raise TrainingError(
              f"step {step + 1}: {int(self.state.bad_streak)} updates in a row had a non-finite loss or "
              f"gradient norm and were skipped; stopping. The last good checkpoint is "
              f"{self.ckpt.directory}/{self.ckpt.latest_step()}")
        done = step + 1
        if cfg.train.eval_every and (done % cfg.train.eval_every == 0 or done == total):
          t0 = time.perf_counter()
          m.update(self.evaluate())
          m["timing_s/testing"] = time.perf_counter() - t0
        self.writer.scalars(done, m)
        self.writer.flush()  # A kill -9 loses nothing that was logged.
        if cfg.train.log_samples_every and done % cfg.train.log_samples_every == 0:
          self.log_samples(done, stats["texts"], stats["first_groups"])
        metrics_lib.console(done, total, m, _HEADLINE)
        last = m
        if (cfg.train.ckpt_every and done % cfg.train.ckpt_every == 0) or done == total or stop.signal:
          self.save(done)
        if stop.signal:
          self.ckpt.wait()
          self.writer.flush()
          print(f"Stopped by {stop.signal} after rollout step {done}; checkpoint saved in "
                f"{self.ckpt.directory}. Run the same command again to resume.", flush=True)
          break
    self.ckpt.wait()
    self.writer.flush()
    return last

  def _step_metrics(self, groups, stats, train_metrics, timing, adv, step_s) -> dict:
    C = self.sampler_cfg.max_new_tokens
    m = {f"actor/{k}": v for k, v in train_metrics.items() if k not in ("lr", "grad_norm", "num_tokens")}
    if train_metrics:
      m["actor/lr"], m["actor/grad_norm"] = train_metrics["lr"], train_metrics["grad_norm"]
    if groups is not None:
      lengths = groups.length_QG
      m.update({
          "critic/score/mean": float(groups.score_QG.mean()), "critic/score/max": float(groups.score_QG.max()),
          "critic/score/min": float(groups.score_QG.min()), "critic/acc/mean": float(groups.acc_QG.mean()),
          "critic/advantages/mean": float(adv.mean()), "critic/advantages/max": float(adv.max()),
          "critic/advantages/min": float(adv.min()),
          "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
          "response_length/min": float(lengths.min()),
          "response_length/clip_ratio": float((lengths >= C).mean())})
    gen = max(stats["groups_generated"], 1)
    if stats["groups_generated"]:  # A step filled from carried-over groups generated nothing.
      m["rollout/acc_all"] = stats["acc_all_sum"] / gen
    m.update({
        "train/num_gen_batches": stats["num_gen_batches"], "train/kept_fraction": stats["groups_kept"] / gen,
        "train/all_correct_fraction": stats["groups_all_correct"] / gen,
        "train/all_wrong_fraction": stats["groups_all_wrong"] / gen,
        "train/cap_reached": stats.get("cap_reached", 0),
        "reward/errors": self.reward_pool.errors, "reward/timeouts": self.reward_pool.timeouts,
        "train/skipped_updates": int(self.state.skipped), "data/truncated_prompts": self.truncated_prompts,
        "timing_s/gen": stats["gen_s"], "timing_s/reward": stats["reward_s"],
        "timing_s/old_log_prob": timing.get("old_log_prob_s", 0.0),
        "timing_s/update_actor": timing.get("update_actor_s", 0.0), "timing_s/step": step_s,
        "perf/throughput": stats["gen_tokens"] / max(step_s, 1e-9)})
    return m


_HEADLINE = {"critic/acc/mean": "acc", "rollout/acc_all": "acc(all)", "critic/score/mean": "score",
             "response_length/mean": "len", "actor/entropy": "ent", "train/num_gen_batches": "gen",
             "actor/grad_norm": "gnorm", "timing_s/step": "s", "val/acc/greedy": "VAL greedy"}


def _fmt(ev: dict) -> str:
  return "  ".join(f"{k.removeprefix('val/acc/')} {v:.3f}" for k, v in ev.items())


def run(cfg, workdir: str, mesh=None) -> dict:
  """Trains with DAPO as `cfg` says; resumes from `workdir` if it holds a checkpoint."""
  dapo = DAPO(cfg, workdir, mesh)
  try:
    last = dapo.run()
    ev = {k: v for k, v in last.items() if k.startswith("val/")}
    if ev:
      print("Held-out after RL: " + _fmt(ev), flush=True)
    return last
  finally:
    dapo.reward_pool.close()
    dapo.writer.close()
    dapo.ckpt.close()
