"""Streaming dynamic sampling: a rollout step that admits prompts into the engine only while they
can still be needed, and ends with exactly Q kept groups, all sampled by the current policy.

    admit prompts while kept + in flight < Q (and the step's prompt cap is not reached)
      ──► the engine decodes; a group whose G samples have ended is scored at once, in a thread,
          while the engine goes on decoding (its reward latency is hidden)
      ──► a group with mixed values (Eq. 11) is kept; one that is not frees its place: admit another
    stop when Q groups are kept (none thrown away, none carried to the next step)

The prompts admitted are a prefix of the data order and each prompt's samples depend only on
(step key, prompt number, sample index), so the kept groups do not depend on the number of slots
or on timing; they are returned in prompt order. `dapo.streaming=False` restores the reference:
whole generation batches, then the filter (`fill_batch`, below).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from dapo_jax.data import prompts as data_lib
from dapo_jax.datatypes import Groups
from dapo_jax.rollout import engine as engine_lib
from dapo_jax.rollout.rollout import Rollout


def keep_groups(values_QG: np.ndarray) -> np.ndarray:
  """Dynamic sampling: keep a prompt iff its values differ (verl: population std > 0), or G == 1."""
  v = np.asarray(values_QG, np.float64)
  if v.shape[1] == 1:
    return np.ones(v.shape[0], bool)
  # max > min is std > 0 in exact arithmetic; np.std of equal floats can come out 1e-17, not 0.
  return v.max(axis=1) > v.min(axis=1)


class DynamicSamplingCapError(RuntimeError):
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
  """Dynamic sampling (DAPO_SPEC §2.2): keeps groups whose `filter_QG` values differ, generating
  batch after batch (`generate(i)` makes the i-th) until Q are kept or `max_gen_batches` were made.

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
    keep = keep_groups(groups.filter_QG) if filter_groups else np.ones(len(groups), bool)
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
  """FillStats, plus what streaming adds."""
  admitted: int = 0            # prompts admitted into the engine this step
  max_in_flight: int = 0       # most groups admitted but not yet scored at one time
  reward_wait_s: float = 0.0   # time the loop waited for scores (the rest overlapped decoding)
  reward_s: float = 0.0        # time the scorer worked
  slot_utilisation: float = 0.0


