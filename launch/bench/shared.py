"""What the benchmarks share: the config and the workload's flags, the model they load, timing, the
FLOPs a step does and the matmul peak its MFU is measured against."""
import dataclasses
import statistics
import time

from absl import flags

from .. import common

CONFIG = common.define_config()
MODEL_DIR = flags.DEFINE_string("model_dir", None, "HF model directory (default: the config's model).")
BATCH = flags.DEFINE_integer("batch", 64, "Rows (sampler, train).")
PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32, "Prompt tokens (sampler).")
NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Generated tokens per row (sampler, e2e).")
SEQ_LEN = flags.DEFINE_integer("seq_len", 96, "Tokens per row (train).")
RUNS = flags.DEFINE_integer("runs", 5, "Timed runs after one warm-up.")
NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 8, "Prompts per step (e2e).")
GROUP = flags.DEFINE_integer("group", 8, "Samples per prompt (e2e).")
SLOTS = flags.DEFINE_integer("slots", None, "e2e: decode slots of the continuous engine (default: the config's).")
DTYPE = flags.DEFINE_string("dtype", "", "Compute dtype ('' = the config's model.dtype).")
MATMUL_DTYPE = flags.DEFINE_string("matmul_dtype", "", "Weight-matmul operand dtype ('' = the config's "
                                   "model.matmul_dtype, or else the compute dtype).")


def numerics(cfg) -> dict:
  """The model's dtype and matmul_dtype: the flags where given, else the config's."""
  return dict(dtype=DTYPE.value or cfg.model.dtype, matmul_dtype=MATMUL_DTYPE.value or cfg.model.matmul_dtype)


def timed(fn, runs):
  import jax
  jax.block_until_ready(fn())  # Warm-up (compiles).
  times = []
  for _ in range(runs):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times), times


def matmul_peak(dtype="float32", n=2048, runs=5) -> float:
  """FLOP/s of one large matmul with `dtype` operands and fp32 accumulation, as the model's weight
  matmuls run: the ceiling for this machine and XLA build."""
  import jax
  import jax.numpy as jnp
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
  f = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
  t, _ = timed(lambda: f(a), runs)
  return 2 * n ** 3 / t


def load_model(cfg):
  import jax

  from dapo_jax import builders
  from dapo_jax.hf import convert as hf
  from dapo_jax.model import transformer as model
  if MODEL_DIR.value:
    mc, params = hf.load(MODEL_DIR.value, **{**builders.runtime_overrides(cfg), **numerics(cfg)})
  else:
    mc = dataclasses.replace(builders.model_config(cfg, cfg.model.vocab_size or 1024), **numerics(cfg))
    params = model.init_params(mc, jax.random.key(0))
  return mc, params


def load_policy(cfg):
  """(model config, params, tokenizer) for a served model: `--model_dir`'s, or the config's model with
  random weights beside a tokenizer trained on the spot."""
  import tempfile

  import jax

  from dapo_jax import builders, testing
  from dapo_jax.data import tokenizer as tokenizer_lib
  from dapo_jax.model import transformer as model
  if MODEL_DIR.value:
    return (*load_model(cfg), tokenizer_lib.load(MODEL_DIR.value))
  tok = testing.build_tokenizer(tempfile.mkdtemp(prefix="dapo_bench_"))
  mc = dataclasses.replace(builders.model_config(cfg, len(tok)), **numerics(cfg))
  return mc, model.init_params(mc, jax.random.key(0)), tok


def adapted(cfg, mc, params):
  """`params` as a run with `model.lora` holds them: the (int8) base and fresh adapters."""
  import jax

  from dapo_jax import builders
  from dapo_jax.model import lora
  lcfg = builders.lora_config(cfg)
  return params if lcfg is None else lora.adapt(mc, lcfg, params, jax.random.key(1))


def matmul_params(mc) -> int:
  """`metrics.matmul_params`: the FLOPs the runs' own perf/mfu counts (MoE: the active experts)."""
  from dapo_jax import metrics
  return metrics.matmul_params(mc)


def attention_flops(mc, queries: int, keys: float) -> float:
  """QK^T and AV for `queries` query tokens against `keys` keys each, forward."""
  return 4 * mc.num_layers * queries * keys * mc.num_heads * mc.head_dim
