"""Sample completions from a checkpoint (or a Hugging Face model directory) and score them.

  python -m launch.sample --workdir=runs/default --prompt="What is 38+46?" --temperature=0
  python -m launch.sample --workdir=runs/default --prompt="What is 38+46?" --ground_truth=84 --k=4
  python -m launch.sample --model_dir=/ckpt/model --prompts=aime-2024.parquet --k=4 --temperature=0.7
  python -m launch.sample --workdir=runs/vlm --prompt="How many red shapes are in the image?" --image=pic.png

A run is read with the config it recorded (WORKDIR/config.json) unless `--config` is given;
`--config.x=y` overrides apply on top. A `--prompts` file is a .jsonl or .parquet dataset in the
DAPO-Math row schema, or rows with a "prompt" string; rows with a ground truth
(`reward_model.ground_truth` or `ground_truth`) get scored by the config's reward (`reward.fn`).
With `rollout.env` (a run trained on episodes, or `--config.rollout.env=...`) each completion is an
episode: the environment sets the scene, answers between the policy's turns and scores it (the
printed text is the whole episode after the prompt: the policy's turns and the observations).
`--json` prints one JSON object per completion. A vision-language model reads `--image` files with
`--prompt` (one per `<image>` mark in it; without marks they go before the text), or a file's
`images` column (docs/models.md).
"""
import dataclasses
import json
import os

from absl import flags

from . import common

