"""Streaming dynamic sampling: a rollout step that admits prompts into the engine as they may be
needed, and ends as soon as the first Q kept groups in prompt order are known, all sampled by the
current policy.

    admit prompts ahead: while the expected keeps of those in flight (at the running keep rate)
    may fall short of Q (and the step's prompt cap is not reached)
      ──► the engine decodes; a group whose G samples have ended is scored at once, in a thread,
          while the engine goes on decoding (its reward latency is hidden)
      ──► a group with mixed values (Eq. 11) is kept
    stop when prompts 0..m-1 are all scored and Q of them are kept: the rest are cancelled and
    go back to the front of the data stream (none thrown away, none carried to the next step)

The step consumes the shortest prefix of the data order holding Q kept groups, and each prompt's
samples depend only on (step key, prompt number, sample index), so the kept groups are a function
of the key and the data order alone: not of the number of slots, of how far ahead prompts were
admitted, or of timing; they are returned in prompt order. Every host of a multi-process run
takes the same decisions. `dapo.streaming=False` restores the reference: whole generation
batches, then the filter (`fill_batch`, below).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import threading
import time
from typing import Callable

import numpy as np

from dapo_jax import errors
from dapo_jax.data import prompts as data_lib
from dapo_jax.datatypes import Groups
from dapo_jax.rollout import engine as engine_lib
from dapo_jax.rollout.rollout import Rollout


def keep_groups(values_QG: np.ndarray, valid_QG: np.ndarray | None = None) -> np.ndarray:
  """Dynamic sampling: keep a prompt iff its values differ (verl: population std > 0), or G == 1.
  `valid_QG` (`Groups.valid_QG`): only those rows count, as if the others were absent (one left: kept,
  as a group of one; none: dropped)."""
  v = np.asarray(values_QG, np.float64)
  if valid_QG is not None and not np.all(valid_QG):
    valid = np.asarray(valid_QG, bool)
    hi, lo = np.where(valid, v, -np.inf).max(axis=1), np.where(valid, v, np.inf).min(axis=1)
    n = valid.sum(axis=1)
    return (n == 1) | ((n > 1) & (hi > lo))
  if v.shape[1] == 1:
    return np.ones(v.shape[0], bool)
  # max > min is std > 0 in exact arithmetic; np.std of equal floats can come out 1e-17, not 0.
  return v.max(axis=1) > v.min(axis=1)


class DynamicSamplingCapError(errors.UserError, RuntimeError):
  """Dynamic sampling reached `dapo.max_gen_batches` short of Q groups, with `dapo.on_cap="raise"`."""


@dataclasses.dataclass
class FillStats:
  """What dynamic sampling saw in one rollout step (generated groups, before the filter)."""
  gen_batches: int = 0
  generated: int = 0
  kept: int = 0
  all_correct: int = 0
  all_wrong: int = 0
  acc_sum: float = 0.0        # sum over generated groups of their mean accuracy
  cap_reached: bool = False


def fill_batch(carry: Groups | None, generate: Callable[[int], Groups], Q: int, *, filter_groups: bool,
               max_gen_batches: int, on_cap: str, carry_over: bool) -> tuple[Groups | None, Groups | None, FillStats]:
  """Dynamic sampling (paper §3.2, as the reference trainer loops): keeps groups whose `filter_QG` values
  differ, generating batch after batch (`generate(i)` makes the i-th) until Q are kept or
  `max_gen_batches` were made.

  Returns (batch, carry, stats): the first Q kept groups in arrival order (after any carried ones),
  None if none was kept; `carry` holds the surplus when `carry_over` (else it is dropped), marked
  `carried_Q` so that its π_old is the log-probs of the policy that sampled it. At the cap,
  `on_cap="raise"` raises DynamicSamplingCapError and "train" returns what was kept.
  """
  kept = [carry] if carry is not None and len(carry) else []
  n_kept = sum(len(k) for k in kept)
  stats = FillStats()
  while n_kept < Q:
    if filter_groups and max_gen_batches > 0 and stats.gen_batches >= max_gen_batches:
      if on_cap == "raise":
        raise DynamicSamplingCapError(
            f"dynamic sampling: {stats.gen_batches} generation batches (dapo.max_gen_batches) kept only "
            f"{n_kept} of {Q} groups; the data is too easy or too hard")
      stats.cap_reached = True
      break
    groups = generate(stats.gen_batches)
    stats.gen_batches += 1
    keep = keep_groups(groups.filter_QG, groups.valid_QG) if filter_groups else np.ones(len(groups), bool)
    stats.generated += len(groups)
    stats.kept += int(keep.sum())
    stats.acc_sum += float(groups.acc_QG.mean()) * len(groups)
    stats.all_correct += int(groups.acc_QG.all(1).sum())
    stats.all_wrong += int((~groups.acc_QG).all(1).sum())
    if keep.any():
      kept.append(groups.take(np.flatnonzero(keep)))
      n_kept += int(keep.sum())
  if not kept:
    return None, None, stats
  batch = Groups.concat(kept)
  carry = None
  if carry_over and len(batch) > Q:
    carry = dataclasses.replace(batch.take(slice(Q, None)), carried_Q=np.ones(len(batch) - Q, bool))
  return batch.take(slice(0, Q)), carry, stats



def fill_step(rollout: Rollout, params: Callable[[], object], next_batch: Callable[[int], list], carry: Groups | None,
              step_key, *, Q: int, G: int, batch_prompts: int, filter_groups: bool, max_gen_batches: int,
              on_cap: str, carry_over: bool) -> tuple[Groups | None, Groups | None, FillStats, dict]:
  """A rollout step of the reference: generation batches of `batch_prompts` prompts through
  `fill_batch`. `params()` places the policy for the sampler on first use (carried groups may fill
  the step alone). Returns (the step's groups, the next carry, stats, generation info)."""
  info = {"gen_s": 0.0, "reward_s": 0.0, "gen_tokens": 0, "texts": None, "first_groups": None}
  placed = []

  def generate(i: int) -> Groups:
    if not placed:
      placed.append(params())
    groups, gen_info = rollout.generation_batch(placed[0], next_batch(batch_prompts), G, step_key, i)
    for k in ("gen_s", "reward_s", "gen_tokens"):
      info[k] += gen_info[k]
    if info["texts"] is None:
      info["texts"], info["first_groups"] = gen_info["texts"], groups
    return groups

  batch, carry, stats = fill_batch(carry, generate, Q, filter_groups=filter_groups, max_gen_batches=max_gen_batches,
                                   on_cap=on_cap, carry_over=carry_over)
  return batch, carry, stats, info


@dataclasses.dataclass
class StreamStats(FillStats):
  """FillStats (of the prompts the step consumed), plus what streaming adds."""
  admitted: int = 0            # prompts the step consumed: the shortest prefix of the data order holding Q kept
  returned: int = 0            # prompts admitted ahead but not needed: back to the front of the data stream
  max_in_flight: int = 0       # most groups admitted but not yet scored at one time
  reward_wait_s: float = 0.0   # time the loop waited for scores (the rest overlapped decoding)
  reward_s: float = 0.0        # time the scorer worked
  slot_utilisation: float = 0.0


@dataclasses.dataclass
class KeepRate:
  """A running estimate of the fraction of groups dynamic sampling keeps, for admitting ahead: a
  mean over the recent groups (each older group weighs `decay` times less). It decides only how
  far ahead prompts are admitted, never which groups are kept. Starts at 1/2."""
  kept: float = 1.0
  seen: float = 2.0
  decay: float = 0.97

  def update(self, kept: int) -> None:
    self.kept, self.seen = self.kept * self.decay + kept, self.seen * self.decay + 1

  @property
  def value(self) -> float:
    return min(max(self.kept / self.seen, 0.05), 1.0)

  def state(self) -> list[float]:
    """What a checkpoint saves: a resumed run then admits ahead as the uninterrupted one."""
    return [self.kept, self.seen]

  def restore(self, state) -> None:
    self.kept, self.seen = map(float, state)


def stream_groups(rollout: Rollout, params, data, G: int, Q: int, key, *, max_prompts: int = 0,
                  filter_groups: bool = True, on_cap: str = "train", keep_rate: KeepRate | None = None,
                  ahead: bool = True, margin: float = 1.0) -> tuple[Groups | None, StreamStats, dict]:
  """Samples and scores prompts of `data` (`take(n)`: the next n of the data order, the same on
  every host; `rewind(n)`: give back the last n) until the first Q kept groups in prompt order are
  known, or `max_prompts` were consumed (0 = no cap; then it returns what was kept,
  `stats.cap_reached`, or raises with `on_cap="raise"`).

  The step consumes the shortest prefix of the data order that holds Q kept groups, and each
  prompt's samples depend only on (key, prompt number, sample index): the groups returned, in
  prompt order, are a function of the key and the data order alone, whatever the slots, reward
  latency or admission. `ahead` admits beyond the groups still needed (by `keep_rate`, with a safety
  `margin` in standard deviations of the keeps); the prompts admitted past that prefix are cancelled
  at the end and rewound.
  Without `ahead` (and always with episodes, whose environments act), prompts are admitted only
  while kept + in flight < Q. With several processes every host runs the same step in lockstep
  (scores are collected at fixed rounds, so every host admits alike); every host scores
  every group."""
  feed = params if isinstance(params, PolicyFeed) else None
  eng = rollout.engine(rollout.sampler_cfg, Q * G)
  session = eng.session(feed.params if feed else params, key, rollout.episodes)
  step = _StreamingStep(rollout, session, G, Q, max_prompts=max_prompts, feed=feed,
                        filter_groups=filter_groups, keep_rate=keep_rate or KeepRate(),
                        ahead=ahead and rollout.episodes is None, margin=margin, C=eng.C)
  t_start = time.perf_counter()
  try:
    step.run(data)
  finally:
    step.pool.shutdown(wait=True, cancel_futures=True)
    if rollout.episodes is not None:  # Episodes of groups the step did not wait for end here, unused.
      rollout.episodes.abandon()
  stats = step.stats
  if stats.cap_reached and on_cap == "raise":
    raise DynamicSamplingCapError(
        f"dynamic sampling: {stats.admitted} prompts (dapo.max_gen_batches x dapo.gen_prompts) kept only "
        f"{stats.kept} of {Q} groups; the data is too easy or too hard")
  s = step.session.stats()
  stats.slot_utilisation = s["slot_utilisation"]
  first = step.scored.get(0)
  info = {"gen_s": time.perf_counter() - t_start - stats.reward_wait_s, "reward_s": stats.reward_s,
          "gen_tokens": s["generated_tokens"], "texts": first[1] if first else None,
          "first_groups": first[0] if first else None, "engine": s}
  kept = [pid for pid in range(stats.admitted) if step.kept.get(pid)]
  if not kept:
    return None, stats, info
  return Groups.concat([step.scored[pid][0] for pid in kept]), stats, info


class _StreamingStep:
  """The state of one streamed rollout step: prompts admitted in data order (prompt number =
  admission index), their samples as they end, their scores, and the frontier: the longest prefix
  of prompt numbers whose groups are all scored."""

  def __init__(self, rollout: Rollout, session, G: int, Q: int, *, max_prompts: int, filter_groups: bool,
               keep_rate: KeepRate, ahead: bool, C: int, feed: "PolicyFeed | None" = None, margin: float = 1.0):
    self.rollout, self.session, self.G, self.Q, self.C, self.feed = rollout, session, G, Q, C, feed
    self.max_prompts, self.filter_groups, self.keep_rate, self.ahead = max_prompts, filter_groups, keep_rate, ahead
    self.margin = margin
    self.stats = StreamStats()
    self.pending: dict[int, dict] = {}          # prompt number -> its prompt, example and ended samples
    # (prompt numbers, their scores, the round they were submitted in)
    self.scoring: list[tuple[list[int], cf.Future, int]] = []
    self.scored: dict[int, tuple[Groups, list[str], float, list]] = {}
    self.kept: dict[int, bool] = {}             # prompt number -> dynamic sampling kept its group
    self.truncated: dict[int, int] = {}         # prompt number -> 1 if it lost its beginning to max_prompt_len
    self.admitted = 0                           # prompts taken from the data stream
    self.frontier, self.frontier_kept = 0, 0    # prompts 0..frontier-1 are scored; how many were kept
    self.pool = cf.ThreadPoolExecutor(1, thread_name_prefix="reward")

  # --- the loop ------------------------------------------------------------------------------

  def run(self, data) -> None:
    """Decodes, scores and admits until the frontier holds Q kept groups (or the cap); then gives
    the prompts admitted past the frontier back to `data`."""
    session = self.session
    while not self.done():
      self.collect(keep_last=True)
      if self.done():
        break
      while self.wants_more():
        self.admit(data)
      if self.capped():
        session.close()  # Nothing more comes: the tail may compact.
      self.stats.max_in_flight = max(self.stats.max_in_flight, self.in_flight())
      if not session.busy:
        if not self.scoring:
          break
        self.collect(keep_last=False)
        continue
      if self.feed is not None and (new := self.feed.take()) is not None:
        session.update_params(new)  # Partial rollouts: newer params take over the samples in flight.
      done = []
      for f in session.step():
        entry = self.pending[f.prompt_id]
        entry["samples"][f.sample] = f
        if len(entry["samples"]) == self.G:
          done.append(f.prompt_id)
      if done:
        groups = [_group(self.pending.pop(pid), self.G, self.C) for pid in done]
        # Every host scores every group: each then decides alike without a collective in the loop.
        self.scoring.append((done, self.pool.submit(_score_groups, self.rollout, groups), session.rounds))
    end = self.frontier
    self.stats.returned = self.admitted - end
    if self.stats.returned:  # Admitted ahead, not needed: back to the data stream (unscored ones are dropped).
      data.rewind(self.stats.returned)
    self.stats.admitted = end
    self.stats.gen_batches = 1
    self.stats.cap_reached = bool(self.frontier_kept < self.Q and self.max_prompts and end >= self.max_prompts)
    self.account(end)

  def done(self) -> bool:
    return self.frontier_kept >= self.Q or bool(self.max_prompts and self.frontier >= self.max_prompts)

  def capped(self) -> bool:
    return bool(self.max_prompts and self.admitted >= self.max_prompts)

  def in_flight(self) -> int:
    """Admitted groups not yet scored (queued, decoding or being scored)."""
    return self.admitted - len(self.scored)

  def wants_more(self) -> bool:
    """Admit while the groups in flight may not make up the Q kept ones; ahead, while their
    expected keeps (at the running keep rate) fall short of those still needed by `margin`
    standard deviations. Not further: a prompt admitted in vain costs its prefill and decode."""
    if self.capped():
      return False
    kept = sum(self.kept.values())
    flight = self.in_flight()
    if not self.ahead or not self.filter_groups:
      return kept + flight < self.Q
    need = max(self.Q - kept, 0)
    if flight >= 4 * max(self.Q, self.session.e.S // self.G):  # Bounds the queue on data that keeps little.
      return False
    p = self.keep_rate.value
    return p * flight < need + self.margin * (need * p * (1 - p)) ** 0.5 + 0.5

  def admit(self, data) -> None:
    rollout = self.rollout
    examples = list(data.take(1))
    prompt_QP, mask_QP, truncated = rollout.encode_counting(examples)
    images_QMD, kept = rollout.image_inputs(self.session.params, examples)
    ids = list(range(self.admitted, self.admitted + len(prompt_QP)))
    for i, pid in enumerate(ids):
      self.pending[pid] = {"prompt": prompt_QP[i], "mask": mask_QP[i], "samples": {}, "example": examples[i],
                           "images": None if images_QMD is None else np.asarray(images_QMD[i]),
                           "kept": {k: x[i] for k, x in kept.items()}}
      self.truncated[pid] = truncated
      if rollout.episodes is not None:
        rollout.episodes.register(pid, examples[i])
    stop = rollout.length_hook(len(ids) * self.G) if rollout.length_hook else None
    self.session.add(ids, prompt_QP, mask_QP, self.G, stop, images_QMD=images_QMD)
    self.admitted += len(ids)

  def collect(self, keep_last: bool) -> None:
    """Scores of finished groups: kept or dropped. Waits for every submitted scoring but, with
    `keep_last`, the latest round's, which overlaps the next decode round. Collecting at these
    fixed points keeps the admissions independent of the scorer's speed (every host alike)."""
    latest = self.session.rounds
    while len(self.scoring) > (1 if keep_last and self.scoring and self.scoring[-1][-1] == latest else 0):
      pids, fut, _ = self.scoring.pop(0)
      t0 = time.perf_counter()
      results = fut.result()
      self.stats.reward_wait_s += time.perf_counter() - t0
      for pid, result in zip(pids, results):
        groups = result[0]
        self.stats.reward_s += result[2]
        self.scored[pid] = result
        self.kept[pid] = not self.filter_groups or bool(keep_groups(groups.filter_QG, groups.valid_QG)[0])
        self.keep_rate.update(int(self.kept[pid]))
    while self.frontier in self.scored and self.frontier_kept < self.Q:
      self.frontier_kept += self.kept[self.frontier]
      self.frontier += 1

  def account(self, end: int) -> None:
    """FillStats of the prompts the step consumed (0..end-1): independent of how far it ran ahead."""
    s = self.stats
    for pid in range(end):
      groups, _, _, report = self.scored[pid]
      for call in report:  # The data stream's watchers hear of the consumed groups alone, in prompt order.
        call()
      s.generated += 1
      s.kept += int(self.kept[pid])
      s.acc_sum += float(groups.acc_QG.mean())
      s.all_correct += int(groups.acc_QG.all())
      s.all_wrong += int((~groups.acc_QG).all())
      self.rollout.truncated_prompts += self.truncated[pid]


class PolicyFeed:
  """The params a streamed rollout samples with, and newer ones handed to it while it runs (partial
  rollouts, `rollout.partial_rollouts`): `publish` from the training thread, `take` from the rollout's
  between rounds (the newest published, once; None when there is nothing new)."""

  def __init__(self, params):
    self.params = params
    self._new = None
    self._lock = threading.Lock()

  def publish(self, params) -> None:
    with self._lock:
      self._new = params

  def take(self):
    with self._lock:
      new, self._new = self._new, None
    return new


def _group(entry: dict, G: int, C: int) -> dict:
  rows = [entry["samples"][g] for g in range(G)]
  return {"example": entry["example"], "prompt": entry["prompt"], "mask": entry["mask"], "images": entry["images"],
          "kept": entry["kept"],
          "samples": engine_lib.stack(rows, C),
          "rewards": None if rows[0].policy_C is None else [r.reward for r in rows]}  # Episodes' own.


def _score_groups(rollout: Rollout, groups: list[dict]) -> list[tuple[Groups, list[str], float, list]]:
  """(scored groups, texts, seconds, the calls that report them to the data's watchers) of finished
  groups (in the reward thread, while the engine decodes)."""
  out = []
  for g in groups:
    t0 = time.perf_counter()
    s = g["samples"]
    G = s.tokens_BC.shape[0]
    with data_lib.deferred_watch() as report:
      scored = rollout.score([g["example"]], s, G, g["rewards"])
    out.append((_groups(g, scored["score"], scored["acc"], scored["filter"], scored["valid"], scored["parts"]),
                scored["texts"], time.perf_counter() - t0, report))
  return out


def _groups(g: dict, score_QG, acc_QG, filter_QG, valid_QG=None, parts_QGK=None) -> Groups:
  images = None if g["images"] is None else g["images"][None]
  kept = {k: x[None] for k, x in g.get("kept", {}).items()}  # The tower trains: the pixels (and grids).
  return Groups.from_samples(g["prompt"][None], g["mask"][None], g["samples"], score_QG, acc_QG, filter_QG, valid_QG,
                             images, parts_QGK, **kept)
