"""An RL run from its config: the sampler, rollout, objective, trainer, evaluator, critic and teacher,
assembled into `loop.DAPO` (`dapo`), and `run`, what `python -m launch.train` does.

Each library config is picked from the sections by field name (`settings.pick`); only what a config
does not hold as it is (derived sizes, resolved defaults) is spelled out here.
"""
from __future__ import annotations

import dataclasses
import os

import jax

from dapo_jax import advantages as adv_lib
from dapo_jax import evaluate, loop, objectives, ppo, rlhf_objectives, sharding, train_step
from dapo_jax import metrics as metrics_lib
from dapo_jax import rewards as rewards_lib
from dapo_jax.builders import record
from dapo_jax.builders.checks import ConfigError, typed, validate
from dapo_jax.builders.model import initial_model, model_dir, tokenizer, trainer
from dapo_jax.builders.task import completion_len, data_iterator, datasets, episodes, reward, turn_stop_ids
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.hf import convert as hf
from dapo_jax.model import transformer as model_lib
from dapo_jax.rollout import rollout as rollout_lib
from dapo_jax.rollout import sampling
from dapo_jax.settings import pick


@typed
def sampler_config(cfg, tok, source_dir: str = "") -> sampling.SamplerConfig:
  eos = tuple(dict.fromkeys((*tokenizer_lib.stop_ids(tok, source_dir, cfg.rollout.stop), *turn_stop_ids(cfg, tok))))
  return pick(sampling.SamplerConfig, cfg.rollout, max_new_tokens=completion_len(cfg), eos_ids=eos,
              pad_id=tok.pad_token_id)


@typed
def eval_sampler_config(cfg, sampler_cfg: sampling.SamplerConfig) -> sampling.SamplerConfig:
  e = cfg.eval
  return dataclasses.replace(sampler_cfg, temperature=e.temperature, top_p=e.top_p, top_k=0,
                             max_new_tokens=e.max_new_tokens or sampler_cfg.max_new_tokens)


@typed
def rollout_config(cfg) -> rollout_lib.RolloutConfig:
  r = cfg.rollout
  slots = r.slots or cfg.dapo.prompts_per_step * r.group_size
  return pick(rollout_lib.RolloutConfig, cfg.data, r, cfg.dapo, slots=slots,
              turn_tokens=r.max_new_tokens if r.env else 0)


@typed
def pg_config(cfg) -> objectives.PGConfig:
  d, t, r = cfg.dapo, cfg.train, cfg.rollout
  return pick(objectives.PGConfig, d, clip_ratio_c=d.clip_ratio_c if d.clip_ratio_c > 0 else None,
              rollout_correction=d.rollout_correction.library(), norm_len=completion_len(cfg),
              temperature=r.temperature if r.temperature > 0 else 1.0,  # greedy: unscaled
              old_is_current=t.minibatches * t.ppo_epochs == 1, group_size=r.group_size if t.share_prompt else 0)


@typed
def loop_config(cfg) -> loop.LoopConfig:
  t = cfg.train
  buckets = train_step.length_buckets(completion_len(cfg), t.length_buckets) if t.length_buckets else ()
  return pick(loop.LoopConfig, cfg.dapo, t, cfg.rollout, cfg.ppo, seed=cfg.seed,
              reference=cfg.dapo.kl_coef > 0 or kl_in_reward(cfg), length_buckets=buckets,
              shared_prefix=t.shared_prefix if t.share_prompt else 0, dump_rollouts_every=dump_rollouts_every(cfg),
              rollout_correction=cfg.dapo.rollout_correction.library())


@typed
def dump_rollouts_every(cfg) -> int:
  """`train.dump_rollouts_every`, with -1 resolved: every step when a step generates at most 2^20 tokens."""
  every = cfg.train.dump_rollouts_every
  if every == -1:
    every = int(cfg.dapo.prompts_per_step * cfg.rollout.group_size * completion_len(cfg) <= 2 ** 20)
  return every


@typed
def kl_in_reward(cfg) -> bool:
  """Whether the token rewards carry -β·KL to a frozen reference (PPO's estimators, β > 0; distillation's
  advantage is the teacher's, so it needs no reference)."""
  return cfg.dapo.adv_estimator in adv_lib.KL_SHAPED_ESTIMATORS and cfg.ppo.kl_coef > 0


