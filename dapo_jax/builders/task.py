"""The task of a run, from its config: datasets and typed prompts, episodes' environments, the reward.

The first builders of the launch boundary: `model` builds the tokenizer from these examples, `rl` and
`pipelines` the runs.
"""
from __future__ import annotations

import json
import os

from dapo_jax import rewards as rewards_lib
from dapo_jax.builders.checks import ConfigError, check, dataset_files, typed
from dapo_jax.data import prompts as data_lib
from dapo_jax.envs import base as env_lib
from dapo_jax.rollout import episodes as episodes_lib
from dapo_jax.settings import pick


@typed
def datasets(cfg) -> tuple[list[data_lib.Example], list[data_lib.Example]]:
  """(train, held-out) examples."""
  d = cfg.data
  if d.task == "arith":
    kw = dict(seed=cfg.seed, digits=d.digits, ops=d.ops, heldout_fraction=d.heldout_fraction,
              digits_b=d.digits_b, fewshot=d.fewshot)
    if d.prompt_template:
      kw["template"] = d.prompt_template
    return (data_lib.arith_examples(max(cfg.sft.num_examples, 4096), split="train", **kw),
            data_lib.arith_examples(d.num_eval, split="heldout", **kw))
  if d.task == "reasoning_gym":
    from dapo_jax.data import reasoning_gym
    try:
      settings = json.loads(d.rg_settings) if d.rg_settings else {}
    except json.JSONDecodeError as e:
      raise ValueError(f"data.rg_settings={d.rg_settings!r} is not JSON ({e})") from None
    kw = dict(template=d.prompt_template) if d.prompt_template else {}
    return reasoning_gym.examples(tuple(d.rg_tasks), d.rg_num_train, d.num_eval, seed=cfg.seed, settings=settings,
                                  fewshot=d.fewshot, **kw)
  if d.task == "count_shapes":
    from dapo_jax.data import count_shapes
    kw = dict(seed=cfg.seed, max_count=d.max_count, blank=d.blank_images, heldout_fraction=d.heldout_fraction)
    return (count_shapes.examples(max(cfg.sft.num_examples, 4096), "train", **kw),
            count_shapes.examples(d.num_eval, "heldout", **kw))
  if d.task != "file":
    raise ValueError(f"data.task={d.task!r}; expected 'file', 'arith', 'reasoning_gym' or 'count_shapes'")
  files = [f for f in d.train_files if f]
  if not files:
    raise ValueError("data.train_files is empty; set --config.data.train_files=/path/to/train.parquet")
  template = d.prompt_template or None
  check = row_check(cfg)
  load = lambda f: data_lib.load_file(f, missing_answer=d.missing_answer, prompt_template=template, check=check,
                                      pan_and_scan=d.pan_and_scan)
  train = [ex for f in files for ex in load(f)]
  evals = [ex for f in d.eval_files if f for ex in load(f)]
  return train, evals[: d.num_eval] if d.num_eval else evals


def source_names(files) -> list[str]:
  """Each train file's name in the metrics (data/source/<name>/...): its base name without extension,
  or its position where two files share one."""
  names = [os.path.splitext(os.path.basename(f))[0] for f in files]
  return names if len(set(names)) == len(names) else [f"source{k}" for k in range(len(files))]


@typed
def data_iterator(cfg, train: list[data_lib.Example], process_index: int = 0, process_count: int = 1):
  """The training prompts' stream: the examples shuffled by epoch (`PromptIterator`), or with
  `data.train_weights` each train file in its share (`MixedIterator`); with `data.curriculum`, the
  prompts set aside skipped (`data.curriculum.Curriculum`)."""
  d = cfg.data
  if not d.train_weights:
    it = data_lib.PromptIterator(train, seed=cfg.seed, process_index=process_index, process_count=process_count)
  else:
    files = [f for f in d.train_files if f]
    sources = [[ex for ex in train if ex.source == f] for f in files]
    empty = [f for f, part in zip(files, sources) if not part]
    if empty:
      raise ConfigError(f"data.train_weights: {empty[0]} gave no training rows")
    it = data_lib.MixedIterator(sources, d.train_weights, seed=cfg.seed, process_index=process_index,
                                process_count=process_count, names=source_names(files))
  if not d.curriculum:
    return it
  from dapo_jax.data import curriculum  # noqa: PLC0415
  return curriculum.Curriculum(it, d.revisit_after, size=len(train), aside=d.curriculum_aside,
                               streak=d.curriculum_streak)


@typed
def row_check(cfg):
  """What every dataset row must pass for this run to use it: the `check_ground_truth` of each reward
  function that has one (`rewards.code.python_tests`: a HumanEval task object) and the environment's
  `check_example`; None when nothing checks. Each raises a ValueError saying what is wrong."""
  r = cfg.reward
  fns = [f for f in r.fns if f]
  specs = [spec for spec, _ in rewards_lib.parse_weighted(fns)] if fns else [r.fn]
  checks = []
  for spec in specs:
    if ":" in spec and not spec.startswith(("http://", "https://", "rm:", "judge:")):  # A function, not a server.
      check = getattr(rewards_lib.resolve(spec), "check_ground_truth", None)
      if check is not None:
        checks.append(lambda ex, check=check: check(ex.ground_truth))
  if cfg.rollout.env:
    make_env, _ = episodes(cfg)
    check = getattr(make_env(), "check_example", None)  # Any class with reset and step is an environment.
    if check is not None:
      checks.append(check)
  if not checks:
    return None

  def check_all(ex) -> None:
    for check in checks:
      check(ex)
  return check_all


