"""The sections of an RL run: `rollout` (sampling and episodes), `dapo` (the objective and dynamic
sampling), `ppo` and `critic` (token-level estimators), `train` (the update's schedule), `eval`.

A field that a library class also has takes that class's default (`objectives.PGConfig.eps_low`):
the value is written once, where the code that uses it is documented.
"""
from __future__ import annotations

import dataclasses

from dapo_jax import advantages as adv_lib
from dapo_jax import loop, objectives, optim, train_step
from dapo_jax import loss as loss_lib
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.errors import ConfigError
from dapo_jax.rollout import engine as engine_lib
from dapo_jax.rollout import episodes as episodes_lib
from dapo_jax.rollout import rollout as rollout_lib
from dapo_jax.rollout import sampling
from dapo_jax.settings.section import Section, check

_PG, _LOOP, _RC = objectives.PGConfig, loop.LoopConfig, objectives.RolloutCorrection
_SAMPLER, _ROLLOUT, _EPISODE = sampling.SamplerConfig, rollout_lib.RolloutConfig, episodes_lib.EpisodeConfig
ENGINES = ("continuous", "static")
KV_DTYPES = ("", "float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Rollout(Section):
  """`rollout`: how responses are sampled, by which engine, and (with `env`) as multi-turn episodes."""
  NAME = "rollout"
  group_size: int = 16             # G, responses per prompt
  max_new_tokens: int = 20_480     # L_max, completion tokens (with env: one turn's)
  temperature: float = _SAMPLER.temperature
  top_p: float = _SAMPLER.top_p
  top_k: int = _SAMPLER.top_k
  engine: str = _ROLLOUT.engine    # continuous: slots refilled as samples end; static: a batch until its longest row
  slots: int = _ROLLOUT.slots      # continuous: decode slots of every engine call (0 = a train batch's Q*G rows)
  prefill_tokens: int = _ROLLOUT.prefill_tokens   # continuous: prompt tokens an insert prefills at once
  kv_cache_dtype: str = _ROLLOUT.kv_cache_dtype   # continuous: "" = model.dtype; bfloat16 halves a decode step's reads
  shared_prefix: int = 32          # continuous: prompts of one prefill sharing >= this many first tokens run them once
  kv_layout: str = _ROLLOUT.kv_layout   # continuous: "dense" (P + C positions a slot) or "paged" (docs/paged_cache.md)
  page_size: int = _ROLLOUT.page_size   # paged: tokens per page of the KV cache's pool
  kv_pages: int = _ROLLOUT.kv_pages     # paged: pages in each batch shard's pool (0 = its slots' dense bytes)
  kv_memory_mb: float = _ROLLOUT.kv_memory_mb   # paged: each batch shard's pool in MiB, instead of kv_pages (0 = off)
  paged_attention: str = _ROLLOUT.paged_attention   # paged: "gather" (dense view), "ragged" or "kernel" (Pallas)
  prefix_cache: bool = _ROLLOUT.prefix_cache        # paged: whole prompt pages kept by hash; prefills start after
  rows_per_call: int = _ROLLOUT.rows_per_call     # static: rows per sampler call (0 = the whole generation batch)
  max_staleness: int = _LOOP.max_staleness        # rollout versions a sample may lag its update (docs/async.md)
  use_decoupled_loss: bool = _LOOP.use_decoupled_loss   # stale rows' π_old = this step's policy (AReaL's)
  partial_rollouts: bool = _LOOP.partial_rollouts      # samples in flight continue with each update's params
  # What ends a completion: "generation_config" = the model's EOS ids as verl reads them; "chat" = those plus
  # the chat template's end-of-turn tokens in the vocabulary (<|im_end|>, <|eot_id|>, <|endoftext|>).
  stop: str = "chat"
  env: str = ""                    # "module:Class" (an envs.Env) for episodes; "" = single turn
  env_args: str = "{}"             # JSON keyword arguments of the environment's class
  max_turns: int = _EPISODE.max_turns
  max_episode_tokens: int = 0      # the whole episode's context (0 = max_prompt_len + max_turns x max_new_tokens)
  env_timeout_s: float = _EPISODE.timeout_s       # one environment step; a hung one ends its episode
  env_workers: int = _EPISODE.workers             # environment steps running at once (threads)
  env_failure_score: float = _EPISODE.failure_score   # the reward of an episode cut by its budgets
  env_error: str = _EPISODE.env_error             # failed env: "mask" the row out of the loss, or "score" it
  turn_stop: tuple[str, ...] = ()  # one-token strings that also end a policy turn, kept in its text

  def check(self) -> None:
    self.number("max_new_tokens", 1, integer=True)
    self.number("temperature", 0, allowed=">= 0 (0 = greedy)")
    self.number("top_p", 0, 1, lo_open=True, allowed="in (0, 1]")
    self.number("top_k", 0, integer=True, allowed=">= 0 (0 = off)")
    self.choice("stop", tokenizer_lib.STOP_MODES)
    self.choice("engine", ENGINES, "'continuous' or 'static'")
    self.number("slots", 0, integer=True, allowed=">= 0 (0 = the rows of one generation batch)")
    self.number("max_staleness", 0, integer=True, allowed=">= 0 (0: synchronous, 1: one-step-off)")
    self.choice("kv_cache_dtype", KV_DTYPES, "'' (the model's dtype), 'float32', 'bfloat16' or 'float16'")
    self.number("rows_per_call", 0, integer=True, allowed=">= 0 (0 = the whole generation batch)")
    self.choice("kv_layout", engine_lib.KV_LAYOUTS, "'dense' or 'paged'")
    if self.kv_layout == "paged":
      self.number("page_size", 1, integer=True, allowed=">= 1 (tokens per page)")
      self.number("kv_pages", 0, integer=True, allowed=">= 0 (0 = the dense layout's bytes)")
      self.number("kv_memory_mb", 0, allowed=">= 0 (0 = rollout.kv_pages sets the pool)")
      check(not (self.kv_pages and self.kv_memory_mb), "rollout.kv_memory_mb", self.kv_memory_mb,
            "0 with rollout.kv_pages set (one of the two sizes the pool)")
      self.choice("paged_attention", engine_lib.PAGED_READS, "'gather', 'ragged' or 'kernel'")
      check(self.engine == "continuous", "rollout.kv_layout", self.kv_layout,
            f"'dense' with rollout.engine={self.engine!r} (pages are the continuous engine's)")
    else:
      check(not self.prefix_cache, "rollout.prefix_cache", self.prefix_cache,
            "False with rollout.kv_layout='dense' (the cache is whole pages)")
    if self.partial_rollouts and self.max_staleness != 1:
      raise ConfigError("rollout.partial_rollouts=True needs rollout.max_staleness=1 (a rollout in flight while "
                        "the policy updates)")
    if self.partial_rollouts and self.env:
      raise ConfigError("rollout.partial_rollouts=True needs single-turn samples (rollout.env is set)")
    if self.env:
      self.number("max_turns", 1, integer=True)
      self.number("env_timeout_s", 0, lo_open=True)
      self.number("env_workers", 1, integer=True)
      self.number("env_failure_score")
      self.choice("env_error", episodes_lib.ENV_ERRORS, "'mask' (a failed environment's row leaves the loss) or "
                  "'score' (it scores rollout.env_failure_score)")
      check(self.engine == "continuous", "rollout.engine", self.engine, "'continuous' when rollout.env is set")


@dataclasses.dataclass(frozen=True)
class RolloutCorrection(Section):
  """`dapo.rollout_correction`: verl's algorithm.rollout_correction ("" = null, off), as
  `objectives.RolloutCorrection` documents. The mismatch metrics are logged whatever is set here."""
  NAME = "dapo.rollout_correction"
  rollout_is: str = _RC.rollout_is
  rollout_is_threshold: str = _RC.rollout_is_threshold
  rollout_is_batch_normalize: bool = _RC.rollout_is_batch_normalize
  rollout_rs: str = _RC.rollout_rs
  rollout_rs_threshold: str = _RC.rollout_rs_threshold
  bypass_mode: bool = _RC.bypass_mode
  loss_type: str = _RC.loss_type

  def check(self) -> None:
    self.library()  # Its own checks parse every option string.

  def library(self) -> objectives.RolloutCorrection:
    return objectives.RolloutCorrection(**self.to_dict())


@dataclasses.dataclass(frozen=True)
class Dapo(Section):
  """`dapo`: the batch, dynamic sampling (Eq. 11), the clipped objective and its advantages."""
  NAME = "dapo"
  prompts_per_step: int = 512      # Q, prompts in a train batch
  gen_prompts: int = 1536          # prompts per generation batch (3x Q for dynamic sampling)
  dynamic_sampling: bool = True    # drop groups whose filter_metric is all equal (Eq. 11)
  max_gen_batches: int = 10        # at most this many generation batches per step; 0 = unlimited
  streaming: bool = _LOOP.streaming          # admit prompts as they may be needed (False: the reference)
  admit_ahead: bool = _LOOP.admit_ahead      # streaming admits by the running keep rate
  admit_margin: float = _LOOP.admit_margin   # that margin in standard deviations of the expected keeps
  filter_metric: str = _ROLLOUT.filter_metric   # what must vary in a group: acc | score | seq_reward | seq_final_reward
  on_cap: str = "train"            # at the cap: "train" on what was kept, or "raise" (the reference)
  carry_over: bool = True          # keep surplus groups for the next step (the reference discards them)
  eps_low: float = _PG.eps_low     # decoupled clip (Eq. 10)
  eps_high: float = _PG.eps_high
  clip_ratio_c: float = _PG.clip_ratio_c   # dual clip for A < 0; 0 = off
  policy_loss: str = _PG.policy_loss   # verl's registry (loss.POLICY_LOSSES; docs/losses.md)
  tau_pos: float = _PG.tau_pos     # sapo: gate temperature for A > 0
  tau_neg: float = _PG.tau_neg     # sapo: for A <= 0
  clip_cov_ratio: float = _PG.clip_cov_ratio   # clip_cov: fraction of tokens cut
  clip_cov_lb: float = _PG.clip_cov_lb         # clip_cov: covariance band
  clip_cov_ub: float = _PG.clip_cov_ub
  kl_cov_ratio: float = _PG.kl_cov_ratio       # kl_cov: fraction of tokens
  ppo_kl_coef: float = _PG.ppo_kl_coef         # kl_cov: |log r| coefficient
  dro_beta: float = _PG.dro_beta               # dro: β of the quadratic log-ratio penalty (> 0 when used)
  rollout_correction: RolloutCorrection = RolloutCorrection()   # sampler-vs-trainer correction
  loss_agg: str = _PG.loss_agg     # loss.AGG_MODES: token_mean | token_sum | seq_mean_token_{mean,sum,sum_norm} | ...
  verl_microbatch_weighting: bool = _PG.verl_microbatch_weighting   # micro-batch token means weighted by rows
  norm_adv_by_std: bool = True     # False = Dr.GRPO (mean-only)
  overlong_buffer: int = 4096      # L_cache (Eq. 13); 0 = off
  overlong_penalty: float = _ROLLOUT.overlong_penalty
  overlong_filter: bool = False    # mask truncated samples out of the loss
  kl_coef: float = _PG.kl_coef     # DAPO: no KL, no reference model
  kl_estimator: str = _PG.kl_estimator
  entropy_coeff: float = _PG.entropy_coeff   # entropy bonus: the loss minus this x the aggregated entropy (verl's)
  use_adaptive_entropy: bool = _PG.use_adaptive_entropy   # TRL's controller on that coefficient (its initial value)
  entropy_target: float = _PG.entropy_target   # adaptive: the mean per-token entropy (nats) held
  entropy_coef_delta: float = _PG.entropy_coef_delta   # adaptive: the coefficient's step per update
  entropy_coef_min: float = _PG.entropy_coef_min
  entropy_coef_max: float = _PG.entropy_coef_max
  adv_estimator: str = _LOOP.adv_estimator   # advantages.ESTIMATORS; gae = PPO (critic), distill = a teacher
  gdpo_reward_keys: tuple[str, ...] = _ROLLOUT.gdpo_reward_keys   # gdpo: the reward's components (() = the reward)
  gdpo_reward_weights: tuple[float, ...] = _LOOP.gdpo_reward_weights   # gdpo: their weights (() = ones)
  teacher_dir: str = ""            # distill: the teacher, an HF directory of the policy's tokenizer

  def check(self) -> None:
    if self.policy_loss in ("dppo_tv", "dppo_kl"):  # DPPO: divergence bounds, not ratio ranges
      self.number("eps_low", 0, lo_open=True)
    else:  # cispo: 1 = no lower bound on the importance weight (MiniMax-M1)
      self.number("eps_low", 0, 1, lo_open=True, hi_open=self.policy_loss != "cispo")
    self.number("eps_high", 0, lo_open=True)
    c = self.number("clip_ratio_c", 0)
    check(c == 0 or c > 1, "dapo.clip_ratio_c", c, "0 (off) or > 1 (dual clip)")
    self.choice("loss_agg", loss_lib.AGG_MODES)
    self.choice("policy_loss", loss_lib.POLICY_LOSSES)
    self.choice("on_cap", ("train", "raise"), "'train' or 'raise'")
    self.choice("filter_metric", rollout_lib.FILTER_METRICS)
    self.choice("adv_estimator", adv_lib.ESTIMATORS)
    self.choice("kl_estimator", ("k1", "k3"), "'k1' or 'k3'")
    keys, weights = self.gdpo_reward_keys, self.gdpo_reward_weights
    if keys or weights:
      check(self.adv_estimator == "gdpo", "dapo.gdpo_reward_keys", keys, "() unless dapo.adv_estimator='gdpo'")
      check(all(isinstance(k, str) and k for k in keys), "dapo.gdpo_reward_keys", keys, "names of reward entries")
      check(not weights or len(weights) == max(len(keys), 1), "dapo.gdpo_reward_weights", weights,
            f"() or one weight per dapo.gdpo_reward_keys entry ({max(len(keys), 1)})")
      check(all(isinstance(w, (int, float)) and not isinstance(w, bool) and abs(w) < float("inf") for w in weights),
            "dapo.gdpo_reward_weights", weights, "finite numbers")
    self.number("kl_coef", 0)
    self.number("entropy_coeff", 0)
    if self.use_adaptive_entropy:
      self.number("entropy_target", 0, lo_open=True)
      self.number("entropy_coef_delta", 0, lo_open=True)
      lo = self.number("entropy_coef_min", 0)
      self.number("entropy_coef_max", lo, allowed=f">= dapo.entropy_coef_min={lo}")
    self.number("overlong_penalty", 0)
    self.number("max_gen_batches", 0, integer=True, allowed=">= 0 (0 = unlimited)")
    self.number("admit_margin", 0, allowed=">= 0 (standard deviations of the expected keeps)")
    Q = self.number("prompts_per_step", 1, integer=True)
    if self.dynamic_sampling:
      self.number("gen_prompts", Q, integer=True, allowed=f">= dapo.prompts_per_step={Q} when dynamic sampling is on")

  def pg_knobs(self) -> dict:
    """The policy-loss modes' knobs, as `objectives.PGConfig` names them."""
    return {k: getattr(self, k) for k in objectives.PG_KNOBS}


@dataclasses.dataclass(frozen=True)
class PPO(Section):
  """`ppo`: the token-level estimators (dapo.adv_estimator gae or reinforce_pp): each token's reward is
  -β·(log π - log π_ref), plus the score on the last one (verl's use_kl_in_reward). Defaults are verl's."""
  NAME = "ppo"
  gamma: float = _LOOP.gamma       # γ, discount per token
  lam: float = _LOOP.lam           # λ of GAE
  kl_coef: float = 0.001           # β (the first one, with the adaptive controller); 0 = no KL
  kl_ctrl: str = "fixed"           # fixed | adaptive: β·(1 + clip(KL/target_kl - 1, ±0.2)·n/horizon)
  target_kl: float = 0.1           # adaptive: the KL per token that β steers to (k1, nats)
  horizon: int = 10_000            # adaptive: responses over which β changes by at most 20%

  def check(self) -> None:
    self.number("gamma", 0, 1)
    self.number("lam", 0, 1)
    self.number("kl_coef", 0, allowed=">= 0 (0 = no KL in the reward)")
    self.choice("kl_ctrl", ("fixed", "adaptive"), "'fixed' or 'adaptive'")
    if self.kl_ctrl == "adaptive":
      self.number("target_kl", 0, lo_open=True)
      self.number("horizon", 0, lo_open=True)

  def kl_controller(self):
    """β of the KL-shaped reward as `kl_ctrl` says."""
    if self.kl_ctrl == "adaptive":
      return adv_lib.AdaptiveKLController(self.kl_coef, self.target_kl, self.horizon)
    return adv_lib.FixedKLController(self.kl_coef)


@dataclasses.dataclass(frozen=True)
class Critic(Section):
  """`critic`: PPO's value model (dapo.adv_estimator="gae"), its own params and optimizer on the policy's
  mesh, checkpointed with the policy."""
  NAME = "critic"
  init: str = "policy"             # "policy": the policy's trunk, a zero scalar head; "rm": a reward model's dir
  model_dir: str = ""              # init="rm": that directory ("" = the rm:DIR of reward.fn)
  lr: float = 1e-5                 # the value model's peak learning rate
  warmup_steps: int = 0            # rollout steps of linear warm-up
  weight_decay: float = 0.0        # AdamW's, decoupled
  grad_clip: float = optim.OptimConfig.grad_clip
  clip_range: float = 0.5          # values move at most this far from the rollout's (verl's cliprange_value)

  def check(self) -> None:
    self.choice("init", ("policy", "rm"), "'policy' (the policy's trunk, a zero head) or 'rm' (a reward model's "
                "directory: critic.model_dir, or the rm:DIR of reward.fn)")
    self.number("lr", 0, lo_open=True)
    self.number("warmup_steps", 0, integer=True)
    self.number("weight_decay", 0)
    self.number("grad_clip", 0, allowed=">= 0 (0 = off)")
    self.number("clip_range", 0, lo_open=True)

  def optim_config(self) -> optim.OptimConfig:
    return optim.OptimConfig(lr=self.lr, warmup_steps=self.warmup_steps, weight_decay=self.weight_decay,
                             grad_clip=self.grad_clip)


@dataclasses.dataclass(frozen=True)
class Train(Section):
  """`train`: the update's schedule and shapes, checkpoints, evaluations and what a run records."""
  NAME = "train"
  num_steps: int = 500             # rollout steps
  minibatches: int = 16            # optimizer updates per rollout step and epoch
  ppo_epochs: int = 1              # passes over a rollout step's batch
  num_microbatches: int = 0        # gradient accumulation inside one update; 0 = auto (microbatch_tokens)
  microbatch_tokens: int = train_step.MICROBATCH_TOKENS   # auto: micro-batches of at most this many tokens (and logits)
  share_prompt: bool = True        # a group's prompt runs through the model once (exact)
  shared_prefix: int = 32          # and a mini-batch's common first tokens, in multiples of this many (0 = off)
  length_buckets: int = 8          # micro-batches cut to one of this many lengths (0 = pad to max_new_tokens)
  packing: bool = False            # rows packed without padding into sequences of microbatch_tokens (exact)
  packing_block: int = _LOOP.packing_block   # packed: attention reads only the key blocks of this many tokens it needs
  ckpt_every: int = 5              # rollout steps between checkpoints (0 = at the end only)
  keep_ckpts: int = 3              # checkpoints kept
  eval_every: int = 5              # rollout steps between held-out evaluations (0 = start and end only)
  log_samples_every: int = 5       # rollout steps between logged sample texts (0 = never)
  max_bad_steps: int = _LOOP.max_bad_steps   # stop after this many non-finite updates in a row
  # Every scored rollout to WORKDIR/rollouts/step_<N>.jsonl.gz (and evaluations' samples) every this many
  # rollout steps; 0 = off; -1 = every step on small jobs (Q·G·max_new_tokens <= 2^20), else off.
  dump_rollouts_every: int = -1
  profile_steps: tuple[int, ...] = _LOOP.profile_steps   # (a, b): a JAX profiler trace of rollout steps a..b
  peak_flops: float = _LOOP.peak_flops       # FLOP/s per device for perf/mfu; 0 = by device kind

  def check(self) -> None:
    self.number("minibatches", 1, integer=True)
    self.number("ppo_epochs", 1, integer=True)
    self.number("num_microbatches", 0, integer=True, allowed=">= 1, or 0 (auto)")
    self.number("microbatch_tokens", 1, integer=True, allowed="a positive token budget")
    self.number("shared_prefix", 0, integer=True, allowed=">= 0 (0 = each group's prompt whole)")
    self.number("length_buckets", 0, integer=True, allowed=">= 0 (0 = every row padded to rollout.max_new_tokens)")
    self.number("packing_block", 0, integer=True, allowed=">= 0 (0 = dense attention in each packed sequence)")
    check(not (self.packing and self.num_microbatches), "train.num_microbatches", self.num_microbatches,
          "0 with train.packing (packed micro-batches are sized by train.microbatch_tokens)")
    for f in ("num_steps", "ckpt_every", "eval_every", "log_samples_every"):
      self.number(f, 0, integer=True)
    self.number("keep_ckpts", 1, integer=True)
    self.number("max_bad_steps", 1, integer=True)
    self.number("dump_rollouts_every", -1, integer=True, allowed="an integer >= -1")
    steps = self.profile_steps
    check(steps == () or (len(steps) == 2 and all(isinstance(x, int) for x in steps) and 1 <= steps[0] <= steps[1]),
          "train.profile_steps", steps, "() or (a, b) with 1 <= a <= b (rollout steps)")
    self.number("peak_flops", 0)


@dataclasses.dataclass(frozen=True)
class Eval(Section):
  """`eval`: the held-out evaluation (mean@k, and greedy)."""
  NAME = "eval"
  k: int = 32                      # samples per held-out prompt (mean@k)
  temperature: float = 1.0         # sampling temperature of the held-out samples
  top_p: float = 0.7               # their nucleus mass
  greedy: bool = False             # also one greedy answer per prompt
  max_new_tokens: int = 0          # 0 = rollout.max_new_tokens
  reward_fn: str = ""              # "" = reward.fn; e.g. a rule check for a run trained on an RM

  def check(self) -> None:
    self.number("k", 1, integer=True)
    self.number("temperature", 0, allowed=">= 0 (0 = greedy)")
    self.number("top_p", 0, 1, lo_open=True, allowed="in (0, 1]")
    self.number("max_new_tokens", 0, integer=True, allowed=">= 0 (0 = rollout.max_new_tokens)")
    check(isinstance(self.reward_fn, str) and (not self.reward_fn or ":" in self.reward_fn), "eval.reward_fn",
          self.reward_fn, "'' (reward.fn) or a reward spec like reward.fn")
