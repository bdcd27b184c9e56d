"""Rollouts: encode prompts, generate on the mesh, score. The public way to sample from a policy.

    r = rollout.Rollout(tok, model_cfg, mesh, rollout.RolloutConfig(...), sampler_cfg, reward)
    samples = r.generate(params, ["What is 2+3?"], G=4, key=jax.random.key(0))
    texts = r.decode(samples)

`Rollout.groups` is one generation batch of the DAPO loop: every host's prompts generated together
on the mesh, each host scoring its own rows, and the scored groups gathered on every host.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Sequence

import jax
import numpy as np
from flax import linen as nn

from dapo_jax import rewards as rewards_lib
from dapo_jax import sharding
from dapo_jax.data import images as images_lib
from dapo_jax.data import prompts as data_lib
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.datatypes import Groups
from dapo_jax.errors import ConfigError, DataError
from dapo_jax.model import lora as lora_lib
from dapo_jax.model import transformer as model_lib
from dapo_jax.model import vision
from dapo_jax.rollout import engine as engine_lib
from dapo_jax.rollout import episodes as episodes_lib
from dapo_jax.rollout import sampling


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """How prompts are encoded and generation is split; how responses are scored."""
  max_prompt_len: int                  # tokens; longer prompts keep their end
  prompt_buckets: tuple[int, ...] = ()  # prompt lengths compiled for; () = just max_prompt_len
  chat_template: bool = True           # render prompts with the tokenizer's chat template
  max_images: int = 1                  # a vision-language model's prompts: image slots per prompt (fewer pad)
  engine: str = "continuous"           # "continuous" (engine.Engine: slots refilled as samples end) or
                                       # "static" (one batch decodes until its longest row ends)
  slots: int = 0                       # continuous: decode slots (0 = the rows of one generation batch)
  prefill_tokens: int = 2048           # continuous: prompt tokens prefilled at once (whole prompts, at least one)
  kv_cache_dtype: str = ""             # continuous: dtype of the KV cache ("" = the model's compute dtype)
  shared_prefix: int = 0               # continuous: a common prompt start of >= this many tokens prefills once
  kv_layout: str = "dense"             # continuous: "dense" (P + C positions per slot) or "paged" (a pool of pages)
  page_size: int = 16                  # paged: tokens per page
  kv_pages: int = 0                    # paged: pages in each batch shard's pool (0 = its slots' dense bytes)
  kv_memory_mb: float = 0.0            # paged: each batch shard's pool in MiB, instead of kv_pages (0 = off)
  paged_attention: str = "gather"      # paged: "gather" (the dense view), "ragged" (in place) or "kernel" (Pallas)
  prefix_cache: bool = False           # paged: keep whole prompt pages by their tokens' hash; prefill after them
  rows_per_call: int = 0               # static: rows per sampler call (0 = all rows at once)
  overlong_buffer: int = 0             # L_cache of the soft overlong punishment (Eq. 13); 0 = off
  overlong_penalty: float = 1.0
  filter_metric: str = "acc"           # what dynamic sampling compares (filter_values)
  # the reward's components kept per sample for GDPO (`reward_parts`): "score", "acc", "overlong_reward"
  # (the overlong penalty, verl's name) or a numeric entry of the reward's result
  gdpo_reward_keys: tuple[str, ...] = ()
  turn_tokens: int = 0                 # episodes: tokens one policy turn may draw (0 = the whole budget)


class Rollout:
  """Samples and scores completions of a policy whose params live on `mesh`."""

  def __init__(self, tok, model_cfg: model_lib.ModelConfig, mesh, cfg: RolloutConfig,
               sampler_cfg: sampling.SamplerConfig, reward=None, env=None,
               episode_cfg: episodes_lib.EpisodeConfig | None = None):
    """`env` (a class or factory of `envs.Env`) makes every sample an episode: the environment builds
    the prompt, answers between turns and gives the reward (`reward` is then unused); the sampler's
    max_new_tokens is the episode's budget after the prompt, `cfg.turn_tokens` one turn's."""
    self.tok, self.model_cfg, self.mesh, self.cfg = tok, model_cfg, mesh, cfg
    self.sampler_cfg, self.reward = sampler_cfg, reward
    self.episodes = None if env is None else episodes_lib.EpisodeDriver(
        tok, env, episode_cfg or episodes_lib.EpisodeConfig(), eos_ids=sampler_cfg.eos_ids,
        image_token_id=None if model_cfg.vision is None else model_cfg.vision.image_token_id)
    if self.episodes is not None and (cfg.engine != "continuous" or jax.process_count() > 1):
      raise ValueError("rollout.env: episodes run on the continuous engine (rollout.engine='continuous') "
                       "in one process")
    self.buckets = sorted(cfg.prompt_buckets or [cfg.max_prompt_len])
    self.truncated_prompts = 0  # training prompts (`groups`) that lost their beginning to max_prompt_len
    self.engines: dict = {}     # one continuous-batching engine per (sampler config, slots)
    self.last_stats: dict = {}  # the last generate's engine statistics (slot utilisation, ...)
    self.length_hook = None     # benchmarks only: rows -> the token number each row is forced to end at
    self.engine_options: dict = {}  # benchmarks only: more `engine.Engine` arguments (round_fraction, widths)
    self.vision_prompts = 0     # prompts whose images passed the vision tower (once per prompt and sampling)
    self.keep_pixels = False    # groups keep their prompts' pixels (`model.train_vision`: the update's tower runs)
    self.batch_sharding = sharding.named(mesh, "B")
    self.replicated = sharding.replicated(mesh)
    logical = nn.get_partition_spec(jax.eval_shape(lambda: model_lib.init_boxed(model_cfg, jax.random.key(0))))
    # The sampler gathers FSDP shards once per rollout instead of once per decoded token.
    self.params_sharding = nn.logical_to_mesh_sharding(logical, mesh, sharding.SAMPLING_PARAM_RULES)

  # --- prompts -------------------------------------------------------------------------------

  def encode(self, prompts: Sequence[data_lib.Example | str]) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded prompt tokens and mask [Q, max_prompt_len]; strings are single user turns."""
    tokens, mask, _ = self.encode_counting(prompts)
    return tokens, mask

  def encode_counting(self, prompts) -> tuple[np.ndarray, np.ndarray, int]:
    texts = [self.render(p) for p in prompts]
    P = self.cfg.max_prompt_len
    tokens, mask = tokenizer_lib.encode_left_padded(self.tok, texts, P)
    if self.model_cfg.vision is not None:
      self._check_placeholders(prompts, tokens)
    n = 0
    if mask[:, 0].any():  # A full row may have been cut: check the real lengths once.
      n = sum(len(ids) > P for ids in tokenizer_lib.encode_prompts(self.tok, texts))
      if n:
        logging.warning("%d prompts longer than data.max_prompt_len=%d lost their beginning", n, P)
    return tokens, mask, n

  def _check_placeholders(self, prompts, tokens_QP: np.ndarray) -> None:
    """Each prompt holds its images' placeholders (`images.tokens_per_image`): none lost to max_prompt_len
    or to the text."""
    v = self.model_cfg.vision
    for q, p in enumerate(prompts):
      ims = () if isinstance(p, str) else p.images
      want = images_lib.placeholders(v, ims)
      got = int((tokens_QP[q] == v.image_token_id).sum())
      if got != want:
        where = f"example {getattr(p, 'index', q)}" + (f" ({p.data_source})" if not isinstance(p, str) else "")
        raise DataError(f"{where}: its encoded prompt holds {got} image placeholders, expected {want} "
                        f"(for {len(ims)} images): data.max_prompt_len={self.cfg.max_prompt_len} cut an image, "
                        "or the text holds the placeholder token itself")

  def render(self, prompt: data_lib.Example | str) -> str:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt.messages
    tools = None
    if self.episodes is not None and not isinstance(prompt, str):  # The environment sets the scene.
      messages, tools = self.episodes.prompt(prompt)
    text = tokenizer_lib.render(self.tok, messages, self.cfg.chat_template, tools=tools)
    if self.model_cfg.vision is None:
      return text
    images = () if isinstance(prompt, str) else prompt.images
    try:
      return images_lib.expand_marks(text, self.tok, self.model_cfg.vision, images)
    except DataError as e:
      raise DataError(f"example {getattr(prompt, 'index', '?')} ({getattr(prompt, 'data_source', '')}): {e}") from None

  def image_vectors(self, params, prompts, hosts: bool = False) -> jax.Array | None:
    """[Q, I*M, D] the vectors of each prompt's images (I = `max_images` slots, fewer pad), through the vision
    tower once per prompt (a group's G samples and every pass of the update share them); None: a text model.
    `hosts`: `prompts` are this process's share of a batch that every process samples (`groups`): the
    pixels are gathered first, and the vectors are every process's prompts', in process order."""
    return self.image_inputs(params, prompts, hosts)[0]

  def image_inputs(self, params, prompts, hosts: bool = False) -> tuple[jax.Array | None, dict]:
    """(`image_vectors`, and where groups keep them, `keep_pixels`, what they came from: {"pixels_QICSS":
    [Q, I, C, S, S], "grids_QI2": [Q, I, 2] at native resolution}; else {})."""
    v = self.model_cfg.vision
    if v is None:
      return None, {}
    images = [() if isinstance(p, str) else p.images for p in prompts]
    if max(map(len, images)) > self.cfg.max_images:
      raise DataError(f"a prompt has {max(map(len, images))} images; data.max_images={self.cfg.max_images} "
                      "image slots per prompt")
    pixels_QICSS = images_lib.batch_pixels(v, images, self.cfg.max_images)
    grids_QI2 = images_lib.batch_grids(v, images, self.cfg.max_images) if v.native_resolution else None
    if hosts:  # A replicated array holds the same values on every process.
      pixels_QICSS = sharding.gather_hosts(pixels_QICSS)
      grids_QI2 = None if grids_QI2 is None else sharding.gather_hosts(grids_QI2)
    self.vision_prompts += len(prompts)
    grids = () if grids_QI2 is None else (sharding.put(grids_QI2, self.replicated),)
    vectors = vision.encode_images(v, vision.tower_params(params), sharding.put(pixels_QICSS, self.replicated),
                                   *grids)
    if not self.keep_pixels:
      return vectors, {}
    return vectors, {"pixels_QICSS": pixels_QICSS} | ({} if grids_QI2 is None else {"grids_QI2": grids_QI2})

  def prompt_len(self, prompt_mask_QP: np.ndarray) -> int:
    """The smallest compiled prompt length (bucket) that holds every prompt of the batch."""
    return tokenizer_lib.bucket(int(prompt_mask_QP.sum(1).max()), self.buckets)

  # --- generation ----------------------------------------------------------------------------

  def sampling_params(self, params):
    """The policy placed for the sampler: FSDP shards gathered once per rollout step; a policy
    trained on other devices (a split mesh) is first copied over, device to device, each array
    with its own partitioning on this mesh."""
    if self.mesh.shape["fsdp"] > 1 and not lora_lib.is_adapted(params):  # (LoRA: decode merges per call.)
      return jax.device_put(params, self.params_sharding)  # From any devices, in one copy.
    if self.owns_copy(params):
      return jax.device_put(params, jax.tree.map(lambda x: jax.sharding.NamedSharding(self.mesh, x.sharding.spec),
                                                 params))
    return params

  def owns_copy(self, params) -> bool:
    """Whether `sampling_params(params)` is a copy on other devices (a split mesh): then the train
    step's donation of `params` cannot touch it."""
    leaf = jax.tree.leaves(params)[0]
    return isinstance(leaf, jax.Array) and leaf.sharding.device_set != set(self.mesh.devices.flat)

  def engine(self, sampler_cfg: sampling.SamplerConfig, rows: int) -> engine_lib.Engine:
    """The continuous-batching engine for `sampler_cfg` (`rollout.slots`, or `rows` when 0)."""
    slots = self.cfg.slots or rows
    shards = sharding.batch_shards(self.mesh.shape)
    slots = -(-slots // shards) * shards  # Whole slots per data shard.
    k = (sampler_cfg, slots)
    if k not in self.engines:
      self.engines[k] = engine_lib.Engine(self.model_cfg, sampler_cfg, slots=slots, prompt_len=self.cfg.max_prompt_len,
                                          prompt_buckets=self.buckets, mesh=self.mesh,
                                          prefill_tokens=self.cfg.prefill_tokens, turn_tokens=self.cfg.turn_tokens,
                                          kv_cache_dtype=self.cfg.kv_cache_dtype,
                                          shared_prefix=self.cfg.shared_prefix, kv_layout=self.cfg.kv_layout,
                                          page_size=self.cfg.page_size, kv_pages=self.cfg.kv_pages,
                                          kv_memory_mb=self.cfg.kv_memory_mb,
                                          paged_attention=self.cfg.paged_attention,
                                          prefix_cache=self.cfg.prefix_cache,
                                          **self.engine_options)
    return self.engines[k]

  def generate(self, params, prompts, G: int, key, sampler_cfg: sampling.SamplerConfig | None = None,
               first_prompt_id: int = 0, examples=None, images_QMD=None):
    """G samples per prompt as host arrays (`sampling.Samples`); prompt q's samples are rows
    qG..qG+G-1. `prompts` are examples or strings, or an encoded (prompt_QP, prompt_mask_QP) pair
    (episodes, images: of `examples`). Continuous engine: prompt q's samples come from (key,
    first_prompt_id + q, sample index). Episodes: `last_stats["episode_rewards"]` has their rewards.
    A vision-language model places each prompt's image vectors (`images_QMD`, default `image_vectors`)."""
    # A mixture of experts runs its experts on the mesh, which its layers read from the context.
    with jax.set_mesh(self.mesh) if self.model_cfg.moe else contextlib.nullcontext():
      return self._generate(params, prompts, G, key, sampler_cfg, first_prompt_id, examples, images_QMD)

  def _generate(self, params, prompts, G, key, sampler_cfg, first_prompt_id, examples=None, images_QMD=None):
    sampler_cfg = sampler_cfg or self.sampler_cfg
    prompt_QP, prompt_mask_QP = prompts if isinstance(prompts, tuple) else self.encode(prompts)
    if images_QMD is None and self.model_cfg.vision is not None:
      images_QMD = self.image_vectors(params, examples if isinstance(prompts, tuple) else prompts)
    stop_at_B = self.length_hook(len(prompt_QP) * G) if self.length_hook else None
    if self.cfg.engine == "continuous":
      driver = None
      if self.episodes is not None:
        driver = self.episodes
        for q, ex in enumerate(examples if isinstance(prompts, tuple) else prompts):
          driver.register(first_prompt_id + q, ex)
      samples, self.last_stats = self.engine(sampler_cfg, len(prompt_QP) * G).generate(
          params, prompt_QP, prompt_mask_QP, G, key, stop_at_B, first_prompt_id=first_prompt_id, episodes=driver,
          images_QMD=images_QMD)
      return samples
    P = self.prompt_len(prompt_mask_QP)
    prompt_QP, prompt_mask_QP = prompt_QP[:, -P:], prompt_mask_QP[:, -P:]
    Q = len(prompt_QP)
    chunk = self.cfg.rows_per_call or Q * G  # Bounds the KV cache of one sampler call.
    if chunk % G or (Q * G) % chunk:
      raise ValueError(f"rollout.rows_per_call={chunk} must be a multiple of rollout.group_size={G} "
                       f"and divide the {Q * G} rows of a generation batch")
    per_call = chunk // G
    shards = sharding.batch_shards(self.mesh.shape)
    # Prompts are split over the data shards when they divide evenly, else every shard holds them all.
    placement = self.batch_sharding if per_call % shards == 0 else self.replicated
    outs = []
    for i in range(0, Q, per_call):
      part = sharding.put((prompt_QP[i:i + per_call], prompt_mask_QP[i:i + per_call]), placement)
      k = key if per_call == Q else jax.random.fold_in(key, i)
      stop = None if stop_at_B is None else stop_at_B[i * G:(i + per_call) * G]
      images = None if images_QMD is None else images_QMD[i:i + per_call]
      outs.append(sharding.fetch(sampling.generate(self.model_cfg, sampler_cfg, params, *part, k, num_samples=G,
                                                   stop_at_B=stop, images_QMD=images)))
    samples = outs[0] if len(outs) == 1 else jax.tree.map(lambda *xs: np.concatenate(xs), *outs)
    # Every row of a call runs until the call's longest row ends.
    steps = sum(int(o.length_B.max()) * len(o.length_B) for o in outs)
    self.last_stats = {"generated_tokens": int(samples.length_B.sum()), "decode_steps": steps // max(chunk, 1),
                       "slot_utilisation": float(samples.length_B.sum()) / max(steps, 1)}
    return samples

  def decode(self, samples) -> list[str]:
    return tokenizer_lib.decode(self.tok, samples.tokens_BC, samples.mask_BC)

  # --- scoring -------------------------------------------------------------------------------

  def call_reward(self, texts: Sequence[str], examples: Sequence[data_lib.Example], reward=None) -> list[dict]:
    """The reward of each response to its example (reward models also see the prompt), by the
    rollout's reward or the given one."""
    reward = reward or self.reward
    gts = [ex.ground_truth for ex in examples]
    if getattr(reward, "needs_prompts", False):
      return reward(texts, gts, prompts=[ex.messages[-1]["content"] for ex in examples])
    return reward(texts, gts)

  def score(self, examples: Sequence[data_lib.Example], samples, G: int, rewards=None) -> dict:
    """Rewards of the rows of `examples` x G: correctness + overlong penalty, and the filter values.
    Episodes bring their environments' `rewards`. The overlong penalty measures the whole response
    (an episode's observations included, as verl counts a multi-turn response) against the sampler's
    budget (an episode's: `episodes.response_budget`). "valid": False for an episode whose environment
    failed with `rollout.env_error="mask"` (its row leaves the loss and its group's statistics)."""
    texts = self.decode(samples)
    results = rewards if rewards is not None else self.call_reward(texts, [ex for ex in examples for _ in range(G)])
    c = self.cfg
    penalty = np.array([rewards_lib.overlong_penalty(int(n), self.sampler_cfg.max_new_tokens,
                                                     c.overlong_buffer, c.overlong_penalty)
                        for n in samples.length_B])
    Q = len(examples)
    raw_QG = np.array([r["score"] for r in results], np.float64).reshape(Q, G)
    score_QG = raw_QG + penalty.reshape(Q, G)
    acc_QG = np.array([r["acc"] for r in results], bool).reshape(Q, G)
    valid_QG = np.array([not r.get("masked", False) for r in results], bool).reshape(Q, G)
    filter_QG = filter_values(c.filter_metric, acc_QG=acc_QG, score_QG=raw_QG, reward_QG=score_QG)
    parts_QGK = reward_parts(c.gdpo_reward_keys, results, penalty).reshape(Q, G, -1)
    return {"score": score_QG, "acc": acc_QG, "filter": np.asarray(filter_QG, np.float64), "valid": valid_QG,
            "pred": [r["pred"] for r in results], "texts": texts, "parts": parts_QGK}

  def groups(self, params, examples: Sequence[data_lib.Example], G: int, key,
             first_prompt_id: int = 0) -> tuple[Groups, dict]:
    """One generation batch: every host's `examples` generated together; each host scores its own
    rows, and every host returns all the scored groups (dynamic sampling and advantages need them)."""
    local_QP, local_mask_QP, truncated = self.encode_counting(examples)
    self.truncated_prompts += truncated
    prompt_QP, pmask_QP = sharding.gather_hosts(local_QP), sharding.gather_hosts(local_mask_QP)
    t0 = time.perf_counter()
    images_QMD, kept = self.image_inputs(params, examples, hosts=True)
    samples = self.generate(params, (prompt_QP, pmask_QP), G, key, first_prompt_id=first_prompt_id, examples=examples,
                            images_QMD=images_QMD)
    t1 = time.perf_counter()
    rows = slice(jax.process_index() * len(examples) * G, (jax.process_index() + 1) * len(examples) * G)
    local = self.score(examples, jax.tree.map(lambda x: x[rows], samples), G, self.last_stats.get("episode_rewards"))
    t2 = time.perf_counter()
    groups = Groups.from_samples(prompt_QP, pmask_QP, samples, sharding.gather_hosts(local["score"]),
                                 sharding.gather_hosts(local["acc"]), sharding.gather_hosts(local["filter"]),
                                 valid_QG=sharding.gather_hosts(local["valid"]),
                                 images_QMD=None if images_QMD is None else sharding.fetch(images_QMD),
                                 parts_QGK=sharding.gather_hosts(local["parts"]), **kept)
    info = {"gen_s": t1 - t0, "reward_s": t2 - t1, "texts": local["texts"], "gen_tokens": int(samples.length_B.sum()),
            "slot_steps": self.last_stats["generated_tokens"] / max(self.last_stats["slot_utilisation"], 1e-9)}
    return groups, info


  def generation_batch(self, params, examples: Sequence[data_lib.Example], G: int, step_key,
                       index: int) -> tuple[Groups, dict]:
    """Generation batch `index` of a rollout step (`groups`). The engine samples prompt number
    index x (the batch's prompts, every process's) + q of the step from the step's key, as streaming
    does; the static sampler draws each batch from a key of its own."""
    if self.cfg.engine == "continuous":
      first = index * len(examples) * jax.process_count()  # `examples` are this process's share.
      return self.groups(params, examples, G, jax.random.fold_in(step_key, 0), first_prompt_id=first)
    return self.groups(params, examples, G, jax.random.fold_in(step_key, index))

FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")


def reward_parts(keys: Sequence[str], results: Sequence[dict], penalty_B: np.ndarray) -> np.ndarray:
  """[B, K] fp32: each sample's reward components `keys` (`dapo.gdpo_reward_keys`): "score" (the reward
  before the overlong penalty), "acc", "overlong_reward" (the penalty) or an entry of its result. A
  failed reward call has no components: they are 0 there (its score stays the failure's). A result
  that lacks a named entry otherwise raises, naming the sample and the entries it has."""
  out = np.zeros((len(results), len(keys)), np.float32)
  for b, r in enumerate(results):
    for k, key in enumerate(keys):
      if key == "overlong_reward":
        out[b, k] = penalty_B[b]
      elif key in r:
        out[b, k] = float(r[key])
      elif r.get("pred") != rewards_lib.FAILURE["pred"]:
        has = sorted(name for name in r if name != "pred")
        raise ConfigError(f"dapo.gdpo_reward_keys: sample {b}'s reward result has no {key!r}; it has {has}")
  return out


def filter_values(metric: str, *, acc_QG: np.ndarray, score_QG: np.ndarray, reward_QG: np.ndarray) -> np.ndarray:
  """The per-sample value dynamic sampling looks at (`dapo.filter_metric`), as verl names them.

  acc: the scorer's correctness; score: the scorer's score alone; seq_reward: the reward that is
  trained on (score + overlong penalty: verl's summed token-level scores); seq_final_reward: that
  minus an in-reward KL penalty, which DAPO has none of, so it equals seq_reward here.
  """
  if metric == "acc":
    return np.asarray(acc_QG)
  if metric == "score":
    return np.asarray(score_QG)
  if metric in ("seq_reward", "seq_final_reward"):
    return np.asarray(reward_QG)
  raise ValueError(f"dapo.filter_metric={metric!r}; expected one of {FILTER_METRICS}")