@typed
def kl_controller(cfg):
  """β of the KL-shaped reward (`ppo.kl_ctrl`), or None without one."""
  return cfg.ppo.kl_controller() if kl_in_reward(cfg) else None


@typed
def critic(cfg, model_cfg: model_lib.ModelConfig, params, tok, mesh, group_size: int) -> ppo.Critic:
  """PPO's value model (`critic`): the policy's trunk with a zero scalar head, or a reward model's
  directory; its own Trainer (rlhf_objectives.value_model) and optimizer on the policy's mesh."""
  from dapo_jax.pipelines import rm  # noqa: PLC0415
  c = cfg.critic
  if c.init == "rm":
    path = c.model_dir or cfg.reward.fn.removeprefix("rm:")
    critic_cfg, critic_params = hf.load_scalar(path, **cfg.model.runtime_overrides())
    tokenizer_lib.check_vocab(tok, critic_cfg.vocab_size, f"{path}/config.json (critic.model_dir)")
    if critic_cfg.vocab_size != model_cfg.vocab_size:
      raise ConfigError(f"critic.model_dir={path!r}: vocab_size={critic_cfg.vocab_size}, the policy's is "
                        f"{model_cfg.vocab_size}; the value model must read the policy's tokens")
  else:
    critic_cfg, critic_params = model_cfg, rm.from_lm(jax.device_get(params))
  objective = rlhf_objectives.value_model(critic_cfg, c.clip_range, group_size)
  trainer_ = train_step.Trainer(critic_cfg, c.optim_config(), mesh, objective,
                                num_microbatches=cfg.train.num_microbatches,
                                microbatch_tokens=cfg.train.microbatch_tokens, head="scalar")
  values = trainer_.forward(rlhf_objectives.completion_values(critic_cfg, group_size))
  return ppo.Critic(trainer_, values, critic_params)