@typed
def user_prompt(cfg, question: str):
  """A question typed by a person, put as the run's training prompts were (`launch.sample`): the
  arithmetic task's instruction and worked examples, or a file task's `data.prompt_template`."""
  d = cfg.data
  if d.task == "arith":
    kw = dict(template=d.prompt_template) if d.prompt_template else {}
    return data_lib.arith_prompt(question, seed=cfg.seed, digits=d.digits, ops=d.ops, digits_b=d.digits_b,
                                 heldout_fraction=d.heldout_fraction, fewshot=d.fewshot, **kw)
  if d.task == "reasoning_gym":  # The task's instruction around the question, after its worked examples.
    from dapo_jax.data import reasoning_gym
    template = d.prompt_template or reasoning_gym.INSTRUCTION
    settings = json.loads(d.rg_settings) if d.rg_settings else {}
    shots = reasoning_gym.shots(tuple(d.rg_tasks), d.fewshot, d.num_eval, seed=cfg.seed, settings=settings,
                                template=template)
    return data_lib.Example(messages=shots + ({"role": "user", "content": template.format(question=question)},),
                            ground_truth="", data_source="reasoning_gym")
  return d.prompt_template.format(problem=question) if d.prompt_template else question


@typed
def user_prompt_messages(cfg, question: str) -> list[dict]:
  """`user_prompt` as chat messages (the policy server's form)."""
  prompt = user_prompt(cfg, question)
  return [dict(m) for m in prompt.messages] if not isinstance(prompt, str) else [{"role": "user", "content": prompt}]


@typed
def completion_len(cfg) -> int:
  """C, the completion positions of a row: rollout.max_new_tokens, or with an environment the
  episode's budget after the prompt (policy turns and observations)."""
  r = cfg.rollout
  if not r.env:
    return r.max_new_tokens
  return episodes_lib.response_budget(cfg.data.max_prompt_len, r.max_new_tokens, r.max_turns, r.max_episode_tokens)


@typed
def episodes(cfg, tok=None):
  """(environment factory, EpisodeConfig) of `rollout.env`, or (None, None) for single turns."""
  r = cfg.rollout
  if not r.env:
    return None, None
  return env_lib.resolve(r.env, r.env_args), episodes_lib.EpisodeConfig(
      max_turns=r.max_turns, timeout_s=r.env_timeout_s, workers=r.env_workers, failure_score=r.env_failure_score,
      env_error=r.env_error, turn_stop_ids=turn_stop_ids(cfg, tok) if tok is not None else ())


@typed
def turn_stop_ids(cfg, tok) -> tuple[int, ...]:
  """The ids of `rollout.turn_stop` (episodes only), each a single token of the vocabulary."""
  stops = cfg.rollout.turn_stop
  if not stops:
    return ()
  if not cfg.rollout.env:
    raise ConfigError(f"rollout.turn_stop={stops!r} ends turns of episodes; set rollout.env or leave it empty")
  ids = []
  for s in stops:
    found = tok(s, add_special_tokens=False)["input_ids"] if isinstance(s, str) and s else []
    if len(found) != 1:
      raise ConfigError(f"rollout.turn_stop: {s!r} is {len(found)} tokens of this tokenizer ({found}); "
                        "each must be exactly one token")
    ids.append(found[0])
  return tuple(ids)


@typed
def reward(cfg):
  """The rollout's reward from `reward.fn` (or weighted `reward.fns`, when the config has them):
  a function path (process pool), http(s)://HOST:PORT (an RM server), rm:DIR (a reward model
  in this process, on the accelerator) or judge:URL (a language model grading by a rubric)."""
  r = cfg.reward
  mode = r.sandbox
  if mode != "namespaces" or any("python_tests" in f for f in (r.fn, *(r.fns))):
    from dapo_jax.rewards import code  # noqa: PLC0415
    code.set_sandbox(mode)  # A host that cannot sandbox fails here, saying what is missing.
  fns = tuple(f for f in (r.fns) if f)
  judge = pick(rewards_lib.JudgeConfig, r)
  if fns:
    return rewards_lib.CombinedReward(rewards_lib.parse_weighted(fns), r.timeout_s, r.workers, judge)
  return rewards_lib.make_reward(r.fn, r.timeout_s, r.workers, judge)


@typed
def preference_data(cfg, name: str):
  """(train pairs, held-out pairs) of the `rm` or `dpo` section's files."""
  from dapo_jax.data import preference  # noqa: PLC0415
  s = getattr(cfg, name)
  load = lambda files: [p for f in files for p in preference.load_pairs(f)]
  return load(dataset_files(s, "train_files", name)), load(dataset_files(s, "eval_files", name))


@typed
def conversation_data(cfg):
  """(train, held-out) conversations of `data.train_files` (held out by prompt hash, or `data.eval_files`)."""
  from dapo_jax.data import conversations  # noqa: PLC0415
  check(any(cfg.data.train_files), "data.train_files", cfg.data.train_files, "at least one conversation file")
  for f in ("steps", "batch_size", "seq_len"):
    cfg.sft.number(f, 1, integer=True)
  train = [c for f in cfg.data.train_files if f for c in conversations.load_conversations(f)]
  evals = [c for f in cfg.data.eval_files if f for c in conversations.load_conversations(f)]
  if evals:
    return train, evals
  if cfg.chat_sft.heldout_fraction > 0:
    return conversations.split_heldout(train, cfg.chat_sft.heldout_fraction)
  return train, []
