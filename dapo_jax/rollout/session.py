"""The host side of continuous batching: a `Session` holds which slot runs which sample, when each of
the pool's programs (`slots`) runs, and, with the paged layout, which pages each sample holds.

`engine.Engine` owns what sessions share (the compiled programs, the widths, the page pool's size);
a session is one stream of samples on it: `add` queues samples, `step` runs one round (insert,
decode, harvest) and returns the finished ones, `close` says no more will come.
"""
from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dapo_jax import sharding
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.model import transformer as model_lib
from dapo_jax.rollout import sampling, slot_pages
from dapo_jax.rollout import slots as slots_lib


@dataclasses.dataclass
class Finished:
  """One ended sample, on the host."""
  prompt_id: int
  sample: int
  tokens_C: np.ndarray
  logp_C: np.ndarray
  length: int
  truncated: bool          # no EOS within the budget
  policy_C: np.ndarray | None = None   # episodes: the tokens the policy sampled (the rest: observations)
  reward: dict | None = None           # episodes: the environment's final reward
  turns: int = 1
  # Partial rollouts: the first token drawn by the params of `Session.update_params` (-1: none was;
  # 0: all were). The tokens before it were drawn by the session's earlier params.
  switch_at: int = -1
  experts_CLk: np.ndarray | None = None  # routing replay: each fed token's experts (`slots.SlotState`)


@dataclasses.dataclass
class _Work:
  prompt_id: int
  sample: int
  prompt_P: np.ndarray
  mask_P: np.ndarray
  stop_at: int
  key_id: int                      # the sample's key is (session key, key_id, sample)
  max_tokens: int                  # the sample (an episode: each turn) draws at most this many tokens
  temperature: float
  top_p: float
  paused: bool = False             # episodes: waiting for its environment
  last: Finished | None = None     # episodes: the episode so far, at its last turn's end
  switch_at: int = -1              # partial rollouts: its first token drawn by updated params (`Finished`)
  images_MD: jax.Array | None = None  # a vision-language model's prompt: its image vectors, in placeholder order


@dataclasses.dataclass
class _Prefill:
  """Prompts run through the model by one insert (on the device), kept while samples of them wait."""
  logits_UV: jax.Array
  k_LUKPH: jax.Array
  v_LUKPH: jax.Array
  mask_UP: jax.Array
  row: dict[int, int]              # prompt id -> its row u
  prompts: dict[int, np.ndarray]   # prompt id -> its (left-padded) tokens, to check a reuse
  real_UP: np.ndarray | None = None  # paged: mask_UP on the host (which pages hold prompt tokens)
  # Paged: (prompt id, batch shard) -> the pages of its prompt's whole pages in that shard's pool, written
  # by its first sample to start there and held by this prefill while more wait, so that they share them.
  pages: dict[tuple[int, int], list[int]] = dataclasses.field(default_factory=dict)


def _buckets(n: int) -> list[int]:
  """Powers of two up to n, and n: the row counts an insert compiles for."""
  out = [1]
  while out[-1] * 2 < n:
    out.append(out[-1] * 2)
  return sorted(set(out + [n]))


def stack(rows: list[Finished], C: int) -> sampling.Samples:
  length_B = np.array([r.length for r in rows], np.int32)
  mask_BC = np.arange(C)[None, :] < length_B[:, None]
  policy_BC = None if rows[0].policy_C is None else np.stack([r.policy_C for r in rows]) & mask_BC
  switch = np.array([r.switch_at for r in rows], np.int32)
  experts = None
  if rows[0].experts_CLk is not None:  # A token past the sample's end was not fed: no record.
    experts = np.where(mask_BC[:, :, None, None], np.stack([r.experts_CLk for r in rows]), -1).astype(np.int32)
  return sampling.Samples(tokens_BC=np.stack([r.tokens_C for r in rows]), logp_BC=np.stack([r.logp_C for r in rows]),
                          mask_BC=mask_BC, length_B=length_B, truncated_B=np.array([r.truncated for r in rows], bool),
                          policy_BC=policy_BC, switch_B=switch if (switch >= 0).any() else None,
                          experts_BCLk=experts)


