"""The DAPO loop, the only module that knows the order of the steps (docs/architecture.md, the data flow):

  prompts -> rollout (generate, score) -> dynamic sampling (`rollout.dynamic_sampling`)
  -> advantages (`advantages.to_train_batch`; token-level ones and PPO's value model: `ppo`)
  -> old log-probs -> Trainer.step x (epochs x mini-batches) -> metrics -> checkpoint

π_old: the rollout policy's log-probs are recomputed by one training forward pass of the
current params (as the reference does) rather than taken from the sampler, so both sides of the
ratio come from the same program. When a rollout step makes a single update (one mini-batch, one
epoch) π_old is exactly the current policy, and that forward pass is skipped. Groups carried over
from an earlier step (`dapo.carry_over`) were sampled by an older policy: their π_old is the
sampler's log-probs recorded then, so the clip bounds their off-policy ratio.

Staleness (`rollout.max_staleness=S`, `pipelining`): step k+1's groups are sampled by version k
(the params before update k) in a thread while update k runs; with S > 1 the rollouts of steps up
to k+S are queued by version k behind it. Those rows are trained like carried
ones (π_old = their sampler log-probs), or, with `use_decoupled_loss`, with π_old = this step's
params (AReaL's proximal policy) and π_prox/π_behav through `dapo.rollout_correction`. No queued
rollout crosses a periodic checkpoint, so the step after a checkpoint is sampled
synchronously and a resumed run repeats an uninterrupted one exactly. With `partial_rollouts`, the
params of update k reach step k+1's rollout as soon as the update ends: its samples in flight draw
their remaining tokens with them (`Groups.switch_QG` marks where), and its prompts not yet started
are sampled by them alone.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time
from typing import Any

import jax
import numpy as np

from dapo_jax import advantages as adv_lib
from dapo_jax import checkpoint as ckpt_lib
from dapo_jax import dumps, errors, host_memory, packing, pipelining, ppo, sharding, train_step
from dapo_jax import metrics as metrics_lib
from dapo_jax.datatypes import Groups, RLBatch
from dapo_jax.model import vision as vision_lib
from dapo_jax.rollout import dynamic_sampling


class TrainingError(errors.UserError, RuntimeError):
  pass


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """The order and sizes of a run's steps (`builders.loop_config` picks it from a config)."""
  num_steps: int                # rollout steps
  prompts_per_step: int         # Q: groups trained per rollout step
  group_size: int               # G
  gen_prompts: int              # prompts per generation batch
  dynamic_sampling: bool        # keep only groups whose filter values differ (Eq. 11)
  max_gen_batches: int          # generation batches per step at most (0 = unlimited)
  on_cap: str                   # "train" on what was kept at the cap, or "raise"
  carry_over: bool              # keep surplus groups for the next step
  norm_adv_by_std: bool
  overlong_filter: bool         # truncated samples leave the loss
  minibatches: int              # updates per rollout step and epoch
  ppo_epochs: int
  reference: bool               # a frozen reference model's log-probs feed a KL term
  length_buckets: tuple[int, ...]  # completion lengths micro-batches are cut to; () = pad to C
  shared_prefix: int            # a mini-batch's prompts sharing >= this many first tokens run them once
                                # (`train_step.shared_prefix_layout`; 0 = off; off for sliding-window models)
  seed: int
  ckpt_every: int               # rollout steps between checkpoints (0 = at the end only)
  eval_every: int               # rollout steps between held-out evaluations (0 = at the start and end)
  log_samples_every: int        # rollout steps between logged sample texts (0 = never)
  streaming: bool = True        # admit prompts while they can be needed (`streaming`); False: whole
                                # generation batches, then the filter (the reference)
  admit_ahead: bool = True      # streaming admits by the running keep rate, cancelling what the step
                                # did not need (same kept groups); False: only while kept + in flight < Q
  admit_margin: float = 1.0     # how far ahead: standard deviations of the expected keeps
  adv_estimator: str = "grpo"   # advantages.ESTIMATORS; "gae" needs a `Critic`
  gdpo_reward_weights: tuple[float, ...] = ()  # gdpo: each component's weight (() = ones)
  gamma: float = 1.0            # discount of the token-level estimators
  lam: float = 1.0              # GAE's λ
  max_bad_steps: int = 5        # stop after this many non-finite updates in a row
  dump_rollouts_every: int = 0  # rollout steps between WORKDIR/rollouts dumps (`dumps`); 0 = none
  profile_steps: tuple[int, ...] = ()  # (a, b): a JAX profiler trace of rollout steps a..b in WORKDIR/profile
  peak_flops: float = 0.0       # per device, for perf/mfu; 0 = from the device kind (`metrics.PEAK_FLOPS`)
  max_staleness: int = 0        # 0: synchronous; S: the rollouts of the next S steps are sampled during this update
  use_decoupled_loss: bool = False  # stale rows' π_old: False = sampler log-probs; True = this step's policy
  partial_rollouts: bool = False  # the rollout in flight continues with each update's params as it ends
  packing: bool = False         # micro-batches of rows packed without padding (`packing.packed_microbatches`)
  # packed: attention by blocks of this many tokens reading only the key blocks their segments reach, in
  # one sequence of the whole budget per shard (`packing.key_blocks`); 0 = dense, sequences of a length bucket
  packing_block: int = 32
  rollout_correction: Any = None  # `objectives.RolloutCorrection`: its IS weights scale the optimal token baseline's

  @property
  def updates_per_step(self) -> int:
    return self.minibatches * self.ppo_epochs