@typed
def evaluator(cfg, rollout: rollout_lib.Rollout, examples, progress: bool = False) -> evaluate.Evaluator:
  # Static sampler: chunks of the rollout's row count, so the compiled sampler shapes are few.
  rows = max(cfg.dapo.gen_prompts * cfg.rollout.group_size // cfg.eval.k, 1)
  e = cfg.eval
  reward_ = rewards_lib.make_reward(e.reward_fn, cfg.reward.timeout_s, cfg.reward.workers) if e.reward_fn else None
  return evaluate.Evaluator(rollout, examples, k=e.k, sampler_cfg=eval_sampler_config(cfg, rollout.sampler_cfg),
                            greedy=e.greedy, seed=cfg.seed, rows=rows, progress=progress, reward=reward_)


@typed
def dapo(cfg, workdir: str, mesh=None) -> loop.DAPO:
  """Everything one DAPO run needs, built from its config (a context manager: see `loop.DAPO`)."""
  validate(cfg)  # Once, before the mesh, any worker process, compile or generation.
  # The trainer's mesh; with mesh.rollout_devices, the rollout engine's own (else it shares this one).
  mesh, rollout_mesh = (mesh, None) if mesh is not None else sharding.split_meshes(cfg.mesh.to_dict())
  os.makedirs(workdir, exist_ok=True)
  record.lock(workdir, jax.process_index())  # A second run on this workdir stops here, naming the first.
  record.save_run_config(cfg, workdir)  # A resume that changes the model, tokens or objective fails here.
  reward_ = reward(cfg)
  try:
    train, evals = datasets(cfg)
    tok = tokenizer(cfg, workdir, train)
    for ex in train[:1]:
      tokenizer_lib.render(tok, ex.messages, cfg.data.chat_template)  # Template errors now.
    model_cfg, params = initial_model(cfg, workdir, tok, mesh, train)
    pg = pg_config(cfg)
    trainer_ = trainer(cfg, model_cfg, mesh, objectives.policy_gradient(model_cfg, pg))
    logprobs = trainer_.forward(objectives.completion_logprobs(model_cfg, pg.temperature, pg.group_size))
    with_sum_pi_squared, with_experts = None, None
    if model_cfg.router_replay == "R2":
      with_experts = trainer_.forward(objectives.completion_logprobs_and_experts(model_cfg, pg.temperature,
                                                                                 pg.group_size))
    if cfg.dapo.adv_estimator == "optimal_token_baseline":
      with_sum_pi_squared = trainer_.forward(objectives.completion_logprobs_and_sum_pi_squared(
          model_cfg, pg.temperature, pg.group_size))
    rollout = rollout_lib.Rollout(tok, model_cfg, rollout_mesh or mesh, rollout_config(cfg),
                                  sampler_config(cfg, tok, model_dir(cfg, workdir)), reward_, *episodes(cfg, tok))
    rollout.keep_pixels = cfg.model.train_vision  # The update's passes run the tower that trains on them.
    if cfg.data.pan_and_scan and getattr(model_cfg.vision, "kind", None) != "siglip":
      raise ConfigError("data.pan_and_scan=True: Gemma 3's crops go with its tower (model.vision.kind='siglip'); "
                        f"this model's is {getattr(model_cfg.vision, 'kind', 'none (a text model)')!r}")
    data_iter = data_iterator(cfg, train, jax.process_index(), jax.process_count())
    critic_ = critic(cfg, model_cfg, params, tok, mesh, pg.group_size) if cfg.dapo.adv_estimator == "gae" else None
    teacher_ = teacher(cfg, model_cfg, tok, mesh, pg) if cfg.dapo.adv_estimator == "distill" else None
    evaluator_ = evaluator(cfg, rollout, evals)
    if hasattr(data_iter, "watch"):  # data.curriculum: every scored group's outcome.
      data_iter.watch(rollout)
  except BaseException:
    reward_.close()
    raise
  try:
    return loop.DAPO(loop_config(cfg), trainer=trainer_, logprobs=logprobs, rollout=rollout,
                     evaluator=evaluator_, data_iter=data_iter, params=params,
                     workdir=workdir, keep_ckpts=cfg.train.keep_ckpts,
                     writer_cfg=cfg.metrics.library(), run_config=cfg.to_dict(),
                     critic=critic_, kl_ctrl=kl_controller(cfg), teacher=teacher_,
                     logprobs_sum_pi_squared=with_sum_pi_squared, logprobs_experts=with_experts)
  except BaseException:
    reward_.close()
    evaluator_.close()
    raise


@typed
def run(cfg, workdir: str, mesh=None) -> dict:
  """Trains with DAPO as the config `cfg` says; resumes from `workdir` if it holds a checkpoint.
  Returns the last step's metrics."""
  with dapo(cfg, workdir, mesh) as run_:
    last = run_.run()
  ev = {k: v for k, v in last.items() if k.startswith("val/")}
  if ev:
    print("Held-out after RL: " + metrics_lib.format_eval(ev), flush=True)
  return last


@typed
def teacher(cfg, model_cfg: model_lib.ModelConfig, tok, mesh, pg: objectives.PGConfig):
  """On-policy distillation's teacher from `dapo.teacher_dir` (any HF directory we load): (its
  completion log-prob function, its params on the mesh). Refused at start unless it reads the
  policy's token ids as the policy does (one vocabulary size, one tokenizer), naming both."""
  path = cfg.dapo.teacher_dir
  if not path:
    raise ConfigError("dapo.adv_estimator='distill' needs dapo.teacher_dir=HF_DIR (the teacher model)")
  teacher_cfg, params = hf.load(path, **cfg.model.runtime_overrides())
  student = cfg.model.hf_dir or cfg.model.init
  adv_lib.check_teacher_vocab(model_cfg.vocab_size, teacher_cfg.vocab_size, student=student, teacher=path)
  if any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
    if tokenizer_lib.load(path).get_vocab() != tok.get_vocab():
      raise ConfigError(f"dapo.teacher_dir={path!r}: its tokenizer is not the policy's ({student!r}); "
                        "distillation scores the policy's token ids, so both need one tokenizer")
  teacher_trainer = train_step.Trainer(teacher_cfg, cfg.optim.library(), mesh,
                                       objectives.policy_gradient(teacher_cfg, pg),
                                       num_microbatches=cfg.train.num_microbatches,
                                       microbatch_tokens=cfg.train.microbatch_tokens)
  logprobs = teacher_trainer.forward(objectives.completion_logprobs(teacher_cfg, pg.temperature, pg.group_size))
  return logprobs, jax.device_put(params, teacher_trainer.params_sharding)