class Session:
  """One use of the engine with fixed params and key: `add` queues samples, `step` runs one round
  (insert, compact once closed, decode, harvest) and returns the samples that ended in it."""

  def __init__(self, engine, params, key, episodes=None):  # engine: the `engine.Engine` it runs on
    """`episodes` (an `episodes.EpisodeDriver`) makes every sample an episode: a slot whose turn ends
    keeps its row while the driver runs the environment, then continues with the observation's
    tokens or ends; `step` returns whole episodes."""
    self.e = engine
    self.episodes = episodes
    self.turn_start: dict[tuple[int, int], int] = {}  # Episodes: where each one's current turn began.
    self.turns: dict[tuple[int, int], int] = {}
    self.paused = 0
    self.params = params
    self.dparams = slots_lib.decode_params(engine.model_cfg, params)
    self.updated = False  # `update_params` was called: samples started from now on are all the new params'.
    self.rep = sharding.replicated(engine.mesh)
    self.key_data = sharding.put(np.asarray(jax.random.key_data(key)), self.rep)
    self.state = engine.empty_state()
    self.queue: collections.deque[_Work] = collections.deque()
    self.prefills: dict[int, _Prefill] = {}  # prompt id -> its prefill, while samples of it wait
    self.slot_work: list[_Work | None] = [None] * engine.S  # One entry per row of the current width.
    self.drawn = np.zeros(engine.S, np.int32)  # Tokens each row's sample had drawn at the last harvest.
    self.decode_steps = 0
    self.slot_steps = 0    # Rows computed: each decode step counts the width it ran at.
    self.generated = 0
    self.samples = 0
    self.prefilled = 0     # Prompts run through the model (a prompt whose samples wait is run once).
    self.prefilled_tokens = 0  # Their tokens that the model computed (a shared or cached prefix's once, or none).
    self.rounds = 0
    self.resizes = 0
    self.closed = False
    # Paged: each shard's pool, and the pages each slot's sample holds.
    self.pages = slot_pages.SlotPages(engine, engine.S, episodes is not None) if engine.paged else None

  @property
  def busy(self) -> bool:
    return bool(self.queue) or any(w is not None for w in self.slot_work)

  @property
  def in_flight(self) -> int:
    return sum(w is not None for w in self.slot_work)

  @property
  def width(self) -> int:
    return len(self.slot_work)

  def add(self, prompt_ids, prompt_QP, prompt_mask_QP, G: int, stop_at_B=None, *, key_ids=None,
          max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
          images_QMD=None) -> None:
    """Queues G samples of each prompt (prompt_QP left-padded to the engine's prompt length).
    Sample g of prompt q draws from key (session key, key_ids[q], g) (default: its prompt id) and at
    most `max_tokens` tokens (default: the turn budget); `temperature` and `top_p` apply to an
    engine whose sampler is `per_request` (default: the sampler's). `images_QMD`: each prompt's image
    vectors (a vision-language model: `vision.image_features`), which its prefill places."""
    if self.closed:
      raise RuntimeError("samples added to a closed engine session")
    P = self.e.P
    if prompt_QP.shape[1] > P:
      raise ValueError(f"prompts of {prompt_QP.shape[1]} tokens do not fit the engine's {P}-token prompt cache")
    pad = P - prompt_QP.shape[1]
    prompt_QP = np.pad(np.asarray(prompt_QP, np.int32), ((0, 0), (pad, 0)))
    prompt_mask_QP = np.pad(np.asarray(prompt_mask_QP, bool), ((0, 0), (pad, 0)))
    sc = self.e.sampler_cfg
    if not sc.per_request and (temperature, top_p) != (None, None):
      raise ValueError("per-sample temperature or top_p needs an engine whose sampler is per_request")
    budget = self.e.turn_tokens if max_tokens is None else min(int(max_tokens), self.e.turn_tokens)
    temperature = sc.temperature if temperature is None else float(temperature)
    top_p = sc.top_p if top_p is None else float(top_p)
    for q, pid in enumerate(prompt_ids):
      key_id = int(pid if key_ids is None else key_ids[q])
      for g in range(G):
        stop = self.e.C + 1 if stop_at_B is None else int(stop_at_B[q * G + g])
        self.queue.append(_Work(int(pid), g, prompt_QP[q], prompt_mask_QP[q], stop, key_id, budget, temperature,
                                top_p, switch_at=0 if self.updated else -1,
                                images_MD=None if images_QMD is None else images_QMD[q]))

  def update_params(self, params) -> None:
    """Partial rollouts: the samples in flight continue with `params` from the token after next on
    (the next one's logits were computed with the last token), and the queued ones start with them.
    The KV cache of the tokens drawn so far is kept: it was computed by the earlier params (as verl
    and slime accept; rebuilding it would cost a prefill of every row), and each token's recorded
    log-prob is that of the params that drew it. Each sample records where the new params took over
    (`Finished.switch_at`). Call it between rounds, from the thread that steps the session.
    Paged, a prompt's shared pages stay those of the params that prefilled it, for the samples holding
    them; its samples that start later prefill it again."""
    self.params = params
    self.dparams = slots_lib.decode_params(self.e.model_cfg, params)
    for s, w in enumerate(self.slot_work):
      if w is not None and w.switch_at < 0:  # Its next token's logits were computed by the old params.
        w.switch_at = int(self.drawn[s]) + 1
    for w in self.queue:
      w.switch_at = 0
    self._keep_prefills(set())  # The earlier params' prefills: waiting samples start from the new params'.
    if self.pages:
      self.pages.clear_prefix_cache()
    self.updated = True

  def cancel(self, prompt_id: int, sample: int | None = None) -> list[int]:
    """Drops the queued samples of `prompt_id` (or its one `sample`) and ends the running ones: the
    next `step` returns them as they stand (a client that went away, a stop string). Returns the
    samples dropped from the queue (they never started)."""
    hit = lambda w: w.prompt_id == prompt_id and sample in (None, w.sample)
    dropped = [w.sample for w in self.queue if hit(w)]
    self.queue = collections.deque(w for w in self.queue if not hit(w))
    rows = [s for s, w in enumerate(self.slot_work) if w is not None and hit(w) and not w.paused]
    if rows:
      end_S = np.zeros(self.width, bool)
      end_S[rows] = True
      self.state = slots_lib.end_rows(self.state, sharding.put(end_S, self.rep))
      for s in rows if self.pages else ():  # Their rows write nothing more: free their pages, grow none.
        self.pages.release(s)
    return dropped

  def progress(self) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
    """(tokens, log-probs) drawn so far by each running sample, keyed (prompt id, sample), as of the
    last round (streaming)."""
    rows = [s for s, w in enumerate(self.slot_work) if w is not None]
    if not rows:
      return {}
    tokens, logp, _ = self._rows(rows)
    n = self.drawn
    return {(self.slot_work[s].prompt_id, self.slot_work[s].sample): (tokens[i][:n[s]], logp[i][:n[s]])
            for i, s in enumerate(rows)}

  def close(self) -> None:
    """No more samples will be added. From then on, once the queue is empty, the busy rows move into
    ever smaller decode widths as they end (a session still being fed keeps its width, so it compiles
    few programs, and returns to the host as rows end: its caller may add samples or stop)."""
    self.closed = True

  def step(self, round_steps: int | None = None) -> list[Finished]:
    """One round; `round_steps` overrides the engine's for this round (a server whose slots are all
    busy and whose clients need no progress can decode until a sample ends)."""
    e = self.e
    finished = []
    if self.episodes and self.episodes.cfg.barrier and self.paused and self.in_flight == self.paused:
      self.episodes.wait_all()  # The turn-synchronous reference: the whole batch waits.
    if self.episodes and not (self.episodes.cfg.barrier and self.in_flight > self.paused):
      finished = self._continue_episodes()
    self._insert()
    busy = self.in_flight
    if not busy:
      return finished
    running = busy - self.paused
    if self.episodes and not running:  # Every busy slot waits for its environment: hand back
      if not finished:                   # what has ended first, then wait.
        self.episodes.wait()
      return finished
    max_steps = e.C
    if round_steps or e.round_steps:  # A server: back whenever a sample ends, and every round_steps tokens.
      target, max_steps = 1, round_steps or e.round_steps
    elif self.episodes:  # Return at every turn's end (its environment starts), and now and then
      target = 1       # while environments work, to resume their slots.
      max_steps = self.episodes.poll_steps if self.paused else e.C
    elif self.queue or not self.closed:
      # Every slot is busy, or more may come (a stream, whose scores of ended samples decide what is
      # admitted next and when the step ends): return once a few have ended.
      target = max(1, int(busy * e.round_fraction))
    elif self.closed and self._worth_compacting():
      # The tail: the smallest width that holds the busy rows, until they fit the next.
      if e.width_for(self._rows_to_fit()) < self.width:
        self._resize(e.width_for(self._rows_to_fit()))
      smaller = [w for w in e.widths if w < busy]
      target = busy - smaller[-1] if smaller else busy
    else:  # A short tail: until all have ended, at this width.
      target = busy
    if self.pages:  # The pages of the tokens a round may draw are allocated before it.
      max_steps = min(max_steps, e.round_tokens)
      self._grow(max_steps)
      if (self.queue or not self.closed) and not (round_steps or e.round_steps or self.episodes):
        # A round is a page's tokens: freed slots and pages wait at most that long to be refilled, and
        # ending it at the first sample to end would pay the host's work every step or two.
        target = busy
      target = min(target, self.in_flight)  # Less any pre-empted.
    self.state, steps = slots_lib.decode_round(e.model_cfg, e.sampler_cfg, self.dparams, self.state,
                                      jnp.asarray(target, jnp.int32), jnp.asarray(max_steps, jnp.int32))
    self.rounds += 1
    done_S, step_S, steps = sharding.fetch((self.state.done_S, self.state.step_S, steps))
    self.drawn = np.array(step_S)
    self.decode_steps += int(steps)
    self.slot_steps += int(steps) * self.width
    ended = [s for s, w in enumerate(self.slot_work) if w is not None and done_S[s] and not w.paused]
    if not ended:
      return finished
    tokens, logp, policy = self._rows(ended)
    experts = None if self.state.experts_SCLk is None else self._experts(ended)
    eos = set(e.eos)
    for i, s in enumerate(ended):
      w, n = self.slot_work[s], int(step_S[s])
      f = Finished(w.prompt_id, w.sample, tokens[i], logp[i], n, truncated=int(tokens[i][n - 1]) not in eos,
                   policy_C=policy[i] if self.episodes else None,
                   switch_at=w.switch_at if w.switch_at < n else -1,  # -1: no token of the new params
                   experts_CLk=None if experts is None else experts[i])
      if self.episodes:  # A turn ended: the environment answers while the other slots decode.
        key = (w.prompt_id, w.sample)
        start = self.turn_start.get(key, 0)
        w.paused, w.last = True, f
        self.paused += 1
        self.episodes.submit(key, f.tokens_C[start:n], ended_by_eos=not f.truncated, turn=self.turns.get(key, 1))
        continue
      self.generated += n
      self.samples += 1
      finished.append(f)
      self.slot_work[s] = None
      if self.pages:
        self.pages.release(s)
    return finished

  def _rows(self, rows: list[int]):
    """Host copies of the token, log-prob and policy-mask rows of these slots."""
    return sharding.fetch(slots_lib.take_rows(self.state.tokens_SC, self.state.logp_SC, self.state.policy_SC,
                                              self._row_ids(rows)))

  def _experts(self, rows: list[int]) -> np.ndarray:
    """Host copies of these slots' recorded experts [A, C, L_moe, k] (routing replay)."""
    return sharding.fetch(slots_lib.take_experts(self.state.experts_SCLk, self._row_ids(rows)))

  def _row_ids(self, rows: list[int]):
    rows_A = np.zeros(next(b for b in _buckets(self.width) if b >= len(rows)), np.int32)  # Few shapes.
    rows_A[:len(rows)] = rows
    return sharding.put(rows_A, self.rep)

  def _continue_episodes(self) -> list[Finished]:
    """Applies the environments' answers: a paused slot continues with the observation's tokens,
    or its episode ends (done, the turn limit, or no room left for the observation and a reply)."""
    out = []
    for key, obs_tokens, reward in self.episodes.ready():
      s = next(s for s, w in enumerate(self.slot_work) if w is not None and (w.prompt_id, w.sample) == key)
      w = self.slot_work[s]
      f = w.last
      room = self.e.C - f.length
      if obs_tokens is not None and len(obs_tokens) < room:
        N = next(b for b in _buckets(self.e.C) if b >= len(obs_tokens))
        obs_N = np.zeros(N, np.int32)
        obs_N[:len(obs_tokens)] = obs_tokens
        self.state = slots_lib.resume(self.state, *sharding.put((np.int32(s), obs_N, np.int32(len(obs_tokens)),
                                                        np.int32(self.e.turn_tokens)), self.rep))
        self.turn_start[key] = f.length + len(obs_tokens)
        self.turns[key] = self.turns.get(key, 1) + 1
        w.paused = False
        self.paused -= 1
        continue
      if obs_tokens is not None:  # No room: the episode is cut, like a completion at its budget.
        reward = self.episodes.cut(key, "max_episode_tokens")
        f.truncated = True
      f.reward, f.turns = reward, self.turns.pop(key, 1)
      self.turn_start.pop(key, None)
      self.generated += f.length
      self.samples += 1
      self.paused -= 1
      self.slot_work[s] = None
      if self.pages:
        self.pages.release(s)
      out.append(f)
    return out

  def _worth_compacting(self) -> bool:
    """Whether some busy row may still decode `min_compact_steps` tokens."""
    busy = [s for s, w in enumerate(self.slot_work) if w is not None]
    return self.e.C - int(self.drawn[busy].min()) >= self.e.min_compact_steps

  def _rows_to_fit(self) -> int:
    """The rows a width must have to hold the busy ones (paged: each on its own shard)."""
    busy = [s for s, w in enumerate(self.slot_work) if w is not None]
    return self.pages.rows_to_fit(busy) if self.pages else len(busy)

  def _resize(self, width: int) -> None:
    """Moves the busy rows (cache included) into a pool of `width` rows, in slot order (paged: each
    within its shard, with the pages it holds)."""
    rows = [s for s, w in enumerate(self.slot_work) if w is not None]
    if self.pages:
      old = self.width
      rows_N = self.pages.resize(rows, width)
      self.slot_work = [self.slot_work[r] if r < old else None for r in rows_N]
      self.drawn = np.where(rows_N < old, self.drawn[np.minimum(rows_N, old - 1)], 0).astype(np.int32)
    else:
      rows_N = np.full((width,), self.width, np.int32)  # Out of range: an empty row.
      rows_N[:len(rows)] = rows
      self.slot_work = [self.slot_work[s] for s in rows] + [None] * (width - len(rows))
      self.drawn = np.concatenate([self.drawn[rows], np.zeros(width - len(rows), np.int32)])
    self.state = slots_lib.move_rows(self.state, sharding.put(rows_N, self.rep), self.e.row_sharding)
    self.resizes += 1

  def _insert(self) -> None:
    """Freed slots take the next queued samples. Prompts not prefilled yet are prefilled together,
    in chunks of at most `prefill_tokens` prompt tokens; a prompt whose samples still wait keeps its
    prefill until they start (slots free one or two at a time, so a group often starts over several
    rounds: each would otherwise prefill its prompt anew)."""
    free = [s for s, w in enumerate(self.slot_work) if w is None]
    n = min(len(free), len(self.queue))
    if not n:
      return
    work = [self.queue.popleft() for _ in range(n)]
    firsts: dict[int, _Work] = {}
    for w in work:  # A group's samples that start together share one prefill.
      if not self._prefilled_for(w):
        firsts.setdefault(w.prompt_id, w)
    if firsts:
      P = tokenizer_lib.bucket(int(max(w.mask_P.sum() for w in firsts.values())), self.e.prompt_buckets)
      chunk = 1 << (max(self.e.prefill_tokens // P, 1).bit_length() - 1)  # Prompts per prefill.
      chunk = min(chunk, self.e.S)
      # The last chunk also takes the next waiting prompts (of this length bucket): each prefill runs
      # the prompts' shared prefix once, so a prompt prefilled alone as its first sample starts costs
      # its whole length; beside others, its suffix.
      for w in self.queue:
        if len(firsts) % chunk == 0:
          break
        if (w.prompt_id not in firsts and not self._prefilled_for(w)
            and tokenizer_lib.bucket(int(w.mask_P.sum()), self.e.prompt_buckets) <= P):
          firsts[w.prompt_id] = w
      uniq = list(firsts.values())
      self._keep_prefills(set(self.prefills) - set(firsts))  # Those of a prompt id's earlier tokens go.
      for c in range(0, len(uniq), chunk):
        prefill = self._prefill(uniq[c:c + chunk])
        for w in uniq[c:c + chunk]:
          self.prefills[w.prompt_id] = prefill
    slots = free
    if self.pages:
      work, slots = self._admit(work, free)
    by_prefill: dict[int, list[int]] = {}
    for a, w in enumerate(work):
      by_prefill.setdefault(id(self.prefills[w.prompt_id]), []).append(a)
    for take in by_prefill.values():
      self._start(self.prefills[work[take[0]].prompt_id], [work[a] for a in take], [slots[a] for a in take])
    self._keep_prefills({w.prompt_id for w in self.queue})

  def _keep_prefills(self, waiting: set[int]) -> None:
    """Keeps the prefills of the `waiting` prompts; the others' shared prompt pages lose this holder."""
    for pid, p in self.prefills.items():
      if pid not in waiting and self.pages:
        self.pages.drop_prompt(p, pid)
    self.prefills = {pid: p for pid, p in self.prefills.items() if pid in waiting}

  def _prefilled_for(self, w: _Work) -> bool:
    """Whether `w`'s prompt has a kept prefill (the same tokens: a prompt id names one prompt)."""
    p = self.prefills.get(w.prompt_id)
    return p is not None and np.array_equal(p.prompts[w.prompt_id], w.prompt_P)

  def _prefill(self, uniq: list[_Work]) -> "_Prefill":
    """Runs the distinct prompts `uniq` through the model: their next-token logits, keys and values."""
    e = self.e
    U = next(b for b in _buckets(e.S) if b >= len(uniq))
    reals = [w.prompt_P[w.mask_P.astype(bool)] for w in uniq]  # each prompt's real tokens
    longest = max(len(r) for r in reals)
    P = tokenizer_lib.bucket(longest, e.prompt_buckets)
    images_UMD = None
    if uniq[0].images_MD is not None:  # Images: whole prompts run (their keys depend on the images too).
      pad = jnp.zeros_like(uniq[0].images_MD)
      images_UMD = jnp.stack([w.images_MD for w in uniq] + [pad] * (U - len(uniq)))
    cached = self._cached_prefix(uniq) if images_UMD is None else None
    N = len(cached[1]) * e.page_size if cached else self._shared_prefix(reals) if images_UMD is None else 0
    if N:  # Suffixes at the smallest power of two (>= 8) that holds them: all the prefill computes.
      P = min(P, N + max(8, 1 << (longest - N - 1).bit_length()))
    prompt_UP = np.zeros((U, P), np.int32)
    mask_UP = np.zeros((U, P), bool)
    for u, real in enumerate(reals):  # Left-padded; with a shared prefix, [prefix | left-padded suffix].
      prompt_UP[u, :N], mask_UP[u, :N] = real[:N], True
      prompt_UP[u, P - len(real) + N:], mask_UP[u, P - len(real) + N:] = real[N:], True
    mask_UP[len(uniq):, -1] = True  # Padding rows: one real token, so their softmax is defined.
    real_UP = mask_UP if self.pages else None
    prompt_UP, mask_UP = sharding.put((prompt_UP, mask_UP), self.rep)
    self.prefilled += len(uniq)
    self.prefilled_tokens += sum(len(r) for r in reals) - (len(uniq) - 1) * N - (N if cached else 0)
    if cached:  # The prefix's keys and values are the cached pages' (of shard g's pool).
      g, run = cached
      pages = sharding.put(np.asarray(run, np.int32) + g * e.kv_pages, self.rep)
      out = slots_lib.prefill_cached(e.model_cfg, self.dparams, self.state.cache.k, self.state.cache.v, pages,
                                     prompt_UP[:, N:], mask_UP[:, N:])
    elif N:
      out = slots_lib.prefill_shared(e.model_cfg, self.params, prompt_UP[:1, :N], prompt_UP[:, N:], mask_UP[:, N:])
    else:
      images = () if images_UMD is None else (sharding.put(images_UMD, self.rep),)
      out = slots_lib.prefill(e.model_cfg, self.params, prompt_UP, mask_UP, *images)
    prefill = _Prefill(*out, mask_UP, {w.prompt_id: u for u, w in enumerate(uniq)},
                       {w.prompt_id: w.prompt_P for w in uniq}, real_UP)
    if self.pages and self.pages.prefix_cache:  # Its whole pages go to the cache now: later prompts start after them.
      self.pages.prefix_hits += len(uniq) * (len(cached[1]) if cached else 0)
      writes = self.pages.seed(prefill, uniq, cached[0] if cached else 0)
      if writes is not None:
        self.state = slots_lib.write_prompt_pages(self.state, prefill.k_LUKPH, prefill.v_LUKPH, prefill.mask_UP,
                                                  *sharding.put(writes, self.rep))
    return prefill

  def _start(self, prefill: "_Prefill", work: list[_Work], slots: list[int]) -> None:
    """Starts `work[a]` in slot `slots[a]` from its prompt's row of `prefill`."""
    e = self.e
    n = len(work)
    A = self.width  # Slot-sized: one program whatever the number of samples started.
    slot_A = np.full((A,), A, np.int32)  # Out of range: padding writes nothing.
    slot_A[:n] = slots
    src_A, key_id_A, sample_A = np.zeros((3, A), np.int32)
    src_A[:n] = [prefill.row[w.prompt_id] for w in work]
    key_id_A[:n] = [w.key_id for w in work]
    sample_A[:n] = [w.sample for w in work]
    stop_A, turn_end_A = np.full((2, A), e.C + 1, np.int32)
    stop_A[:n] = [w.stop_at for w in work]
    turn_end_A[:n] = [w.max_tokens for w in work]
    temperature_A, top_p_A = np.ones((2, A), np.float32)
    temperature_A[:n] = [w.temperature for w in work]
    top_p_A[:n] = [w.top_p for w in work]
    arrays = sharding.put((src_A, slot_A, key_id_A, sample_A, stop_A, turn_end_A, temperature_A, top_p_A), self.rep)
    src_A, slot_A, key_id_A, sample_A = arrays[:4]
    key_A = slots_lib.sample_keys(self.key_data, key_id_A, sample_A)
    if self.pages:
      pages = sharding.put(self.pages.start(prefill, work, slots), self.rep)
      self.state = slots_lib.start_paged(e.sampler_cfg.pad_id, self.state, key_A, prefill.logits_UV, prefill.k_LUKPH,
                                         prefill.v_LUKPH, prefill.mask_UP, src_A, slot_A, *arrays[4:], *pages)
    else:
      self.state = slots_lib.start_samples(e.sampler_cfg.pad_id, self.state, key_A, prefill.logits_UV,
                                           prefill.k_LUKPH, prefill.v_LUKPH, prefill.mask_UP, src_A, slot_A,
                                           *arrays[4:], jnp.asarray(n, jnp.int32))
    for s, w in zip(slots, work):
      self.slot_work[s] = w
      self.drawn[s] = 0

  def _cached_prefix(self, uniq: list[_Work]) -> tuple[int, list[int]] | None:
    """The run of first pages that all of `uniq`'s prompts begin with and a shard's prefix cache holds:
    (that shard, their pages), or None."""
    if not (self.pages and self.pages.prefix_cache):
      return None
    g, run = self.pages.cached_run(uniq[0])
    first = self.pages.skippable_keys(uniq[0])
    for w in uniq[1:]:  # A key hashes every token before it: the prompts agree up to their first unequal key.
      keys = self.pages.skippable_keys(w)
      run = run[:next((j for j, (a, b) in enumerate(zip(keys, first)) if a != b), min(len(keys), len(first)))]
    return (g, run) if run else None

  def _shared_prefix(self, reals: list[np.ndarray]) -> int:
    """The prefix all the prompts `reals` share, in multiples of `shared_prefix` (`model.shared_prefix_len`;
    with a prefix cache, at least of whole pages)."""
    cache = self.pages is not None and self.pages.prefix_cache
    return model_lib.shared_prefix_len(reals, self.e.shared_prefix or (self.e.page_size if cache else 0))

  def stats(self) -> dict:
    out = {"samples": self.samples, "generated_tokens": self.generated, "decode_steps": self.decode_steps,
           "slot_steps": self.slot_steps, "rounds": self.rounds, "resizes": self.resizes,
           "prefilled_prompts": self.prefilled, "prefilled_tokens": self.prefilled_tokens,
           "slot_utilisation": self.generated / max(self.slot_steps, 1)}
    if self.pages:
      out.update(self.pages.stats())
    return out

  # --- paged: admission, growth, pre-emption ----------------------------------------------------

  def _admit(self, work: list[_Work], free: list[int]) -> tuple[list[_Work], list[int]]:
    """The longest start of `work` whose pages fit a shard with a free slot (`SlotPages.admit`), and their
    slots; the rest wait at the queue's head. With nothing in flight, prompt pages held for waiting
    samples give way to the queue's head."""
    started, slots = self.pages.admit(work, free, self.prefills, self.slot_work, self.drawn)
    if not started and not self.in_flight:
      for g in range(self.pages.G):
        self.pages.let_go_prompts(self.prefills, g)
      started, slots = self.pages.admit(work, free, self.prefills, self.slot_work, self.drawn)
      if not started:
        raise self.pages.dry(0, 0, 0)
    self.queue.extendleft(reversed(work[len(started):]))
    return started, slots

  def _grow(self, steps: int) -> None:
    """Allocates the pages the running samples may write within `steps` more tokens; where a shard's pool
    runs dry its latest started samples are pre-empted: ended on the device, their pages freed, and queued
    again at the head, to start over from their prompt (a sample's randomness is its key's and the number
    of tokens it has drawn, so it draws the same tokens again)."""
    added, victims = self.pages.grow(self.slot_work, self.drawn, steps, self.prefills)
    if victims:
      end_S = np.zeros(self.width, bool)
      end_S[victims] = True
      self.state = slots_lib.end_rows(self.state, sharding.put(end_S, self.rep))
      for s in victims:  # The latest first: the earliest ends up at the head.
        if self.slot_work[s].switch_at > 0:  # Drawn again from its prompt, by the params of now alone.
          self.slot_work[s].switch_at = 0
        self.queue.appendleft(self.slot_work[s])
        self.slot_work[s] = None
        self.drawn[s] = 0
    if not added:
      return
    W = 1 << max(len(added) - 1, 7).bit_length()  # Few shapes: powers of two from 128.
    slot_W = np.full(W, self.width, np.int32)  # Out of range: no entry.
    col_W, page_W = np.zeros((2, W), np.int32)
    slot_W[:len(added)], col_W[:len(added)], page_W[:len(added)] = np.array(added, np.int32).T
    self.state = slots_lib.assign_pages(self.state, *sharding.put((slot_W, col_W, page_W), self.rep))
