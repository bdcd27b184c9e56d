"""The OpenAI API on the engine: /v1/models, /v1/completions, /v1/chat/completions (FastAPI).

Semantics follow OpenAI's and vLLM's where we can honour them, and a request that asks for anything
else gets a 400 naming the field (penalties, streamed echo or alternatives). A completion's `echo` and
`logprobs=N` (up to 20 alternatives) are vLLM's: the prompt's tokens scored too (the first null),
`max_tokens=0` scoring without sampling (what log-likelihood evaluations send), each value the model's
own distribution at temperature 1 (`scoring`), as are chat's `top_logprobs`. `logprobs=0` alone, and
chat's `logprobs` alone, are those the sampler drew from: the temperature-scaled distribution,
before top-p, the quantity a trainer recomputes. Chat prompts are rendered with the model's chat
template, tools with the template's own tool support (`envs.tool_formats`), and an answer's tool calls
are parsed in the template's format into `tool_calls`. A streamed answer with tools is sent whole at
its end (its calls can only be parsed then).

A request is admitted whole or not at all (its prompts x n against the queue), and any failure
cancels all its samples. Text work that grows with a request (checking, rendering and tokenising
the prompt, detokenising samples, log-probs, parsing calls) runs in a thread, not on the event loop
that answers every client; the prompt's text is capped (`http.Limits.max_prompt_chars`) before any
of it is tokenised.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from typing import Any

import fastapi
from fastapi import responses

from dapo_jax.data import images as data_images
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.envs import tool_formats
from dapo_jax.errors import DataError
from dapo_jax.serve import http, logprob_layouts, scoring, tool_stream
from dapo_jax.serve import images as images_lib
from dapo_jax.serve import scheduler as scheduler_lib
from dapo_jax.serve.http import APIError
from dapo_jax.serve.openai_messages import (
  ChatBody,
  CompletionBody,
  _Body,
  _stops,
  assistant_message,
  check_tools,
  normalize_message,
  text_chars,
)
from dapo_jax.serve.sample_text import SampleText

INLINE_TOKENS = 256      # text work on fewer tokens stays on the event loop (a thread hop costs more)


class OpenAIPolicy:
  """The routes' logic over a scheduler: prompts in, OpenAI answers out."""

  def __init__(self, scheduler: scheduler_lib.Scheduler, tok, model_name: str, eos_ids: tuple[int, ...],
               user_prompt=None, max_prompt_chars: int = http.Limits.max_prompt_chars,
               images: images_lib.ImageEncoder | None = None):
    """`user_prompt` (question -> messages): a chat request that is one user message, without tools, is put
    as a run's training prompts were (`builders.user_prompt`: the task's instruction, worked examples).
    `images`: a vision-language policy's tower, for chat messages' image parts (every prompt then
    carries image vectors, zeros without images)."""
    self.scheduler, self.tok, self.model_name, self.eos_ids = scheduler, tok, model_name, tuple(eos_ids)
    self.images = images
    self.user_prompt, self.max_prompt_chars = user_prompt, max_prompt_chars
    self.tool_format = tool_formats.detect(tok)
    self.max_tokens = scheduler.engine.turn_tokens
    self.max_prompt = scheduler.engine.P

  # --- checks ---------------------------------------------------------------------------------

  def _check(self, body: _Body, max_tokens: int | None, scoring_only: bool = False) -> int:
    """max_tokens, checked (0, the prompt scored alone, where `scoring_only` allows it)."""
    if body.model not in (None, self.model_name):
      raise APIError(404, f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                     param="model", code="model_not_found")
    for name in ("presence_penalty", "frequency_penalty"):
      if getattr(body, name):
        raise APIError(400, f"{name}: not supported (0 only)", param=name)
    max_tokens = self.max_tokens if max_tokens is None else max_tokens
    if not int(not scoring_only) <= max_tokens <= self.max_tokens:
      raise APIError(400, f"max_tokens={max_tokens}: expected {int(not scoring_only)}..{self.max_tokens} (the "
                     "server's --max_new_tokens; 0 only with echo)", param="max_tokens")
    return max_tokens

  def _check_chars(self, chars: int, param: str) -> None:
    """The cap on text to render and tokenise, checked before any of it is."""
    if chars > self.max_prompt_chars:
      raise APIError(400, f"{param}: {chars} characters of text exceed the server's {self.max_prompt_chars} "
                     "(max_prompt_chars)", param=param, code="context_length_exceeded")

  def _prompt_ids(self, ids: list[int], param: str) -> list[int]:
    if not ids:
      raise APIError(400, f"{param}: the prompt is empty", param=param)
    if len(ids) > self.max_prompt:
      raise APIError(400, f"{param}: a prompt of {len(ids)} tokens is longer than the server's {self.max_prompt} "
                     "(--max_prompt_len)", param=param, code="context_length_exceeded")
    vocab = self.scheduler.engine.model_cfg.vocab_size
    if any(not 0 <= t < vocab for t in ids):
      raise APIError(400, f"{param}: token ids must be in [0, {vocab})", param=param)
    return ids

  # --- running --------------------------------------------------------------------------------

  async def _gather(self, prompts: list[list[int]], body: _Body, max_tokens: int, stops: list[str], on_update,
                    vectors=None):
    """Runs each prompt's n samples; calls `on_update(i, sample, ended)` as they advance (i: the
    prompt's index x n + the sample's); returns the SampleTexts. The request is admitted whole or
    not at all (429), and any failure (the engine's, the client leaving) cancels all its samples.
    `vectors`: each prompt's image vectors (a vision-language policy; default: none, zeros)."""
    loop, n = asyncio.get_running_loop(), body.n
    events: asyncio.Queue = asyncio.Queue()
    post = lambda q, *ev: loop.call_soon_threadsafe(events.put_nowait, (q, *ev))
    if self.images is not None and vectors is None:
      vectors = [self.images.vectors([])] * len(prompts)
    reqs = [scheduler_lib.Request(prompt_ids=ids, n=n, max_tokens=max_tokens, temperature=body.temperature,
                                  top_p=body.top_p, seed=body.seed, progress=bool(body.stream or stops),
                                  on_event=functools.partial(post, q),
                                  images_MD=None if vectors is None else vectors[q]) for q, ids in enumerate(prompts)]
    try:
      rids = self.scheduler.submit_all(reqs)
    except scheduler_lib.QueueFull as e:
      raise APIError(429, f"the server is busy: {e}", code="queue_full") from None
    samples = [SampleText(self.tok, stops, self.eos_ids) for _ in range(len(prompts) * n)]
    ended = 0
    try:
      while ended < len(samples):
        q, kind, g, x, y = await events.get()
        s = samples[q * n + g]
        if kind == "progress":
          if await _text_work(len(x), s.update, x, y):
            self.scheduler.cancel(rids[q], g)
          await on_update(q * n + g, s, False)
          continue
        if x is None:
          raise http.internal_error("the engine failed", y, "engine_failed")
        await _text_work(len(x.tokens), s.end, x)
        ended += 1
        await on_update(q * n + g, s, True)
    except BaseException:
      for rid in rids:  # The client went away, or the engine failed: free the slots.
        self.scheduler.cancel(rid)
      raise
    return samples

  @staticmethod
  def _usage(prompts, samples) -> dict:
    p = sum(len(ids) for ids in prompts)  # Once per prompt, whatever n (OpenAI, vLLM).
    c = sum(s.completion_tokens() for s in samples)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

  # --- /v1/completions ------------------------------------------------------------------------

  def completion_prompts(self, body: CompletionBody) -> list[list[int]]:
    """The prompts' token ids, checked (text capped before it is tokenised); slow for a long text:
    called in a thread."""
    p = body.prompt
    if isinstance(p, str) or (p and all(isinstance(x, str) for x in p)):
      texts = [p] if isinstance(p, str) else p
      self._check_chars(text_chars(texts if len(texts) > 1 else texts[0], "prompt"), "prompt")
      ids = tokenizer_lib.encode_prompts(self.tok, texts)
    else:
      ids = [p] if p and isinstance(p[0], int) else p
    if not ids:
      raise APIError(400, "prompt: no prompt given", param="prompt")
    return [self._prompt_ids(list(x), f"prompt[{i}]" if len(ids) > 1 else "prompt") for i, x in enumerate(ids)]

  async def _scores(self, rows: list[list[int]]) -> list[scoring.Scores]:
    try:
      future = self.scheduler.score(rows)
    except scheduler_lib.QueueFull as e:
      raise APIError(429, f"the server is busy: {e}", code="queue_full") from None
    try:
      return await asyncio.wrap_future(future)
    except RuntimeError as e:
      raise http.internal_error("scoring failed", str(e), "engine_failed") from None

  def _echo_texts(self, body: CompletionBody, prompts: list[list[int]]) -> list[str]:
    """The prompts' text as echoed: as sent, or the ids decoded."""
    p = body.prompt
    if isinstance(p, str):
      return [p]
    if p and all(isinstance(x, str) for x in p):
      return list(p)
    return [self.tok.decode(ids, skip_special_tokens=False) for ids in prompts]

  def _unscored(self, count: int) -> list[SampleText]:
    """`max_tokens=0`: answers with no token (the prompt is scored alone)."""
    samples = [SampleText(self.tok, [], self.eos_ids) for _ in range(count)]
    for s in samples:
      s.finish = "length"
    return samples

  async def completions(self, body: CompletionBody):
    max_tokens = self._check(body, body.max_tokens, scoring_only=body.echo)
    if body.stream and body.echo:
      raise APIError(400, "echo: not supported with stream", param="echo")
    stops = _stops(body.stop)
    prompts = await asyncio.to_thread(self.completion_prompts, body)
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": cid, "object": "text_completion", "created": created, "model": self.model_name}
    want_logprobs = body.logprobs is not None

    def choice(i, s: SampleText, text: str, finish):
      return {"index": i, "text": text, "finish_reason": finish,
              "logprobs": logprob_layouts.completion_sampled(s) if want_logprobs and finish else None}

    if not body.stream:
      n = body.n
      if max_tokens:
        samples = await self._gather(prompts, body, max_tokens, stops, _nothing)
      else:
        samples = self._unscored(len(prompts) * n)
      if not (body.echo or body.logprobs):
        choices = await _text_work(_tokens(samples) if want_logprobs else 0,
                                   lambda: [choice(i, s, s.text, s.finish) for i, s in enumerate(samples)])
        return {**head, "choices": choices, "usage": self._usage(prompts, samples)}
      answers = [s.answer_tokens() for s in samples]
      scores = await self._scores([prompts[i // n] + a for i, a in enumerate(answers)]) if want_logprobs else None
      texts = self._echo_texts(body, prompts) if body.echo else None

      def scored_choices():
        out = []
        for i, s in enumerate(samples):
          text = texts[i // n] + s.text if body.echo else s.text
          lp = (logprob_layouts.completion_scored(self.tok, prompts[i // n], answers[i], scores[i],
                                                  body.logprobs, body.echo) if want_logprobs else None)
          out.append({"index": i, "text": text, "finish_reason": s.finish, "logprobs": lp})
        return out
      choices = await _text_work(_tokens(samples) + sum(map(len, prompts)), scored_choices)
      return {**head, "choices": choices, "usage": self._usage(prompts, samples)}

    async def chunks(emit):
      sent = [0] * (len(prompts) * body.n)  # Each choice's tokens whose log-probs went out.

      async def logprobs_delta(i, s: SampleText):
        """The log-probs of the tokens settled since the last chunk (none a stop string may still cut);
        N > 0: scored by a teacher-forced pass over the answer so far, its stop token at its end."""
        pairs = await _text_work(len(s.tokens), s.token_logprobs, True)
        if body.logprobs:
          answer = s.answer_tokens() if s.finish is not None else s.answer_tokens()[:len(pairs)]
          if len(answer) <= sent[i]:
            return None
          scores = await self._scores([prompts[i // body.n] + answer])
          full = await _text_work(len(answer), logprob_layouts.completion_scored, self.tok, prompts[i // body.n],
                                  answer, scores[0], body.logprobs, False)
        else:
          if len(pairs) <= sent[i]:
            return None
          full = await _text_work(len(pairs), logprob_layouts.completion_sampled, s)
        end = len(full["tokens"]) if s.finish is not None else (len(answer) if body.logprobs else len(pairs))
        out = {k: None if v is None else v[sent[i]:end] for k, v in full.items()}
        sent[i] = end
        return out

      async def update(i, s: SampleText, done: bool):
        text = s.delta()
        if s.reported:
          return
        logprobs = await logprobs_delta(i, s) if want_logprobs else None
        if not (text or s.finish or logprobs):
          return
        s.reported = s.finish is not None
        await emit({**head, "choices": [{"index": i, "text": text, "finish_reason": s.finish, "logprobs": logprobs}]})

      samples = await self._gather(prompts, body, max_tokens, stops, update)
      if (body.stream_options or {}).get("include_usage"):
        await emit({**head, "choices": [], "usage": self._usage(prompts, samples)})
    return _event_stream(chunks)

  # --- /v1/chat/completions -------------------------------------------------------------------

  def forced_opening(self, body: ChatBody) -> str:
    """The call opening `tool_choice` forces after the generation prompt ("required": a call; a named
    function: a call of it), checked; '' for "auto" and "none"."""
    choice = body.tool_choice
    if choice in (None, "auto", "none"):
      return ""
    if not body.tools:
      raise APIError(400, f"tool_choice: {choice!r} needs tools", param="tool_choice")
    name = None
    if isinstance(choice, dict):
      name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
      names = [(t.get("function") or {}).get("name") for t in body.tools]
      if name not in names:
        raise APIError(400, f"tool_choice: expected \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                       f"\"function\": {{\"name\": one of {names}}}}}, got {json.dumps(choice)[:200]}",
                       param="tool_choice")
    opening = tool_formats.call_opening(self.tool_format, name)
    if not opening:
      raise APIError(400, f"tool_choice: {json.dumps(choice)[:200]} cannot be forced: the chat template has no "
                     "tool-call format (\"auto\" and \"none\" only)", param="tool_choice")
    return opening

  def chat_prompt(self, body: ChatBody) -> tuple[list[int], list | None, str, Any]:
    """The conversation's token ids, the tools whose calls are parsed from the answer, the call
    opening that `tool_choice` forces (the ids end with it), and its images' vectors (a vision-language
    policy's; None otherwise), checked (text capped before it is rendered); slow for a long
    conversation or images: called in a thread. The tools are rendered whatever `tool_choice` is;
    "none" parses no call (vLLM's behaviour)."""
    chars = sum(text_chars(m, f"messages[{i}]") for i, m in enumerate(body.messages))
    chars += check_tools(body.tools) if body.tools is not None else 0
    self._check_chars(chars, "messages")
    images = [] if self.images is not None else None
    messages = [normalize_message(m, i, images) for i, m in enumerate(body.messages)]
    if images and self.images.pan_and_scan:
      messages, images = map(list, data_images.pan_and_scan(messages, images, "messages"))
    tools = body.tools
    opening = self.forced_opening(body)
    if not getattr(self.tok, "chat_template", None):
      raise APIError(400, "messages: the model has no chat template; use /v1/completions", param="messages")
    if self.user_prompt is not None and tools is None and len(messages) == 1 and messages[0]["role"] == "user":
      messages = self.user_prompt(messages[0]["content"])
    messages = tool_formats.prompt_messages(messages, tools, self.tool_format)
    native = tools if self.tool_format in ("qwen", "llama3") else None
    try:
      text = tokenizer_lib.render(self.tok, messages, True, tools=native)
    except Exception as e:  # The template refused the conversation (roles out of order, ...).
      raise APIError(400, f"messages: the chat template cannot render them: {e}", param="messages") from None
    vectors = None
    if self.images is not None:
      if images and body.logprobs and body.top_logprobs:
        raise APIError(400, "top_logprobs: not supported with images (the scoring pass reads text)",
                       param="top_logprobs")
      try:
        text = data_images.expand_marks(text, self.tok, self.images.vcfg, images)
        want = data_images.placeholders(self.images.vcfg, images)
      except DataError as e:
        raise APIError(400, f"messages: {e}", param="messages") from None
    ids = self._prompt_ids(tokenizer_lib.encode_prompts(self.tok, [text + opening])[0], "messages")
    if self.images is not None:
      held = sum(t == self.images.vcfg.image_token_id for t in ids)
      if held != want:
        raise APIError(400, f"messages: the prompt holds {held} image placeholders for {len(images)} image part(s) "
                       f"({want} placeholders): its text holds {data_images.IMAGE_MARK!r} or image tokens itself",
                       param="messages")
      vectors = self.images.vectors(images)
    return ids, (tools if body.tool_choice != "none" else None), opening, vectors

  def _message(self, s: SampleText, tools, opening: str = "") -> tuple[dict, str]:
    """The assistant message of a finished sample (after a forced call `opening`), and its finish reason."""
    return assistant_message(opening + s.text, tools, self.tool_format, s.finish)

  async def chat(self, body: ChatBody):
    max_tokens = self._check(body, body.max_completion_tokens or body.max_tokens)
    stops = _stops(body.stop)
    ids, tools, opening, vectors = await asyncio.to_thread(self.chat_prompt, body)
    vectors = None if vectors is None else [vectors]
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": cid, "created": created, "model": self.model_name, "system_fingerprint": None}

    def choice(i, s: SampleText, scores=None) -> dict:
      message, finish = self._message(s, tools, opening)
      if scores is not None:
        logprobs = logprob_layouts.chat_scored(self.tok, s.token_logprobs(), len(ids), scores[i],
                                               body.top_logprobs)
      else:
        logprobs = logprob_layouts.chat_sampled(s.token_logprobs()) if body.logprobs else None
      return {"index": i, "message": message, "finish_reason": finish, "logprobs": logprobs}

    if not body.stream:
      samples = await self._gather([ids], body, max_tokens, stops, _nothing, vectors)
      scored = body.logprobs and body.top_logprobs
      scores = await self._scores([ids + s.answer_tokens() for s in samples]) if scored else None
      choices = await _text_work(_tokens(samples), lambda: [choice(i, s, scores) for i, s in enumerate(samples)])
      return {**head, "object": "chat.completion", "choices": choices, "usage": self._usage([ids], samples)}

    head = {**head, "object": "chat.completion.chunk"}

    async def chunks(emit):
      calls = {}  # A choice's tool calls as they stream (`tool_stream`).
      logprobs_sent = {}  # A choice's tokens whose log-probs went out.

      async def update(i, s: SampleText, done: bool):
        if i not in calls:
          calls[i], logprobs_sent[i] = tool_stream.ToolCallStream(self.tool_format, tools), 0
          await emit({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                           "finish_reason": None}]})
        if s.reported:
          return
        finish = None
        if tools:
          ended = done or s.finish is not None
          text = opening + (s.text if ended else s.settled_text())
          delta, finish = await _text_work(len(s.tokens), calls[i].update, text, ended, s.finish)
        else:
          delta, finish = {"content": s.delta()}, s.finish
          if not delta["content"] and not (done or s.finish):
            delta = None
        chunk = {"index": i, "delta": delta or {}, "finish_reason": None, "logprobs": None}
        if body.logprobs:  # The tokens drawn since the last chunk (up to a stop string).
          pairs = await _text_work(len(s.tokens), s.token_logprobs, True)
          if len(pairs) > logprobs_sent[i]:
            if body.top_logprobs:  # Their alternatives: a teacher-forced pass over what is settled.
              scores = await self._scores([ids + s.answer_tokens()[:len(pairs)]])
              chunk["logprobs"] = logprob_layouts.chat_scored(self.tok, pairs, len(ids), scores[0],
                                                              body.top_logprobs, start=logprobs_sent[i])
            else:
              chunk["logprobs"] = logprob_layouts.chat_sampled(pairs[logprobs_sent[i]:])
            logprobs_sent[i] = len(pairs)
        if done or (not tools and s.finish) or (tools and finish):
          s.reported = True
          chunk["finish_reason"] = finish
        if delta or chunk["logprobs"] or chunk["finish_reason"]:
          await emit({**head, "choices": [chunk]})

      samples = await self._gather([ids], body, max_tokens, stops, update, vectors)
      if (body.stream_options or {}).get("include_usage"):
        await emit({**head, "choices": [], "usage": self._usage([ids], samples)})
    return _event_stream(chunks)


async def _nothing(*_):
  return None


async def _text_work(tokens: int, fn, *args):
  """`fn(*args)`, text work on `tokens` tokens: in a thread, so the event loop answers other clients
  meanwhile, unless it is small (a thread hop would cost more)."""
  if tokens < INLINE_TOKENS:
    return fn(*args)
  return await asyncio.to_thread(fn, *args)


def _tokens(samples: list[SampleText]) -> int:
  return sum(len(s.tokens) for s in samples)


def _event_stream(produce) -> responses.StreamingResponse:
  """Server-sent events: `produce(emit)` emits chunks; the stream ends with `data: [DONE]`. An error
  after the first byte goes out as an error event (the status line has been sent)."""
  async def gen():
    q: asyncio.Queue = asyncio.Queue()

    async def emit(chunk):
      await q.put(chunk)

    async def run():
      try:
        await produce(emit)
      except Exception as e:  # noqa: BLE001 (anything but ours is logged, and named by an id)
        if not isinstance(e, APIError):
          eid = http.error_id()
          logging.exception("a streamed answer failed (%s)", eid)
          e = http.internal_error("the server failed on this request", eid)
        await q.put({"error": {"message": e.message, "type": APIError.TYPES.get(e.status), "code": e.code}})
      finally:
        await q.put(None)

    task = asyncio.create_task(run())
    try:
      while (chunk := await q.get()) is not None:
        yield f"data: {json.dumps(chunk)}\n\n"
      yield "data: [DONE]\n\n"
    finally:
      task.cancel()  # The client went away: the samples are cancelled with the task.

  return responses.StreamingResponse(gen(), media_type="text/event-stream")


def routes(app: fastapi.FastAPI, policy: OpenAIPolicy) -> None:
  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": policy.model_name, "object": "model", "created": 0,
                                        "owned_by": "dapo_jax"}]}

  @app.get("/v1/models/{name}")
  async def model(name: str):
    if name != policy.model_name:
      raise APIError(404, f"model {name!r} does not exist", param="model", code="model_not_found")
    return {"id": name, "object": "model", "created": 0, "owned_by": "dapo_jax"}

  @app.post("/v1/completions")
  async def completions(body: CompletionBody, request: fastapi.Request):
    return await http.until_disconnected(request, policy.completions(body))

  @app.post("/v1/chat/completions")
  async def chat(body: ChatBody, request: fastapi.Request):
    return await http.until_disconnected(request, policy.chat(body))
