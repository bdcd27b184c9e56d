"""Supervised warm start: packed language modelling on reference solutions, through `fit.fit` (resumable)."""
from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from dapo_jax import objectives, optim, train_step
from dapo_jax.data import images as images_lib
from dapo_jax.data import prompts as data_lib
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.datatypes import LMBatch
from dapo_jax.errors import ConfigError
from dapo_jax.model import lora as lora_lib
from dapo_jax.model import transformer as model_lib
from dapo_jax.model import vision as vision_lib
from dapo_jax.pipelines import fit


def pack(token_lists, seq_len: int, eos_id: int) -> np.ndarray:
  """Joins texts with EOS and cuts the stream into [N, seq_len] chunks (no padding; the tail is dropped)."""
  stream = np.concatenate([np.append(np.asarray(t, np.int32), eos_id) for t in token_lists])
  n = len(stream) // seq_len
  return stream[: n * seq_len].reshape(n, seq_len)


def pack_masked(rows, seq_len: int, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
  """`pack` for (tokens, loss mask) rows: the EOS that joins two rows is a target (it ends the turn)."""
  tokens = pack([t for t, _ in rows], seq_len, eos_id)
  masks = np.concatenate([np.append(np.asarray(m, bool), True) for _, m in rows])
  return tokens, masks[: tokens.size].reshape(tokens.shape)


def sft_texts(tok, examples, chat_template: bool, style: str = "steps") -> list[str]:
  """Prompt + reference solution. "tool": the whole calculator episode (`envs.tasks`): the call,
  the calculator's result in the template's tool role, the answer."""
  if style == "tool":
    from dapo_jax.envs import tasks  # noqa: PLC0415
    return [tasks.calculator_episode_text(tok, ex) for ex in examples]
  return [tokenizer_lib.render(tok, ex.messages, chat_template) + data_lib.arith_solution(ex, style)
          for ex in examples]


def sft_rows(tok, examples, chat_template: bool, style: str = "steps") -> list[tuple[list[int], list[bool]]]:
  """(tokens, loss mask) per example, the mask True on the policy's tokens only. Each piece is
  tokenized on its own, as an episode sees it: the prompt, the solution (for "tool": the call, its
  end-of-turn, the calculator's result in the tool role, unmasked, then the answer)."""
  def ids(text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]

  rows = []
  for ex in examples:
    prompt = tokenizer_lib.encode_prompts(tok, [_prompt_text(tok, ex, chat_template, style)])[0]
    if style == "tool":
      from dapo_jax.envs import render, tasks  # noqa: PLC0415
      call = ids(data_lib.arith_solution(ex, "tool")) + [tok.eos_token_id]
      result = ids(render.observation_text(tok, [{"role": "tool", "name": "calculator", "content": ex.ground_truth}],
                                           ended_with=tok.eos_token, tools=tasks.calculator_schemas()))
      answer = ids(data_lib.arith_solution(ex, "direct"))
      pieces = [(prompt, False), (call, True), (result, False), (answer, True)]
    else:
      pieces = [(prompt, False), (ids(data_lib.arith_solution(ex, style)), True)]
    rows.append(([t for p, _ in pieces for t in p], [m for p, m in pieces for _ in p]))
  return rows


def _prompt_text(tok, ex, chat_template: bool, style: str, vision=None) -> str:
  if style == "tool":
    from dapo_jax.envs import tasks  # noqa: PLC0415
    return tokenizer_lib.render(tok, ex.messages, chat_template, tools=tasks.calculator_schemas())
  text = tokenizer_lib.render(tok, ex.messages, chat_template)
  return text if vision is None else images_lib.expand_marks(text, tok, vision, ex.images)


def probe_batch(tok, examples, chat_template: bool, style: str = "steps", vision=None) -> tuple[np.ndarray, ...]:
  """Rows of prompt + reference solution + EOS, tokenized as generation sees them (prompt and
  completion apart), left-padded: (tokens [B, T], mask [B, T], completion mask [B, T]). For a
  calculator episode ("tool"), the solution is its first turn: the call. `vision`: a vision-language
  model's tower (`model.vision`), whose image marks the prompts hold expanded."""
  prompts = tokenizer_lib.encode_prompts(tok, [_prompt_text(tok, ex, chat_template, style, vision)
                                               for ex in examples])
  completions = tok([data_lib.arith_solution(ex, style) for ex in examples], add_special_tokens=False)["input_ids"]
  rows = [(p, c + [tok.eos_token_id]) for p, c in zip(prompts, completions)]
  T = max(len(p) + len(c) for p, c in rows)
  tokens = np.full((len(rows), T), tok.pad_token_id, np.int32)
  mask, completion = np.zeros((len(rows), T), bool), np.zeros((len(rows), T), bool)
  for b, (p, c) in enumerate(rows):
    tokens[b, T - len(p) - len(c):] = p + c
    mask[b, T - len(p) - len(c):] = True
    completion[b, T - len(c):] = True
  return tokens, mask, completion


def exact_match(model_cfg: model_lib.ModelConfig, params, tokens_BT, mask_BT, completion_BT,
                pixels_BICSS=None, grids_BI2=None) -> jax.Array:
  """Fraction of rows whose every completion token is the argmax given the tokens before it:
  exactly the rows that greedy decoding from the prompt would reproduce (`pixels_BICSS`: their images,
  `grids_BI2` their grids, `vision.image_features`)."""
  images_BMD = None
  if pixels_BICSS is not None:
    images_BMD = vision_lib.image_features(model_cfg.vision, vision_lib.tower_params(params), pixels_BICSS,
                                           grids_BI2)
  logits_BTV = model_lib.logits(model_cfg, params, tokens_BT[:, :-1], mask_BT[:, :-1], images_BMD=images_BMD)
  hit_BT = (jnp.argmax(logits_BTV, -1) == tokens_BT[:, 1:]) | ~completion_BT[:, 1:]
  return jnp.mean(jnp.all(hit_BT, axis=1))


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """The supervised warm start on the arithmetic task's reference solutions."""
  steps: int
  batch_size: int = 32
  seq_len: int = 128               # tokens per packed row
  lr: float = 1e-3
  warmup_steps: int = 20
  num_examples: int = 20_000
  target_acc: float = 0.0          # >0: stop once greedy decoding solves this fraction of a probe
  probe_size: int = 256            # training problems in that probe
  probe_every: int = 25            # steps between probes
  seed: int = 0
  chat_template: bool = True
  solution_style: str = "steps"    # data.arith_solution's style
  completion_only: bool = False    # loss on the solution's tokens only (the prompt and a tool's result masked)
  train_vision: bool = False       # a vision-language model: train the tower and projector too (through the
                                   # pixels of each batch; RL then keeps them as the warm start left them)
  microbatch_tokens: int = train_step.MICROBATCH_TOKENS  # automatic micro-batches of at most this many tokens
  ckpt_every: int = 100            # updates between checkpoints (0 = at the end only)
  keep_ckpts: int = 2


def run(s: SFTConfig, model_cfg: model_lib.ModelConfig, tok, examples, mesh, workdir: str, params=None,
        lora: lora_lib.LoraConfig | None = None):
  """Returns SFT-trained params (random init unless `params` is given), resuming from
  WORKDIR/checkpoints; with `lora`, adapters trained on the frozen params (an adapted tree, see `lora`)."""
  # Each example ends with the chat's end-of-turn token, which is what stops generation.
  vision, mask_rows, images = model_cfg.vision, None, None
  if vision is not None:  # One example a row (its images' vectors go with it), not packed.
    chunks, mask_rows, loss_masks = image_rows(tok, examples[: s.num_examples], s, vision)
  elif s.completion_only:
    chunks, loss_masks = pack_masked(sft_rows(tok, examples[: s.num_examples], s.chat_template, s.solution_style),
                                     s.seq_len, tok.eos_token_id)
  else:
    texts = sft_texts(tok, examples[: s.num_examples], s.chat_template, s.solution_style)
    chunks = pack(tokenizer_lib.encode_prompts(tok, texts), s.seq_len, tok.eos_token_id)
    loss_masks = np.ones_like(chunks, bool)
  opt = optim.OptimConfig(lr=s.lr, warmup_steps=s.warmup_steps, weight_decay=0.0, grad_clip=1.0)
  trainer = train_step.Trainer(model_cfg, opt, mesh, objectives.language_model(model_cfg), num_microbatches=0,
                               microbatch_tokens=s.microbatch_tokens, lora=lora, seed=s.seed,
                               train_vision=s.train_vision)
  state = trainer.init(jax.random.key(s.seed), params=params)
  pixels = grids = None
  if vision is not None and s.train_vision:  # The tower trains: it runs on each batch's pixels, in the loss.
    shown = [ex.images for ex in examples[: s.num_examples]]
    pixels = images_lib.batch_pixels(vision, shown)
    grids = images_lib.batch_grids(vision, shown) if vision.native_resolution else None
  elif vision is not None:  # The tower is frozen: each example's image vectors, computed once.
    images = image_vectors(model_cfg, state.params, examples[: s.num_examples])
  rows = sequential_draws(s.seed, len(chunks), s.batch_size)
  ones = np.ones((s.batch_size, s.seq_len), bool)

  def batch_at(step: int) -> LMBatch:
    r = rows(step)
    return LMBatch(tokens_BT=chunks[r], mask_BT=ones if mask_rows is None else mask_rows[r],
                   loss_mask_BT=loss_masks[r], images_BMD=None if images is None else images[r],
                   pixels_BICSS=None if pixels is None else pixels[r], grids_BI2=None if grids is None else grids[r])

  done = None
  if s.target_acc:
    # Stop once greedy decoding reproduces target_acc of a probe of training problems: a warm start
    # that leaves RL room to show learning, however fast the SFT happens to be on this machine.
    probe = probe_batch(tok, examples[-s.probe_size:], s.chat_template, s.solution_style, vision)
    if vision is not None:  # The tower of each probe's params.
      shown = [ex.images for ex in examples[-s.probe_size:]]
      probe += (images_lib.batch_pixels(vision, shown),)
      probe += (images_lib.batch_grids(vision, shown),) if vision.native_resolution else ()
    probe_acc = jax.jit(functools.partial(exact_match, model_cfg))

    def done(n: int, params) -> str | None:
      if n % s.probe_every:
        return None
      acc = float(probe_acc(params, *probe))
      if acc < s.target_acc:
        return None
      return (f"greedy reproduces {acc:.1%} of {len(probe[0])} training problems "
              f"(sft.target_acc={s.target_acc}); warm start done")

  logging.info("SFT: %d steps of %d x %d tokens from %d chunks", s.steps, s.batch_size, s.seq_len, len(chunks))
  fit_cfg = fit.FitConfig(steps=s.steps, ckpt_every=s.ckpt_every, keep_ckpts=s.keep_ckpts, seed=s.seed)
  params, _ = fit.fit(fit_cfg, trainer, state, batch_at, workdir, label="SFT", prefix="sft",
                      console_keys={"lm_loss": "loss", "token_acc": "token acc"}, done=done)
  return params


def image_rows(tok, examples, s: SFTConfig, vision) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(tokens, mask, loss mask) [N, seq_len] of a vision-language model's SFT: one example a row, left-padded
  (prompt with its image marks expanded, solution, EOS). An image placeholder is never a target."""
  prompts = tokenizer_lib.encode_prompts(tok, [_prompt_text(tok, ex, s.chat_template, s.solution_style, vision)
                                               for ex in examples])
  solutions = tok([data_lib.arith_solution(ex, s.solution_style) for ex in examples], add_special_tokens=False)
  T = s.seq_len
  tokens = np.full((len(examples), T), tok.pad_token_id, np.int32)
  mask, loss_mask = np.zeros((2, len(examples), T), bool)
  for b, (ex, p, c) in enumerate(zip(examples, prompts, solutions["input_ids"])):
    row = p + c + [tok.eos_token_id]
    if len(row) > T:
      raise ConfigError(f"sft.seq_len={T}: example {ex.index}'s prompt, images and solution take {len(row)} tokens")
    tokens[b, T - len(row):] = row
    mask[b, T - len(row):] = True
    loss_mask[b, T - (len(c) + 1 if s.completion_only else len(row)):] = True
  return tokens, mask, loss_mask & (tokens != vision.image_token_id)


def image_vectors(model_cfg: model_lib.ModelConfig, params, examples, chunk: int = 256) -> np.ndarray:
  """[N, I*M, D] each example's image vectors (I: the most images an example has), `chunk` examples a pass."""
  v = model_cfg.vision
  I = max(1, max(len(ex.images) for ex in examples))
  tower = vision_lib.tower_params(params)
  out = []
  for i in range(0, len(examples), chunk):
    shown = [ex.images for ex in examples[i:i + chunk]]
    grids = (images_lib.batch_grids(v, shown, I),) if v.native_resolution else ()
    out.append(np.asarray(vision_lib.encode_images(v, tower, images_lib.batch_pixels(v, shown, I), *grids)))
  return np.concatenate(out)


def sequential_draws(seed: int, n: int, k: int):
  """step -> the step-th of consecutive draws of `k` indices of `n` from one generator seeded by
  `seed` (with replacement): the same rows at a step whether or not the run resumed before it."""
  rng, drawn = np.random.default_rng(seed), []

  def at(step: int) -> np.ndarray:
    while len(drawn) <= step:
      drawn.append(rng.integers(0, n, size=k))
    return drawn[step]
  return at
