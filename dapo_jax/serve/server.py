"""The policy server: a model, its engine and the OpenAI routes, on uvicorn.

    with PolicyServer(model_cfg, params, tok, eos_ids=eos) as server:
      client = openai.OpenAI(base_url=server.url + "/v1", api_key="-")
"""
from __future__ import annotations

import os

from dapo_jax.rollout import engine as engine_lib
from dapo_jax.rollout import sampling
from dapo_jax.serve import http, openai_api
from dapo_jax.serve import images as images_lib
from dapo_jax.serve import scheduler as scheduler_lib

TOKEN_ENV = "DAPO_SERVE_TOKEN"
LOGPROBS_MODES = ("raw", "processed")  # The sampled tokens' log-probs: the model's, or the sampler's (vLLM's names).
# The rollout settings of the KV cache that the server's engine takes from a run's config.
CACHE_SETTINGS = ("kv_layout", "page_size", "kv_pages", "kv_memory_mb", "paged_attention", "prefix_cache")


def prompt_buckets(max_prompt_len: int, smallest: int = 32) -> tuple[int, ...]:
  """Powers of two from `smallest` up to the longest prompt: the prefill shapes compiled."""
  out, b = [], smallest
  while b < max_prompt_len:
    out.append(b)
    b *= 2
  return tuple(out) + (max_prompt_len,)


class PolicyServer:
  """Serves `params` with the OpenAI API on host:port (127.0.0.1 and any free port by default);
  `slots` samples decode together, each prompt up to `max_prompt_len` tokens and each answer up to
  `max_new_tokens`. A decode round returns to the host whenever a sample ends and at least every
  `round_steps` tokens (new requests join then). `compact` lets the pool's width follow the load
  (lower latency for few clients, at the cost of compiling each width as the load first meets it);
  off, every round runs all `slots` rows. `user_prompt`: see `openai_api.OpenAIPolicy`. What clients
  may hold (bodies, connections, the time to send a request, a prompt's characters): `limits`. The
  sampled tokens' log-probs are the model's own (`logprobs_mode="raw"`: temperature 1, before any
  truncation, vLLM's default) or those of the distribution the sampler drew from ("processed": the
  temperature-scaled logits', what a trainer recomputes). `engine_options`: more of `engine.Engine`'s
  arguments (the KV cache's layout: `launch.serve` passes the run config's `rollout.kv_layout`,
  `page_size`, `kv_pages`, `kv_memory_mb`, `paged_attention` and `prefix_cache`). A vision-language policy takes
  up to `max_images` images per chat request, as base64 data: URLs in `image_url` parts (`serve.images`; launch.serve:
  the run config's `data.max_images`; `pan_and_scan`: its `data.pan_and_scan`). A context manager; `start()`
  serves in a thread, `serve_forever()` in front."""

  def __init__(self, model_cfg, params, tok, *, eos_ids, model_name: str = "dapo-policy", host: str = "127.0.0.1",
               port: int = 0, token: str | None = None, slots: int = 16, max_prompt_len: int = 512,
               max_new_tokens: int = 256, round_steps: int = 4, max_queue: int = 1024, top_k: int = 0, mesh=None,
               compact: bool = False, user_prompt=None, limits: http.Limits = http.Limits(),
               logprobs_mode: str = "raw", engine_options: dict | None = None, max_images: int = 1,
               pan_and_scan: bool = False):
    token = token or os.environ.get(TOKEN_ENV) or None
    http.check_bind(host, token, TOKEN_ENV)
    if logprobs_mode not in LOGPROBS_MODES:
      raise http.ServerConfigError(f"--logprobs_mode={logprobs_mode!r}: expected one of {LOGPROBS_MODES}")
    sampler_cfg = sampling.SamplerConfig(max_new_tokens=max_new_tokens, top_k=top_k, eos_ids=tuple(eos_ids),
                                         pad_id=tok.pad_token_id or 0, per_request=True,
                                         raw_logprobs=logprobs_mode == "raw")
    self.engine = engine_lib.Engine(model_cfg, sampler_cfg, slots=slots, prompt_len=max_prompt_len,
                                    prompt_buckets=prompt_buckets(max_prompt_len), mesh=mesh,
                                    round_steps=round_steps, **(engine_options or {}))
    self.scheduler = scheduler_lib.Scheduler(self.engine, params, max_queue=max_queue, compact=compact)
    app = http.new_app("dapo_jax policy server", token, limits.max_body_bytes)
    encoder = (images_lib.ImageEncoder(model_cfg, params, max_images, mesh, pan_and_scan)
               if model_cfg.vision is not None else None)
    self.policy = openai_api.OpenAIPolicy(self.scheduler, tok, model_name, tuple(eos_ids), user_prompt=user_prompt,
                                          max_prompt_chars=limits.max_prompt_chars, images=encoder)
    openai_api.routes(app, self.policy)
    try:
      self.http = http.Server(app, host, port, name="policy-server", limits=limits)
    except http.ServerConfigError:
      self.scheduler.close()
      raise

  @property
  def url(self) -> str:
    return self.http.url

  def start(self) -> "PolicyServer":
    self.http.start()
    return self

  def serve_forever(self) -> None:
    self.http.serve_forever()

  def close(self) -> None:
    self.http.close()
    self.scheduler.close()

  def __enter__(self) -> "PolicyServer":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.close()
