"""Small models, tokenizers and rewards for tests and notebooks (everything built offline)."""
from __future__ import annotations

import threading

import numpy as np

# Model code is imported inside the functions that need it: reward-pool workers import this
# module for the toy rewards and should not pay for jax.

# XLA flags of test processes on CPU: tests compile many tiny programs and run each a few times, so
# compile time dominates. Without LLVM's optimisation passes and with the classic fusion code
# generator rather than the MLIR fusion emitters, the suite runs in about half the time (docs/testing.md).
FAST_COMPILE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def tiny_model_config(vocab_size: int = 128, **kw):
  from dapo_jax.model import transformer as model_lib
  defaults = dict(vocab_size=vocab_size, embed_dim=32, mlp_dim=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, qkv_bias=True, tie_embeddings=True)
  return model_lib.ModelConfig(**{**defaults, **kw})


def corpus(n: int = 2000, seed: int = 0) -> list[str]:
  """Arithmetic-flavoured text for training a test tokenizer."""
  rng = np.random.default_rng(seed)
  lines = []
  for _ in range(n):
    a, b = rng.integers(0, 1000, size=2)
    lines.append(f"What is {a} + {b}? Think, then answer.\n{a} + {b} = {a + b}\nAnswer: {a + b}")
  return lines


def build_tokenizer(path: str, vocab_size: int = 300, chat_template: bool = True):
  from dapo_jax.data import tokenizer as tokenizer_lib
  return tokenizer_lib.train_bpe(path, corpus(), vocab_size=vocab_size, chat_template=chat_template)


def length_reward(response: str, ground_truth: str) -> dict:
  """A deterministic toy reward: correct when the response has an even number of characters."""
  ok = len(response) % 2 == 0
  return {"score": 1.0 if ok else -1.0, "acc": ok, "pred": str(len(response))}


def parts_reward(response: str, ground_truth: str) -> dict:
  """`length_reward` with two components beside its score: "even" (its check, 0/1) and "short" (1 for
  at most 8 characters, else 0), for GDPO (`dapo.gdpo_reward_keys`)."""
  out = length_reward(response, ground_truth)
  return {**out, "even": float(out["acc"]), "short": float(len(response) <= 8), "note": "not a number"}


def slow_length_reward(response: str, ground_truth: str) -> dict:
  """`length_reward`, answered after 0-40 ms (by the response's length): a scorer whose latency varies."""
  import time  # noqa: PLC0415
  time.sleep(0.01 * (len(response) % 5))
  return length_reward(response, ground_truth)


def has_seven(response: str, ground_truth: str) -> dict:
  """The peer benchmarks' reward: +1 if the completion contains the digit 7."""
  ok = "7" in response
  return {"score": 1.0 if ok else -1.0, "acc": ok, "pred": ""}


def raising_reward(response: str, ground_truth: str) -> dict:
  raise RuntimeError("reward function failed on purpose")


def hanging_reward(response: str, ground_truth: str) -> dict:
  import time
  time.sleep(3600)
  return {"score": 1.0, "acc": True, "pred": ""}


def hang_on_request(response: str, ground_truth: str) -> dict:
  """Hangs when the response is "hang", else scores +1: some calls of a batch stall, others don't."""
  if response == "hang":
    import time
    time.sleep(3600)
  return {"score": 1.0, "acc": True, "pred": response}


def exit_on_request(response: str, ground_truth: str) -> dict:
  """Kills its worker process when the response is "exit", else scores +1."""
  if response == "exit":
    import os
    os._exit(1)
  return {"score": 1.0, "acc": True, "pred": response}


def sharp_params(cfg, seed: int = 0, scale: float = 8.0):
  """Random params with peaked next-token distributions, so greedy choices have clear margins."""
  import jax

  from dapo_jax.model import transformer as model_lib
  params = model_lib.init_params(cfg, jax.random.key(seed))
  params["embed_VD"] = params["embed_VD"] * scale
  return params


def nan_reward(response: str, ground_truth: str) -> dict:
  """Mixed correctness but a NaN score: every update it feeds is non-finite."""
  ok = len(response) % 2 == 0
  return {"score": float("nan"), "acc": ok, "pred": ""}