_CONFIG = common.define_config(reads_run_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory whose latest checkpoint is sampled.")
_MODEL_DIR = flags.DEFINE_string("model_dir", None, "Sample this HF model directory instead.")
_PROMPT = flags.DEFINE_string("prompt", None, "One question, put as the run's training prompts were (the task's "
                              "instruction and worked examples; --raw: as typed).")
_RAW = flags.DEFINE_bool("raw", False, "Send --prompt as typed: one user turn, no task instruction (always so "
                        "with --model_dir, whose task is not known).")
_GROUND_TRUTH = flags.DEFINE_string("ground_truth", None, "The answer to --prompt, to score the completions.")
_PROMPTS = flags.DEFINE_string("prompts", None, "A .jsonl/.parquet file of prompts (a batch).")
_IMAGES = flags.DEFINE_multi_string("image", [], "An image file for --prompt (a vision-language model); repeat it "
                                    "for several, one per <image> mark of --prompt.")
_K = flags.DEFINE_integer("k", 1, "Completions per prompt.")
_TEMPERATURE = flags.DEFINE_float("temperature", None, "Sampling temperature; 0 = greedy (default: config).")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", None, "Completion tokens at most (default: config).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_JSON = flags.DEFINE_bool("json", False, "One JSON object per completion instead of text.")


def read_prompts(path: str, prompt_template: str, pan_and_scan: bool = False):
  """(prompts, ground truths) of a file: examples with their answer, or plain prompts with None."""
  from dapo_jax.data import prompts as data
  rows = data.read_rows(path)
  truth = lambda row: (row["reward_model"] if isinstance(row.get("reward_model"), dict) else row).get("ground_truth")
  has_truth = [isinstance(row, dict) and str(truth(row) or "").strip() != "" for row in rows]
  examples = ({ex.index: ex for ex in data.load_file(path, "skip", prompt_template, pan_and_scan=pan_and_scan)}
              if any(has_truth) else {})
  prompts, truths = [], []
  for i, row in enumerate(rows):
    if has_truth[i]:
      prompts.append(examples[i])
      truths.append(examples[i].ground_truth)
    elif isinstance(row, dict) and isinstance(row.get("prompt"), str) and row["prompt"].strip():
      prompts.append(prompt_template.format(problem=row["prompt"]) if prompt_template else row["prompt"])
      truths.append(None)
    else:
      raise data.DataError(f"{path}: row {i}: field 'prompt' must be a non-empty string, or a list of "
                           "messages with a ground truth")
  if not prompts:
    raise data.DataError(f"dataset file {path!r} has no rows")
  return prompts, truths


def as_example(prompt, ground_truth):
  """An episode's example: a prompt string as one user turn; `ground_truth` (if any) as its answer."""
  from dapo_jax.data import prompts as data
  if isinstance(prompt, str):
    return data.Example(messages=({"role": "user", "content": prompt},), ground_truth=ground_truth or "")
  return prompt if ground_truth is None else dataclasses.replace(prompt, ground_truth=ground_truth)


def with_images(prompt, paths, pan_and_scan: bool = False):
  """`prompt` (a string or an example) as an example holding the image files `paths`: its last turn gets
  one `<image>` mark per image before its text, unless it has the marks already (`pan_and_scan`: and
  Gemma 3's crops, `images.pan_and_scan`)."""
  from dapo_jax.data import images
  from dapo_jax.data import prompts as data
  imgs = tuple(images.read_entry(p, os.getcwd(), f"--image={p}") for p in paths)
  ex = as_example(prompt, None)
  last = dict(ex.messages[-1])
  if images.IMAGE_MARK not in last["content"]:
    last["content"] = images.IMAGE_MARK * len(imgs) + "\n" + last["content"]
  messages = ex.messages[:-1] + (last,)
  images.check_marks(messages, len(imgs), "--prompt")
  if pan_and_scan:
    messages, imgs = images.pan_and_scan(messages, imgs, "--image")
  return data.Example(messages=messages, ground_truth=ex.ground_truth, data_source=ex.data_source, images=imgs)


def main(argv):
  del argv
  common.init_distributed()
  import jax

  from dapo_jax import builders, console, rewards, sharding
  from dapo_jax.data import prompts as data
  from dapo_jax.data import tokenizer
  from dapo_jax.hf import convert as hf
  from dapo_jax.rollout import rollout
  workdir = None if _MODEL_DIR.value else _WORKDIR.value or common.default_workdir()
  cfg = common.run_config(_CONFIG, workdir)  # The run's recorded config unless --config is given.
  builders.validate(cfg)
  pan_and_scan = builders.as_config(cfg).data.pan_and_scan  # Typed: a run recorded before the field has its default.
  if bool(_PROMPT.value) == bool(_PROMPTS.value):
    raise data.DataError("give one of --prompt=TEXT or --prompts=FILE")
  if _PROMPTS.value:  # Before the model loads: a bad file fails at once.
    prompts, truths = read_prompts(_PROMPTS.value, cfg.data.prompt_template, pan_and_scan)
  else:
    wrap = not (_RAW.value or _MODEL_DIR.value)  # Only a run's own task is known.
    prompts = [builders.user_prompt(cfg, _PROMPT.value) if wrap else _PROMPT.value]
    truths = [_GROUND_TRUTH.value]
    if _IMAGES.value:
      prompts = [with_images(prompts[0], _IMAGES.value, pan_and_scan)]
  mesh = sharding.make_mesh(cfg.mesh)
  if _MODEL_DIR.value:
    model_cfg, params = hf.load(_MODEL_DIR.value, **builders.runtime_overrides(cfg))
    tok = tokenizer.load(cfg.tokenizer.path or _MODEL_DIR.value)
    source = _MODEL_DIR.value
  else:
    model_cfg, params, tok, _ = builders.restore_policy(cfg, workdir, mesh)
    source = builders.model_dir(cfg, workdir)
  sampler_cfg = builders.sampler_config(cfg, tok, source)
  sampler_cfg = dataclasses.replace(
      sampler_cfg, temperature=sampler_cfg.temperature if _TEMPERATURE.value is None else _TEMPERATURE.value,
      max_new_tokens=_MAX_NEW_TOKENS.value or sampler_cfg.max_new_tokens)
  k = _K.value
  make_env, episode_cfg = builders.episodes(cfg, tok)
  if make_env is not None:  # Episodes start from examples; a typed question's answer is its ground truth.
    prompts = [as_example(p, gt) for p, gt in zip(prompts, truths)]
  r = rollout.Rollout(tok, model_cfg, mesh, dataclasses.replace(builders.rollout_config(cfg), rows_per_call=0),
                      sampler_cfg, None, make_env, episode_cfg)
  try:
    texts = r.decode(r.generate(r.sampling_params(params), prompts, k, jax.random.key(_SEED.value)))
  finally:
    if r.episodes is not None:
      r.episodes.close()
  scored = [i for i, gt in enumerate(truths) for _ in range(k) if gt is not None]
  results = {}
  if make_env is not None:  # The environments' own rewards, in row order.
    results = {b: res for b, res in enumerate(r.last_stats["episode_rewards"]) if truths[b // k] is not None}
  elif scored:
    reward = rewards.RewardPool(cfg.reward.fn, cfg.reward.timeout_s, cfg.reward.workers)
    try:
      rows = [q * k + j for q in sorted(set(scored)) for j in range(k)]
      results = dict(zip(rows, reward([texts[b] for b in rows], [truths[b // k] for b in rows])))
    finally:
      reward.close()
  for q, prompt in enumerate(prompts):
    shown = prompt if isinstance(prompt, str) else prompt.messages[-1]["content"]
    if not _JSON.value:
      console.say(f"prompt {q + 1}/{len(prompts)}: {shown!r}"
                  + (f"  (ground truth {truths[q]!r})" if truths[q] is not None else ""))
    for j in range(k):
      b = q * k + j
      res = results.get(b)
      if _JSON.value:
        out = {"prompt": shown, "sample": j, "completion": texts[b]}
        if make_env is not None:
          out["turns"] = int(r.last_stats["turns"][b])
        if res is not None:
          out.update(ground_truth=truths[q], score=res["score"], acc=bool(res["acc"]), pred=res["pred"])
        console.say(json.dumps(out))
        continue
      score = f"  [score {res['score']:+.2f}, acc {int(bool(res['acc']))}, pred {res['pred']!r}]" if res else ""
      console.say(f"  {j + 1}: {texts[b]!r}{score}")
  if results:
    acc = sum(bool(r_["acc"]) for r_ in results.values()) / len(results)
    if not _JSON.value:
      console.say(f"accuracy {acc:.3f} over {len(results)} scored completions")


if __name__ == "__main__":
  common.run(main)
