"""Score a checkpoint (or a Hugging Face model directory) on a held-out set: mean@k, best@k, maj@k.

  python -m launch.eval --workdir=runs/default                       # latest checkpoint, config's data
  python -m launch.eval --model_dir=/ckpt/model --config=configs/dapo_qwen2_5_32b.py \
      --config.data.eval_files=aime-2024.parquet --k=1                # the paper's AIME protocol

A run is read with the config it recorded (WORKDIR/config.json) unless `--config` is given.
`--dump=FILE.jsonl.gz` also writes every scored sample (prompt, response, score, acc, pred).
"""
import json

from absl import flags

from . import common

_CONFIG = common.define_config(reads_run_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory whose latest checkpoint is scored.")
_MODEL_DIR = flags.DEFINE_string("model_dir", None, "Score this HF model directory instead.")
_K = flags.DEFINE_integer("k", None, "Samples per prompt (default: config eval.k).")
_DUMP = flags.DEFINE_string("dump", None, "Also write every scored sample to this .jsonl.gz (dapo_jax.dumps rows).")


def main(argv):
  del argv
  common.init_distributed()
  from dapo_jax import builders, dumps, rewards, sharding
  from dapo_jax.data import tokenizer
  from dapo_jax.hf import convert as hf
  from dapo_jax.rollout import rollout
  workdir = None if _MODEL_DIR.value else _WORKDIR.value or common.default_workdir()
  cfg = common.run_config(_CONFIG, workdir)  # The run's recorded config unless --config is given.
  builders.validate(cfg)
  mesh = sharding.make_mesh(cfg.mesh)
  if _MODEL_DIR.value:
    model_cfg, params = hf.load(_MODEL_DIR.value, **builders.runtime_overrides(cfg))
    tok = tokenizer.load(cfg.tokenizer.path or _MODEL_DIR.value)
    step, source = 0, _MODEL_DIR.value
  else:
    model_cfg, params, tok, step = builders.restore_policy(cfg, workdir, mesh)
    source = builders.model_dir(cfg, workdir)
  _, examples = builders.datasets(cfg)
  if _K.value:
    with cfg.unlocked():
      cfg.eval.k = _K.value
  reward = rewards.RewardPool(cfg.reward.fn, cfg.reward.timeout_s, cfg.reward.workers)
  try:
    # With rollout.env every prompt is an episode, as in training's evaluation.
    r = rollout.Rollout(tok, model_cfg, mesh, builders.rollout_config(cfg),
                        builders.sampler_config(cfg, tok, source), reward, *builders.episodes(cfg, tok))
    recorder = dumps.RolloutRecorder("", r, filter_groups=False, enabled=bool(_DUMP.value))
    with recorder.recording("eval", step, step, file=_DUMP.value):
      result = builders.evaluator(cfg, r, examples, progress=True).run(params)
  finally:
    reward.close()
  print(json.dumps({"rollout_step": step, "num_prompts": len(examples), **result}))


if __name__ == "__main__":
  common.run(main)
