"""The supervised pipelines from a config: SFT (the arithmetic task's solutions or conversation files),
the reward model and DPO on preference pairs, and DPO's greedy held-out check."""
from __future__ import annotations

import os

import jax

from dapo_jax import evaluate, sharding
from dapo_jax import rewards as rewards_lib
from dapo_jax.builders import record
from dapo_jax.builders.checks import typed
from dapo_jax.builders.model import chat_tokenizer, padded_vocab, sft_config, tokenizer
from dapo_jax.builders.task import conversation_data, datasets
from dapo_jax.data import prompts as data_lib
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.hf import convert as hf
from dapo_jax.model import transformer as model_lib
from dapo_jax.pipelines import dpo, rm, sft_chat
from dapo_jax.pipelines import sft as sft_lib
from dapo_jax.rollout import rollout as rollout_lib
from dapo_jax.rollout import sampling
from dapo_jax.settings import pick


def _pair_config(cfg, cls, section):
  return pick(cls, section, chat_template=cfg.data.chat_template, microbatch_tokens=cfg.train.microbatch_tokens,
              seed=cfg.seed)


@typed
def rm_config(cfg) -> rm.RMConfig:
  return _pair_config(cfg, rm.RMConfig, cfg.rm)


@typed
def dpo_config(cfg) -> dpo.DPOTrainConfig:
  return _pair_config(cfg, dpo.DPOTrainConfig, cfg.dpo)


@typed
def chat_sft_config(cfg) -> sft_chat.ChatSFTConfig:
  return pick(sft_chat.ChatSFTConfig, cfg.sft, cfg.chat_sft, chat_template=cfg.data.chat_template,
              microbatch_tokens=cfg.train.microbatch_tokens, seed=cfg.seed)


@typed
def run_sft(cfg, workdir: str, mesh=None):
  """`launch.sft`: SFT on the arithmetic task's solutions (data.task="arith") or on conversation files
  (data.task="file"), resuming from WORKDIR/sft. Returns (model_cfg, params, tokenizer)."""
  mesh = mesh if mesh is not None else sharding.make_mesh(cfg.mesh.to_dict())
  record.lock(workdir, jax.process_index())
  run_dir = os.path.join(workdir, "sft")
  record.save_pipeline_config(cfg, workdir, "sft")
  if cfg.data.task != "file":
    train, _ = datasets(cfg)
    tok = tokenizer(cfg, workdir, train)
    model_cfg = cfg.model.architecture(padded_vocab(tok), tok)
    params = sft_lib.run(sft_config(cfg), model_cfg, tok, train, mesh, run_dir, lora=cfg.model.lora_config())
    return model_cfg, params, tok
  train, held = conversation_data(cfg)
  tok = chat_tokenizer(cfg, workdir, train)
  if cfg.model.init == "hf":
    model_cfg, params = hf.load(cfg.model.hf_dir, **cfg.model.runtime_overrides())
  else:
    model_cfg = cfg.model.architecture(padded_vocab(tok), tok)
    params = model_lib.init_params(model_cfg, jax.random.key(cfg.seed))
  params, _ = sft_chat.train(chat_sft_config(cfg), model_cfg, params, tok, train, held, mesh, run_dir,
                             source=",".join(f for f in cfg.data.train_files if f), lora=cfg.model.lora_config())
  return model_cfg, params, tok


@typed
def dpo_evaluator(cfg, tok, model_cfg, mesh, held_pairs):
  """Rule-checked greedy accuracy on the held-out pairs' prompts that carry a `ground_truth`
  (`dpo.eval_greedy` of them; None when there are none)."""
  examples = [data_lib.Example(messages=p.prompt, ground_truth=p.ground_truth, index=p.index)
              for p in held_pairs if p.ground_truth is not None][: cfg.dpo.eval_greedy]
  if not examples:
    return None
  greedy = sampling.SamplerConfig(max_new_tokens=cfg.dpo.max_new_tokens, temperature=0.0,
                                  eos_ids=tokenizer_lib.stop_ids(tok, cfg.dpo.init_dir, cfg.rollout.stop),
                                  pad_id=tok.pad_token_id)
  rcfg = rollout_lib.RolloutConfig(max_prompt_len=cfg.dpo.prompt_len, chat_template=cfg.data.chat_template)
  rule = lambda responses, gts: [rewards_lib.math_dapo(r, g) for r, g in zip(responses, gts)]
  rollout = rollout_lib.Rollout(tok, model_cfg, mesh, rcfg, greedy, rule)
  return evaluate.Evaluator(rollout, examples, k=1, sampler_cfg=greedy, seed=cfg.seed, rows=len(examples))