class DAPO:
  """One run: `run()` executes it. A context manager: leaving it stops the reward workers, the
  metric writer and the checkpointer (`builders.dapo(cfg, workdir, mesh)` builds one).

  PPO: `critic` (a `Critic`) and `kl_ctrl` (`advantages.FixedKLController` or the adaptive one: β of
  the KL-shaped reward, updated every step and checkpointed)."""

  def __init__(self, cfg: LoopConfig, *, trainer, logprobs, rollout, evaluator, data_iter, params,
               workdir: str, keep_ckpts: int = 3, writer_cfg: metrics_lib.WriterConfig = metrics_lib.WriterConfig(),
               run_config: dict | None = None, critic: ppo.Critic | None = None, kl_ctrl=None, teacher=None,
               logprobs_sum_pi_squared=None, logprobs_experts=None):
    self.cfg, self.trainer, self.logprobs, self.rollout, self.evaluator = cfg, trainer, logprobs, rollout, evaluator
    self.data_iter = data_iter
    host_memory.release_after_compiles()  # A phase's first run then starts without the compiler's garbage.
    if cfg.adv_estimator == "gae" and critic is None:
      raise ValueError("adv_estimator='gae' needs a value model (critic)")
    if cfg.adv_estimator == "distill" and teacher is None:
      raise ValueError("adv_estimator='distill' needs a teacher: (log-prob function, params)")
    if cfg.adv_estimator == "optimal_token_baseline" and logprobs_sum_pi_squared is None:
      raise ValueError("adv_estimator='optimal_token_baseline' needs logprobs_sum_pi_squared "
                       "(objectives.completion_logprobs_and_sum_pi_squared, jitted by Trainer.forward)")
    self.critic, self.kl_ctrl, self.teacher = critic, kl_ctrl, teacher
    self.logprobs_sum_pi_squared = logprobs_sum_pi_squared
    # Routing replay R2: π_old's pass also returns each completion token's experts, which the updates replay.
    self.logprobs_experts = logprobs_experts
    self.state = trainer.init(params=params)
    # Baselines with a KL term: the initial policy, resident on the mesh like the params.
    self.ref_params = trainer.reference_params(self.state.params) if cfg.reference else None
    self.carry: Groups | None = None
    self.keep_rate = dynamic_sampling.KeepRate()  # streaming admits ahead by it (never decides what is kept)
    self.key = jax.random.key(cfg.seed)
    self.writer = metrics_lib.MetricWriter(workdir, enabled=jax.process_index() == 0, cfg=writer_cfg,
                                           run_config=run_config)
    self.ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), keep=keep_ckpts)
    self.workdir = workdir
    # Rollout dumps: every scored sample of the steps (and evaluations) that `_dump` picks.
    self.dumps = dumps.RolloutRecorder(workdir, rollout, filter_groups=cfg.dynamic_sampling,
                                       enabled=jax.process_index() == 0) if cfg.dump_rollouts_every else None
    if cfg.max_staleness and self.dumps is not None:
      # A dump records one step's rollouts while the next one's are being sampled in the thread.
      logging.warning("rollout.max_staleness=%d: no rollout dumps (train.dump_rollouts_every=%d is ignored)",
                      cfg.max_staleness, cfg.dump_rollouts_every)
      self.dumps = None
    # Several processes must issue the same collectives in the same order: there, the next step's
    # rollout runs before the update instead of beside it (the same samples, no overlap).
    self.prefetch = pipelining.Prefetch(in_order=jax.process_count() > 1) if cfg.max_staleness else None
    self.feed = None  # partial rollouts: where the rollout in flight takes newer params from
    mc = getattr(rollout, "model_cfg", None)  # The prefix layout has no sliding window.
    self.shared_prefix = 0 if mc is None or mc.local_layers or mc.sliding_window else cfg.shared_prefix
    kind = jax.devices()[0].device_kind
    self.peak_flops = cfg.peak_flops or metrics_lib.peak_flops(kind)

  def __enter__(self) -> "DAPO":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    if self.prefetch is not None:
      self.prefetch.close()
    self.rollout.reward.close()
    if hasattr(self.evaluator, "close"):
      self.evaluator.close()
    self.writer.close()
    self.ckpt.close()

  # --- one rollout step ----------------------------------------------------------------------

  def collect(self, step: int, policy=None) -> tuple[Groups | None, dynamic_sampling.FillStats, dict]:
    """Q groups for this step: streamed through the engine, or generation batches until dynamic
    sampling has Q groups (or its cap). `policy`: the params that sample (default: the state's)."""
    c = self.cfg
    step_key = jax.random.fold_in(self.key, step)
    params = lambda: self.rollout.sampling_params(self.state.params) if policy is None else policy
    episodes = self.rollout.episodes
    if episodes is not None:  # env/* count this rollout's episodes alone.
      episodes.reset_metrics()
    at_step = getattr(self.data_iter, "at_step", None)  # A stream that counts per step (pools, sources).
    if at_step is not None:
      at_step(step)
    if c.streaming:
      batch, stats, info = dynamic_sampling.stream_groups(
          self.rollout, params(), self.data_iter, c.group_size, c.prompts_per_step,
          jax.random.fold_in(step_key, 0), max_prompts=c.max_gen_batches * c.gen_prompts if c.dynamic_sampling
          else 0, filter_groups=c.dynamic_sampling, on_cap=c.on_cap, keep_rate=self.keep_rate,
          ahead=c.admit_ahead, margin=c.admit_margin)
    else:
      # A carried group is one version old by design (carry_over); one carried again, older, is dropped.
      self.carry, dropped = pipelining.bound_carry(self.carry, step, max(c.max_staleness, 1))
      if dropped:
        logging.info("step %d: %d carried groups older than %d version(s) dropped", step, dropped,
                     max(c.max_staleness, 1))
      batch, self.carry, stats, info = dynamic_sampling.fill_step(
          self.rollout, params, self.data_iter.next_batch, self.carry, step_key, Q=c.prompts_per_step,
          G=c.group_size, batch_prompts=c.gen_prompts if c.dynamic_sampling else c.prompts_per_step,
          filter_groups=c.dynamic_sampling, max_gen_batches=c.max_gen_batches, on_cap=c.on_cap,
          carry_over=c.carry_over)
      info["carry_dropped"] = dropped
    if episodes is not None:
      info["env"] = episodes.metrics()
    if at_step is not None:
      info["data"] = self.data_iter.metrics()
    return batch, stats, info

  def pack_args(self, trainer=None) -> dict:
    """`packing.packed_rows`' budget for `trainer`'s passes (default: the policy's)."""
    trainer = trainer or self.trainer
    vision = self.trainer.model_cfg.vision  # The rows are the policy's, placeholders included.
    return dict(max_tokens=trainer.microbatch_tokens, shards=sharding.batch_shards(trainer.mesh.shape),
                buckets=self.cfg.length_buckets, scored=trainer.scored_cost, block=self.cfg.packing_block,
                vision=vision)

  def split(self, batch):
    """The train batch's `minibatches` mini-batches (consecutive rows: whole groups)."""
    rows = batch.tokens_BT.shape[0] // self.cfg.minibatches
    return [jax.tree.map(lambda x: x[i * rows:(i + 1) * rows], batch) for i in range(self.cfg.minibatches)]

  def update(self, batch: RLBatch, have_logprobs: bool = False) -> tuple[dict, dict]:
    """π_old (and reference) log-probs unless `have_logprobs`, then epochs x mini-batches of
    updates; mean metrics."""
    c = self.cfg
    # An async checkpoint may still be reading the state's buffers, which the train step donates
    # (and overwrites). It has had the whole rollout phase to finish.
    self.ckpt.wait()
    t0 = time.perf_counter()
    # Prompts that begin alike run their common start once (before the cut: micro-batches are
    # sized by what that layout computes).
    minibatches = [train_step.shared_prefix_layout(mb, self.trainer.group_size, self.shared_prefix)
                   for mb in self.split(batch)]
    C = batch.loss_mask_BC.shape[1]
    if c.packing:  # Each mini-batch's rows packed into sequences of the token budget, no padding.
      minibatches = [packing.packed_microbatches(mb, **self.pack_args()) for mb in self.split(batch)]
    elif c.length_buckets:  # Each mini-batch as micro-batches cut to length buckets (when one is shorter).
      # A set micro-batch count is kept; auto (0) packs each bucket's rows to the token budget.
      cut = functools.partial(train_step.bucketed_microbatches, num_microbatches=self.trainer.num_microbatches,
                              group_size=self.trainer.group_size, buckets=c.length_buckets,
                              max_tokens=self.trainer.microbatch_tokens, scored=self.trainer.scored_cost,
                              shards=sharding.batch_shards(self.trainer.mesh.shape))
      minibatches = [parts if min(p.loss_mask_BC.shape[1] for p in parts) < C else [mb]
                     for mb, parts in ((mb, cut(mb)) for mb in minibatches)]
    else:
      minibatches = [[mb] for mb in minibatches]
    log_r = []  # log π_old - log π_rollout at the loss tokens' extremes, from the π_old pass
    for parts in [] if have_logprobs else minibatches:
      for i, mb in enumerate(parts):
        # Forward passes read no flags: one compiled pass whether or not the batch has carried rows.
        placed = self.trainer.put_batch(mb.replace(behaviour_B=None))
        if c.updates_per_step > 1:  # Otherwise π_old is the current policy (see the module doc).
          if self.logprobs_experts is not None:  # R2: π_old's routing, which the updates replay.
            old_BC, routes_BCLk, *packed_routes = sharding.fetch(self.logprobs_experts(self.state.params, placed))
            mb = mb.replace(routes_BCLk=routes_BCLk)
            if packed_routes:  # The same records at their packed positions.
              mb = mb.replace(packed=mb.packed.replace(routes_MTLk=packed_routes[0]))
          else:
            old_BC = sharding.fetch(self.logprobs(self.state.params, placed))
          if mb.behaviour_B is not None:  # Carried rows keep their sampling policy's log-probs.
            old_BC = np.where(mb.behaviour_B[:, None], mb.old_logp_BC, old_BC)
          mb = mb.replace(old_logp_BC=old_BC)
          if mb.rollout_logp_BC is not None and mb.loss_mask_BC.any():
            d = (old_BC - mb.rollout_logp_BC)[mb.loss_mask_BC]
            log_r += [d.max(), d.min()]
        if self.ref_params is not None:  # The reference routes its tokens itself.
          if mb.routes_BCLk is not None:
            plain = mb.replace(behaviour_B=None, routes_BCLk=None)
            if mb.packed is not None:
              plain = plain.replace(packed=mb.packed.replace(routes_MTLk=None))
            placed = self.trainer.put_batch(plain)
          mb = mb.replace(ref_logp_BC=sharding.fetch(self.logprobs(self.ref_params, placed)))
        parts[i] = mb
    t1 = time.perf_counter()
    # Again here: the rollout's last buffers may have been freed only after the step's first release,
    # and the update's peak (its activations and gradients) then stands on them.
    host_memory.release()
    self.state, all_metrics = self.trainer.updates(self.state, minibatches, c.ppo_epochs)
    all_metrics = sharding.fetch(all_metrics)  # One host sync for the whole step.
    timing = {"old_log_prob_s": t1 - t0, "update_actor_s": time.perf_counter() - t1}
    out = metrics_lib.mean_updates(all_metrics)
    if log_r:  # Extremes do not add over micro-batches, so they come from here (the other mismatch/* from the loss).
      out["mismatch/ratio_max"], out["mismatch/ratio_min"] = float(np.exp(max(log_r))), float(np.exp(min(log_r)))
    return out, timing

  def step(self, step: int) -> tuple[dict, dict]:
    """One rollout step: collect a filtered batch, update on it. Returns (metrics, rollout info)."""
    t_step = time.perf_counter()
    # Sets this step's learning rate. An array of the state's own dtype, not a Python int: a step
    # that makes no update checkpoints this field as it is, and a resume needs its int32 back.
    self.state = self.state.replace(rollout_step=np.asarray(step, self.state.rollout_step.dtype))
    if self.critic is not None:
      self.critic.state = self.critic.state.replace(rollout_step=np.asarray(step, self.critic.state.rollout_step.dtype))
    if self.prefetch is not None and self.prefetch.pending:
      assert self.prefetch.step == step, (self.prefetch.step, step)
      groups, stats, info = self.prefetch.result()
      self.feed = None
    else:
      groups, stats, info = self._collect_stamped(step, None, step)
    self._prefetch_next(step)
    pipelining.mark_stale(groups, step, decoupled=self.cfg.use_decoupled_loss)
    host_memory.release()  # The rollout's buffers, before the update allocates its own.
    c = self.cfg
    train_metrics, timing, adv, token_metrics, batch_tokens, replay = {}, {}, np.zeros((0,)), {}, 0, {}
    if groups is None:
      logging.warning("step %d: no group with mixed correctness; no update", step)
    else:
      batch, adv = adv_lib.to_train_batch(groups, c.prompts_per_step, self.rollout.prompt_len(
          groups.prompt_mask_QP), norm_adv_by_std=c.norm_adv_by_std, overlong_filter=c.overlong_filter,
          estimator=c.adv_estimator, part_weights=tuple(c.gdpo_reward_weights))
      batch_tokens = int(np.asarray(batch.mask_BT).sum())  # the real tokens an update reads
      if batch.routes_BCLk is not None:  # Routing replay: the loss tokens whose experts the sampler recorded.
        recorded_BC = np.asarray(batch.routes_BCLk)[:, :, 0, 0] >= 0
        replay["router/replayed_tokens"] = float(recorded_BC[batch.loss_mask_BC].mean()
                                                 if batch.loss_mask_BC.any() else 0.0)
      token_level = c.adv_estimator in adv_lib.TOKEN_ESTIMATORS
      if token_level:
        self.ckpt.wait()  # The critic's update donates its state too.
        t0 = time.perf_counter()
        batch, value_batch, token_metrics = ppo.token_advantages(
            batch, groups, estimator=c.adv_estimator, logprobs=self.logprobs, trainer=self.trainer,
            params=self.state.params, ref_params=self.ref_params, critic=self.critic, kl_ctrl=self.kl_ctrl,
            Q=c.prompts_per_step, G=c.group_size, gamma=c.gamma, lam=c.lam, teacher=self.teacher,
            logprobs_sum_pi_squared=self.logprobs_sum_pi_squared, logprobs_experts=self.logprobs_experts,
            rollout_correction=c.rollout_correction,
            pack=functools.partial(packing.packed_pass, put=self.trainer.put_batch, **self.pack_args())
            if c.packing else None)
        adv = batch.adv_BC[batch.loss_mask_BC]
        if value_batch is not None:
          t1 = time.perf_counter()
          value_minibatches = self.split(value_batch)
          if c.packing:
            value_minibatches = [packing.packed_microbatches(mb, **self.pack_args(self.critic.trainer))
                                 for mb in value_minibatches]
          vm = self.critic.update(value_minibatches, c.ppo_epochs)
          token_metrics.update({f"critic/{k}": v for k, v in vm.items()
                                if k in ("vf_loss", "vf_clipfrac", "vpred_mean", "grad_norm", "lr")})
          timing["update_critic_s"] = time.perf_counter() - t1
        timing["adv_s"] = time.perf_counter() - t0 - timing.get("update_critic_s", 0.0)
      train_metrics, update_timing = self.update(batch, have_logprobs=token_level)
      timing.update(update_timing)
      host_memory.release()
    if self.feed is not None and self.prefetch.running:  # Partial rollouts: the next step's samples in
      self.feed.publish(self.rollout.sampling_params(self.state.params))  # flight go on with version step + 1.
    step_s = time.perf_counter() - t_step
    m = metrics_lib.step_metrics(
        groups, stats, info, train_metrics, timing, adv, step_s, max_new_tokens=self.rollout.sampler_cfg.max_new_tokens,
        group_size=self.cfg.group_size, reward=self.rollout.reward, skipped=int(self.state.skipped),
        truncated_prompts=self.rollout.truncated_prompts, policy_version=step)
    m.update(token_metrics)
    m.update(replay)
    m.update(self.perf(groups, stats, info, timing, batch_tokens, step_s))
    for k in ("update_critic_s", "adv_s"):
      if k in timing:
        m["timing_s/" + k.removesuffix("_s")] = timing[k]
    return m, info

  def perf(self, groups, stats, info, timing, batch_tokens: int, step_s: float) -> dict:
    """perf/*: host and device memory, generation and update tokens/s, model FLOP/s and MFU."""
    c = self.cfg
    prompt_len = float(groups.prompt_mask_QP.sum(1).mean()) if groups is not None and len(groups) else 0.0
    forward_passes = (c.updates_per_step > 1) + (self.ref_params is not None)  # π_old, reference
    out = metrics_lib.memory()
    out.update(metrics_lib.speed(
        gen_tokens=info["gen_tokens"], gen_s=info["gen_s"],
        prompt_tokens=int(prompt_len * stats.generated * c.group_size),
        update_tokens=batch_tokens * c.ppo_epochs, update_s=timing.get("update_actor_s", 0.0),
        forward_tokens=batch_tokens * forward_passes, step_s=step_s,
        flops_per_token=metrics_lib.matmul_params(self.rollout.model_cfg), peak=self.peak_flops,
        devices=jax.device_count()))
    return out

  def _prefetch_next(self, step: int) -> None:
    """Queues the rollouts of steps up to step + max_staleness not queued yet, all sampled in the
    worker thread by this step's params (version `step`), so a row is trained at most max_staleness
    versions after the one that sampled it. None crosses a periodic checkpoint: the step after it
    is sampled synchronously, by the params the checkpoint holds, so a resume repeats it."""
    c = self.cfg
    if self.prefetch is None:
      return
    first = step + 1 if self.prefetch.last_step is None else self.prefetch.last_step + 1
    todo = []
    for ahead in range(first, min(step + c.max_staleness, c.num_steps - 1) + 1):
      if c.ckpt_every and ahead % c.ckpt_every == 0:
        break
      todo.append(ahead)
    if not todo:
      return
    policy = self.rollout.sampling_params(self.state.params)
    if not self.rollout.owns_copy(self.state.params):
      policy = pipelining.snapshot(policy)  # Before the update donates the state's buffers.
    if c.partial_rollouts:  # (max_staleness=1: one rollout queued at a time)
      policy = self.feed = dynamic_sampling.PolicyFeed(policy)
    for ahead in todo:
      self.prefetch.start(ahead, functools.partial(self._collect_stamped, ahead, policy, step),
                          before=self._rollout_state)

  def _rollout_state(self):
    """What a rollout changes as it runs: the data position, the keep rate and the carried groups."""
    return self.data_iter.state(), self.keep_rate.state(), self.carry

  def _collect_stamped(self, step: int, policy, version: int):
    """`collect`, its groups and the carry it leaves stamped with the sampling policy's version."""
    return pipelining.stamp_collected(self.collect(step, policy), self.carry, version)

  # --- checkpoints ---------------------------------------------------------------------------

  def save(self, next_step: int) -> None:
    data, keep_rate, carry = self._rollout_state()
    if self.prefetch is not None and self.prefetch.pending:
      # A stop mid-step: the rollouts queued are dropped; the resumed run samples those steps again
      # (by the saved params) from the data position, keep rate and carried groups before the oldest.
      data, keep_rate, carry = self.prefetch.drain()
    extra = {"rollout_step": next_step, "data": data, "seed": self.cfg.seed,
             "carry": carry.to_json() if carry is not None else None}
    if self.kl_ctrl is not None:
      extra["kl_coef"] = self.kl_ctrl.value
    extra["keep_rate"] = keep_rate  # How far streaming admits ahead.
    self.ckpt.save(next_step, self.state, extra, critic=self.critic.state if self.critic is not None else None)

  def restore(self) -> int:
    abstract = ckpt_lib.abstract(self.state, self.trainer.state_sharding)
    abstract_critic = None
    if self.critic is not None:
      abstract_critic = ckpt_lib.abstract(self.critic.state, self.critic.trainer.state_sharding)
    restored = self.ckpt.restore_latest(abstract, abstract_critic)  # The newest intact checkpoint.
    if restored is None:
      return 0
    step, self.state, extra = restored[:3]
    if self.critic is not None:
      self.critic.state = restored[3]
    if self.kl_ctrl is not None and "kl_coef" in extra:
      self.kl_ctrl.value = float(extra["kl_coef"])
    if "keep_rate" in extra:
      self.keep_rate.restore(extra["keep_rate"])
    if extra["seed"] != self.cfg.seed:
      raise ckpt_lib.CheckpointMismatchError(
          f"checkpoint {self.ckpt.directory}/{step} was written with seed={extra['seed']}, config has "
          f"seed={self.cfg.seed}")
    self.data_iter.restore(extra["data"])
    self.carry = Groups.from_json(extra["carry"]) if extra["carry"] else None
    if self.carry is not None:  # Vectors saved before they carried their image's shape get it.
      mc = self.trainer.model_cfg
      self.carry.images_QMD = vision_lib.with_shapes(mc.vision, mc.embed_dim, self.carry.images_QMD)
    if extra["carry"] and "logp_QGC" not in extra["carry"]:
      logging.warning("checkpoint %s/%d holds carried groups without their sampling log-probs (an older "
                      "format): their π_old is the current policy's", self.ckpt.directory, step)
    return int(extra["rollout_step"])

  # --- the run -------------------------------------------------------------------------------

  def evaluate(self, params=None) -> dict:
    out = self.evaluator.run(self.state.params if params is None else params)
    host_memory.release()
    return out

  def _dump(self, kind: str, step: int, policy_step: int):
    """Records the rollouts (or held-out samples) of rollout step `step` when it is a dump step."""
    every = self.cfg.dump_rollouts_every
    if self.dumps is None or (step % every and step != self.cfg.num_steps and kind == "step"):
      return contextlib.nullcontext()
    return self.dumps.recording(kind, step, policy_step)

  def run(self) -> dict:
    c = self.cfg
    start = self.restore()
    if start:
      print(f"Resumed from {self.ckpt.directory} at rollout step {start}.", flush=True)
    else:
      with self._dump("eval", 0, 0):
        ev = self.evaluate()
      self.writer.scalars(0, ev)
      print("Held-out before RL: " + metrics_lib.format_eval(ev), flush=True)
    last, profiling = {}, False
    with ckpt_lib.StopRequest() as stop:
      for step in range(start, c.num_steps):
        if c.profile_steps and not profiling and c.profile_steps[0] <= step + 1 <= c.profile_steps[-1]:
          jax.profiler.start_trace(os.path.join(self.workdir, "profile"))
          profiling = True
        with self._dump("step", step + 1, step):
          m, info = self.step(step)
        if int(self.state.bad_streak) >= c.max_bad_steps:
          self.ckpt.wait()
          raise TrainingError(
              f"step {step + 1}: {int(self.state.bad_streak)} updates in a row had a non-finite loss or "
              f"gradient norm and were skipped; stopping. The last good checkpoint is "
              f"{self.ckpt.directory}/{self.ckpt.latest_step()}")
        done = step + 1
        if c.eval_every and (done % c.eval_every == 0 or done == c.num_steps):
          if self.prefetch is not None:
            self.prefetch.wait()  # The evaluator shares the rollout's engine.
          t0 = time.perf_counter()
          with self._dump("eval", done, done):
            m.update(self.evaluate())
          m["timing_s/testing"] = time.perf_counter() - t0
        self.writer.scalars(done, m)
        self.writer.flush()  # A kill -9 loses nothing that was logged.
        if c.log_samples_every and done % c.log_samples_every == 0:
          text = metrics_lib.sample_text(self.rollout.tok, info["texts"], info["first_groups"], c.group_size)
          if text:
            self.writer.text(done, "samples", text)
        if profiling and (done >= c.profile_steps[-1] or done == c.num_steps):
          jax.profiler.stop_trace()  # After the step's metrics are fetched: its device work is in.
          profiling = False
        metrics_lib.console(done, c.num_steps, m, metrics_lib.HEADLINE)
        last = m
        if (c.ckpt_every and done % c.ckpt_every == 0) or done == c.num_steps or stop.signal:
          self.save(done)
        if stop.signal:
          self.ckpt.wait()
          self.writer.flush()
          print(f"Stopped by {stop.signal} after rollout step {done}; checkpoint saved in "
                f"{self.ckpt.directory}. Run the same command again to resume.", flush=True)
          break
      if profiling:
        jax.profiler.stop_trace()
    self.ckpt.wait()
    self.writer.flush()
    return last