def stream_groups(rollout: Rollout, params, next_examples: Callable[[int], Sequence[data_lib.Example]], G: int,
                  Q: int, key, *, max_prompts: int = 0, filter_groups: bool = True, on_cap: str = "train",
                  admit_chunk: int = 1) -> tuple[Groups | None, StreamStats, dict]:
  """Samples and scores prompts until Q groups are kept, or `max_prompts` were admitted (0 = no
  cap; then it returns what was kept, `stats.cap_reached`, or raises with `on_cap="raise"`).
  `next_examples(n)` gives the next n prompts in data order. One process: with several, the loop
  uses whole generation batches."""
  eng = rollout.engine(rollout.sampler_cfg, Q * G)
  session = eng.session(params, key, rollout.episodes)
  stats = StreamStats()
  pending: dict[int, dict] = {}     # prompt number -> its prompt, examples and ended samples
  kept: dict[int, Groups] = {}
  scoring: list[tuple[list[int], cf.Future, int]] = []   # (prompt numbers, scores, round submitted)
  pool = cf.ThreadPoolExecutor(1, thread_name_prefix="reward")
  texts = None
  t_start = time.perf_counter()

  def admit() -> None:
    examples = list(next_examples(admit_chunk))
    prompt_QP, mask_QP, truncated = rollout.encode_counting(examples)
    rollout.truncated_prompts += truncated
    ids = list(range(stats.admitted, stats.admitted + len(prompt_QP)))
    for i, pid in enumerate(ids):
      pending[pid] = {"prompt": prompt_QP[i], "mask": mask_QP[i], "samples": {}, "example": examples[i]}
      if rollout.episodes is not None:
        rollout.episodes.register(pid, examples[i])
    stop = rollout.length_hook(len(ids) * G) if rollout.length_hook else None
    session.add(ids, prompt_QP, mask_QP, G, stop)
    stats.admitted += len(ids)

  def collect(keep_last: bool) -> None:
    """Scores of finished groups: kept or dropped. Waits for every submitted scoring but, with
    `keep_last`, the latest round's, which overlaps the next decode round. Collecting at these
    fixed points keeps the admissions, and so the samples, independent of the scorer's speed."""
    nonlocal texts
    while len(scoring) > (1 if keep_last and scoring and scoring[-1][2] == session.rounds else 0):
      pids, fut, _ = scoring.pop(0)
      t0 = time.perf_counter()
      results = fut.result()
      stats.reward_wait_s += time.perf_counter() - t0
      for pid, (groups, group_texts, reward_s) in zip(pids, results):
        stats.reward_s += reward_s
        stats.generated += 1
        stats.acc_sum += float(groups.acc_QG.mean())
        stats.all_correct += int(groups.acc_QG.all())
        stats.all_wrong += int((~groups.acc_QG).all())
        if texts is None:
          texts = (group_texts, groups)
        if not filter_groups or keep_groups(groups.filter_QG)[0]:
          kept[pid] = groups
          stats.kept += 1

  def in_flight() -> int:  # Admitted groups not yet scored (decoding or being scored).
    return len(pending) + sum(len(pids) for pids, _, _ in scoring)

  try:
    while True:
      collect(keep_last=True)
      capped = max_prompts and stats.admitted >= max_prompts
      while len(kept) + in_flight() < Q and not capped:
        admit()
        capped = max_prompts and stats.admitted >= max_prompts
      if capped:
        session.close()  # Nothing more comes: the tail may compact.
      stats.max_in_flight = max(stats.max_in_flight, in_flight())
      if not session.busy:
        if scoring:
          collect(keep_last=False)
          continue
        break
      ended = session.step()
      done = []
      for f in ended:
        entry = pending[f.prompt_id]
        entry["samples"][f.sample] = f
        if len(entry["samples"]) == G:
          done.append(f.prompt_id)
      if done:
        groups = [_group(pending.pop(pid), G, eng.C) for pid in done]
        scoring.append((done, pool.submit(_score_groups, rollout, groups), session.rounds))
    collect(keep_last=False)
  finally:
    pool.shutdown(wait=True)
  stats.gen_batches = 1
  stats.cap_reached = bool(len(kept) < Q and max_prompts and stats.admitted >= max_prompts)
  if stats.cap_reached and on_cap == "raise":
    raise DynamicSamplingCapError(
        f"dynamic sampling: {stats.admitted} prompts (dapo.max_gen_batches x dapo.gen_prompts) kept only "
        f"{stats.kept} of {Q} groups; the data is too easy or too hard")
  s = session.stats()
  stats.slot_utilisation = s["slot_utilisation"]
  info = {"gen_s": time.perf_counter() - t_start - stats.reward_wait_s, "reward_s": stats.reward_s,
          "gen_tokens": s["generated_tokens"], "texts": texts[0] if texts else None,
          "first_groups": texts[1] if texts else None, "engine": s}
  if not kept:
    return None, stats, info
  order = sorted(kept)[:Q]
  return Groups.concat([kept[pid] for pid in order]), stats, info


def _group(entry: dict, G: int, C: int) -> dict:
  rows = [entry["samples"][g] for g in range(G)]
  return {"example": entry["example"], "prompt": entry["prompt"], "mask": entry["mask"],
          "samples": engine_lib.stack(rows, C),
          "rewards": None if rows[0].policy_C is None else [r.reward for r in rows]}  # Episodes' own.


def _score_groups(rollout: Rollout, groups: list[dict]) -> list[tuple[Groups, list[str], float]]:
  """Scores finished groups (in the reward thread, while the engine decodes)."""
  out = []
  for g in groups:
    t0 = time.perf_counter()
    s = g["samples"]
    G = s.tokens_BC.shape[0]
    scored = rollout.score([g["example"]], s, G, g["rewards"])
    groups = Groups.from_samples(g["prompt"][None], g["mask"][None], s, scored["score"], scored["acc"],
                                 scored["filter"])
    out.append((groups, scored["texts"], time.perf_counter() - t0))
  return out

