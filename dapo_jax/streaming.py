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
whole generation batches, then the filter (`advantages.fill_batch`).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from dapo_jax import advantages as adv_lib
from dapo_jax import data as data_lib
from dapo_jax import engine as engine_lib
from dapo_jax.datatypes import Groups
from dapo_jax.rollout import Rollout


@dataclasses.dataclass
class StreamStats(adv_lib.FillStats):
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
  cap; then it returns what was kept, `stats.cap_reached`, or raises with `on_cap="raise"`). `next_examples(n)` gives the next n
  prompts in data order. One process: with several, the loop uses whole generation batches."""
  eng = rollout.engine(rollout.sampler_cfg, Q * G)
  session = eng.session(params, key)
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
        if not filter_groups or adv_lib.keep_groups(groups.filter_QG)[0]:
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
    raise adv_lib.DynamicSamplingCapError(
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
          "samples": engine_lib.stack(rows, C)}


def _score_groups(rollout: Rollout, groups: list[dict]) -> list[tuple[Groups, list[str], float]]:
  """Scores finished groups (in the reward thread, while the engine decodes)."""
  out = []
  for g in groups:
    t0 = time.perf_counter()
    s = g["samples"]
    G, C = s.tokens_BC.shape
    scored = rollout.score([g["example"]], s, G)
    out.append((Groups(prompt_QP=g["prompt"][None], prompt_mask_QP=g["mask"][None],
                       tokens_QGC=s.tokens_BC[None], mask_QGC=s.mask_BC[None], length_QG=s.length_B[None],
                       truncated_QG=s.truncated_B[None], score_QG=scored["score"], acc_QG=scored["acc"],
                       filter_QG=scored["filter"], logp_QGC=s.logp_BC[None], carried_Q=np.zeros(1, bool)),
                scored["texts"], time.perf_counter() - t0))
  return out