def arith_rm(model_dir=None):
  """A stand-in reward model for server tests: +1 when the response's answer is the sum in the prompt."""
  import re

  from dapo_jax import rewards

  def score_fn(prompts, responses):
    out = []
    for p, r in zip(prompts, responses):
      m = re.search(r"What is (\d+)\+(\d+)\?", p)
      out.append(rewards.math_dapo(r, str(int(m[1]) + int(m[2])))["score"] if m else 0.0)
    return out
  return score_fn


def memorized_model(cfg, token_rows, steps: int = 300, lr: float = 3e-3, seed: int = 0):
  """Params of `cfg` trained (Adam, full batch) to continue each (prompt ids, answer ids) row with
  its answer: a tiny policy whose right answers are known, for server and harness tests."""
  import jax
  import jax.numpy as jnp
  import optax

  from dapo_jax.model import transformer as model_lib
  T = max(len(p) + len(a) for p, a in token_rows)
  tokens, mask, target = (np.zeros((len(token_rows), T), dt) for dt in (np.int32, bool, bool))
  for b, (p, a) in enumerate(token_rows):  # Left-padded, as the model reads prompts.
    row = list(p) + list(a)
    tokens[b, T - len(row):], mask[b, T - len(row):] = row, True
    target[b, T - len(a):] = True
  opt = optax.adam(lr)

  def loss_fn(params):
    logp = jax.nn.log_softmax(model_lib.logits(cfg, params, tokens[:, :-1], mask[:, :-1]))
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.sum(nll * target[:, 1:]) / target[:, 1:].sum()

  @jax.jit
  def step(params, state):
    loss, g = jax.value_and_grad(loss_fn)(params)
    updates, state = opt.update(g, state, params)
    return optax.apply_updates(params, updates), state, loss

  params = model_lib.init_params(cfg, jax.random.key(seed))
  state = opt.init(params)
  for _ in range(steps):
    params, state, loss = step(params, state)
  return params, float(loss)


class SlowResetEnv:
  """An episode of `turns` turns whose reward's `pred` is the prompt it was reset with (its example's
  last message), so a row scored against another example shows it. Every `slow_every`-th reset run by an
  episode worker (not a group prompt's) sleeps `slow_s`, past a shorter `rollout.env_timeout_s`.
  Each instance counts its resets, steps and closes (`made`: every instance of this process), and a
  step after its close raises."""
  tools = None
  made: list = []
  resets = 0                 # worker resets so far (this process)
  running = 0                # resets in progress
  _lock = threading.Lock()

  def __init__(self, slow_s: float = 1.0, slow_every: int = 4, turns: int = 2):
    cls = SlowResetEnv
    self.slow_s, self.slow_every, self.turns = slow_s, slow_every, turns
    self.n_resets, self.n_steps, self.n_closes = 0, 0, 0
    self.in_worker, self.slow = False, False
    with cls._lock:
      cls.made.append(self)

  def reset(self, example):
    import time  # noqa: PLC0415
    cls = SlowResetEnv
    self.example, self.n_resets = example, self.n_resets + 1
    with cls._lock:
      worker = threading.current_thread().name.startswith("env")
      slow = worker and cls.resets % self.slow_every == 0
      cls.resets += worker
      cls.running += 1
    self.in_worker, self.slow = worker, slow
    try:
      if slow:
        time.sleep(self.slow_s)
    finally:
      with cls._lock:
        cls.running -= 1
    return list(example.messages)

  def step(self, text: str):
    if self.n_closes:
      raise RuntimeError("step after close")
    self.n_steps += 1
    if self.n_steps < self.turns:
      return [{"role": "user", "content": "again"}], None, {"steps": 1}
    ok = len(text) % 2 == 0
    return None, {"score": 1.0 if ok else -1.0, "acc": ok, "pred": self.example.messages[-1]["content"]}, {"steps": 1}

  def close(self) -> None:
    self.n_closes += 1

  @classmethod
  def settle(cls, timeout_s: float = 30.0) -> None:
    """Waits until no reset is in progress (a slow one outlives its episode)."""
    import time  # noqa: PLC0415
    end = time.monotonic() + timeout_s
    while cls.running and time.monotonic() < end:
      time.sleep(0.01)
