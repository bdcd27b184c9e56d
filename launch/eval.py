"""Score a checkpoint (or a Hugging Face model directory) on a held-out set: mean@k, best@k, maj@k.

  python -m launch.eval --workdir=runs/default                       # latest checkpoint, config's data
  python -m launch.eval --model_dir=/ckpt/model --config=configs/dapo_qwen2_5_32b.py \
      --config.data.eval_files=aime-2024.parquet --k=1                # the paper's AIME protocol
"""
import json

from absl import flags

from launch import common

_CONFIG = common.define_config()
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory whose latest checkpoint is scored.")
_MODEL_DIR = flags.DEFINE_string("model_dir", None, "Score this HF model directory instead.")
_K = flags.DEFINE_integer("k", None, "Samples per prompt (default: config eval.k).")


def main(argv):
  del argv
  common.init_distributed()
  import tempfile

  from dapo_jax import loop, sharding
  cfg = _CONFIG.value
  if _MODEL_DIR.value:
    with cfg.unlocked():
      cfg.model.init, cfg.model.hf_dir = "hf", _MODEL_DIR.value
  workdir = _WORKDIR.value or common.default_workdir()
  if _MODEL_DIR.value and not _WORKDIR.value:
    workdir = tempfile.mkdtemp(prefix="dapo_eval_")
  dapo = loop.DAPO(cfg, workdir, sharding.make_mesh(cfg.mesh))
  step = dapo.restore() if not _MODEL_DIR.value else 0
  result = dapo.evaluate(k=_K.value)
  dapo.reward_pool.close()
  print(json.dumps({"rollout_step": step, "num_prompts": len(dapo.eval_examples), **result}))


if __name__ == "__main__":
  common.run(main)
