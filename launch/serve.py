"""Serve a policy with the OpenAI API: /v1/models, /v1/completions, /v1/chat/completions, /health.

  python -m launch.serve --workdir=runs/default                # the run's latest checkpoint
  python -m launch.serve --model_dir=HF_DIR [--adapter_dir=PEFT_DIR] --port=8000
  DAPO_SERVE_TOKEN=secret python -m launch.serve --model_dir=HF_DIR --host=0.0.0.0

A run is read with the config it recorded (WORKDIR/config.json) unless `--config` is given. Only 127.0.0.1 is served
without a token; requests then carry `Authorization: Bearer <token>` (the openai client's api_key).
The URL is printed as `serving MODEL on http://HOST:PORT`.
"""
import os

from absl import flags

from . import common

_CONFIG = common.define_config(reads_run_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory whose latest checkpoint is served.")
_MODEL_DIR = flags.DEFINE_string("model_dir", None, "Serve this HF model directory instead.")
_ADAPTER_DIR = flags.DEFINE_string("adapter_dir", None, "A PEFT LoRA adapter directory on --model_dir.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to bind; anything but localhost needs a token.")
_PORT = flags.DEFINE_integer("port", 8000, "Port (0: any free one).")
_TOKEN = flags.DEFINE_string("token", None, "Shared token (default: env DAPO_SERVE_TOKEN).")
_SLOTS = flags.DEFINE_integer("slots", 16, "Samples decoded together (across requests).")
_MAX_PROMPT_LEN = flags.DEFINE_integer("max_prompt_len", 512, "Longest prompt in tokens.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 256, "Longest answer in tokens (max_tokens' ceiling).")
_MAX_QUEUE = flags.DEFINE_integer("max_queue", 1024, "Samples in flight beyond which requests get 429.")
_ROUND_STEPS = flags.DEFINE_integer("round_steps", 4, "Tokens per decode round at most (new requests join "
                                    "and streams advance between rounds).")
_COMPACT = flags.DEFINE_bool("compact", False, "The pool's width follows the load (lower latency for few "
                              "clients; each width compiles when the load first meets it).")
_WRAP_PROMPTS = flags.DEFINE_bool("wrap_prompts", False, "With --workdir: a chat request that is one user message "
                                  "(no tools) is put as the run's training prompts were (the task's instruction "
                                  "and worked examples), as launch.sample puts --prompt. Off: every request is "
                                  "rendered exactly as sent, as vLLM and OpenAI do.")
_LOGPROBS_MODE = flags.DEFINE_string("logprobs_mode", "raw", "The sampled tokens' log-probs: the model's own (raw, "
                                     "temperature 1, vLLM's default) or the sampler's (processed: temperature-scaled; "
                                     "serve.server.LOGPROBS_MODES).")
_MODEL_NAME = flags.DEFINE_string("model_name", None, "The model id clients ask for (default: the directory's name).")
# What clients may hold of the server; unset, serve.http.Limits' defaults.
_MAX_CONNECTIONS = flags.DEFINE_integer("max_connections", None, "Connections open at once (http.Limits).")
_HEADER_TIMEOUT_S = flags.DEFINE_float("header_timeout_s", None, "Seconds to send a request's head (http.Limits).")
_BODY_TIMEOUT_S = flags.DEFINE_float("body_timeout_s", None, "Longest pause inside a request body (http.Limits).")
_MAX_PROMPT_CHARS = flags.DEFINE_integer("max_prompt_chars", None, "Characters of prompt text a request may have "
                                         "tokenised (http.Limits).")


def main(argv):
  del argv
  from dapo_jax import builders, sharding
  from dapo_jax.data import tokenizer
  from dapo_jax.serve import server as server_lib
  if _WORKDIR.value and _MODEL_DIR.value:
    raise ValueError("give one of --workdir or --model_dir")
  workdir = None if _MODEL_DIR.value else (_WORKDIR.value or common.default_workdir())
  # A run is served with its recorded config unless --config is given.
  cfg = common.run_config(_CONFIG, workdir) if workdir else _CONFIG.value
  builders.validate(cfg)
  server_lib.http.check_bind(_HOST.value, _TOKEN.value or os.environ.get(server_lib.TOKEN_ENV),
                             server_lib.TOKEN_ENV)  # Before the model loads.
  server_lib.http.check_port(_HOST.value, _PORT.value)
  mesh = sharding.make_mesh(cfg.mesh)
  model_cfg, params, tok, source, name = builders.served_policy(cfg, workdir, _MODEL_DIR.value,
                                                                _ADAPTER_DIR.value, mesh)
  eos = tokenizer.stop_ids(tok, source, cfg.rollout.stop)
  server = server_lib.PolicyServer(
      model_cfg, params, tok, eos_ids=eos, model_name=_MODEL_NAME.value or name, host=_HOST.value, port=_PORT.value,
      token=_TOKEN.value, slots=_SLOTS.value, max_prompt_len=_MAX_PROMPT_LEN.value,
      max_new_tokens=_MAX_NEW_TOKENS.value, round_steps=_ROUND_STEPS.value, max_queue=_MAX_QUEUE.value,
      compact=_COMPACT.value, mesh=mesh, logprobs_mode=_LOGPROBS_MODE.value,
      engine_options={k: getattr(builders.as_config(cfg).rollout, k) for k in server_lib.CACHE_SETTINGS},
      max_images=builders.as_config(cfg).data.max_images, pan_and_scan=builders.as_config(cfg).data.pan_and_scan,
      limits=server_lib.http.limits(max_connections=_MAX_CONNECTIONS.value, header_timeout_s=_HEADER_TIMEOUT_S.value,
                                    body_timeout_s=_BODY_TIMEOUT_S.value, max_prompt_chars=_MAX_PROMPT_CHARS.value),
      user_prompt=(lambda q: builders.user_prompt_messages(cfg, q)) if _WRAP_PROMPTS.value and workdir else None)
  print(f"serving {server.policy.model_name} on {server.url} (OpenAI API: /v1/chat/completions, "
        "/v1/completions, /v1/models)", flush=True)
  common.serve_until_interrupted(server)


if __name__ == "__main__":
  common.run(main)
