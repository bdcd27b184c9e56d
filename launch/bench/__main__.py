"""Benchmarks: sampler throughput, train-step throughput, and one whole DAPO step, each with
model-FLOPs utilisation against a matmul peak measured in the same run. Prints one JSON line.

  python -m launch.bench sampler --model_dir=DIR --batch=64 --prompt_len=32 --new_tokens=64
  python -m launch.bench train   --model_dir=DIR --batch=64 --seq_len=96
  python -m launch.bench e2e     --model_dir=DIR --prompts=prompts_32tok.jsonl   # 8 prompts x 8 samples
  python -m launch.bench update --num_prompts=8 --group=8 --new_tokens=512   # padded vs packed update, long tail
  python -m launch.bench engine --slots=16 --mean_length=32   # dense vs paged KV cache at one byte budget
  python -m launch.bench episodes --tool_ms=50    # 3-turn episodes, environment latency vs a turn-synchronous loop
  python -m launch.bench serve --batch=64 --new_tokens=64   # the OpenAI server at 1/8/32 clients vs offline
  python -m launch.bench prefix --system_len=512 --clients=32   # the server's prefix cache: time to first token
  python -m launch.bench device   # what a GPU/TPU run reports: decode roofline, bf16 MFU, DAPO steps
  python -m launch.bench async --rollout_devices=4   # a split mesh's phases and the async step they predict
                                  # (on a CPU host, 8 forced host devices unless XLA_FLAGS sets a count)

DIR is any local HF Qwen2/Llama directory, so other tools can time the very same model.
Without --model_dir the config's model is built with random weights.
"""
import json
import os
import sys

from absl import flags

from .. import common

# A split mesh needs several devices: on a CPU host, 8 forced host devices (the flag is read by the CPU
# backend alone, so a GPU or TPU run is unaffected) unless the user's XLA_FLAGS sets a count.
if "async" in sys.argv[1:] and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()

from . import device, e2e, engine, episodes, prefix, sampler, serve, shared, split_mesh, train, update  # noqa: E402

BENCHES = {"sampler": sampler.bench, "train": train.bench, "update": update.bench, "e2e": e2e.bench,
           "engine": engine.bench,
           "episodes": episodes.bench, "serve": serve.bench, "prefix": prefix.bench, "device": device.bench,
           "async": split_mesh.bench}

# --help lists every benchmark's flags, as this command's own.
for module in (shared, e2e, engine, episodes, serve, prefix, device, split_mesh):
  flags.adopt_module_key_flags(module)


def main(argv):
  if len(argv) != 2 or argv[1] not in BENCHES:
    raise SystemExit(f"usage: python -m launch.bench {'|'.join(BENCHES)} [flags]")
  import jax
  cfg = shared.CONFIG.value
  dtypes = shared.numerics(cfg)
  operand_dtype = dtypes["matmul_dtype"] or dtypes["dtype"]
  peak = shared.matmul_peak(operand_dtype)
  result = BENCHES[argv[1]](cfg, peak)
  result.update(matmul_peak_flops_per_s=peak, matmul_dtype=operand_dtype, backend=jax.default_backend(),
                devices=jax.device_count(), model_dir=shared.MODEL_DIR.value)
  print(json.dumps(result))


if __name__ == "__main__":
  common.run(main)
