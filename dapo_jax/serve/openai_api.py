"""The OpenAI API on the engine: /v1/models, /v1/completions, /v1/chat/completions (FastAPI).

Semantics follow OpenAI's where we can honour them, and a request asks for anything else gets a
400 naming the field (echo, top alternatives in logprobs, penalties). Log-probs are those the
sampler drew from: the temperature-scaled distribution, before top-p (at temperature 0, the
model's own), the quantity a trainer recomputes. Chat prompts are rendered with the model's chat
template, tools with the template's own tool support (`envs.tool_formats`), and an answer's tool
calls are parsed in the template's format into `tool_calls`. A streamed answer with tools is sent
whole at its end (its calls can only be parsed then).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Literal, Union

import fastapi
import numpy as np
import pydantic
from fastapi import responses

from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.envs import tool_formats
from dapo_jax.serve import http
from dapo_jax.serve import scheduler as scheduler_lib
from dapo_jax.serve.http import APIError


class _Body(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="ignore")
  model: str | None = None
  max_tokens: int | None = None
  temperature: float = pydantic.Field(1.0, ge=0.0, le=2.0)
  top_p: float = pydantic.Field(1.0, gt=0.0, le=1.0)
  n: int = pydantic.Field(1, ge=1, le=128)
  stop: Union[str, list[str], None] = None
  seed: int | None = None
  stream: bool = False
  stream_options: dict | None = None
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0


class CompletionBody(_Body):
  prompt: Union[str, list[str], list[int], list[list[int]]]
  logprobs: int | None = pydantic.Field(None, ge=0, le=5)
  echo: bool = False


class ChatBody(_Body):
  messages: list[dict[str, Any]] = pydantic.Field(min_length=1)
  max_completion_tokens: int | None = None
  logprobs: bool = False
  top_logprobs: int | None = pydantic.Field(None, ge=0, le=20)
  tools: list[dict[str, Any]] | None = None
  tool_choice: Union[Literal["none", "auto", "required"], dict, None] = None


class SampleText:
  """One sample's text as its tokens arrive: incremental decoding, stop strings, what may be sent."""

  def __init__(self, tok, stops: list[str], eos_ids: tuple[int, ...]):
    self.tok, self.stops, self.eos = tok, stops, set(eos_ids)
    self.tokens: np.ndarray = np.zeros(0, np.int32)
    self.logp: np.ndarray = np.zeros(0, np.float32)
    self.text, self.sent = "", 0
    self.finish: str | None = None
    self.cut_at: int | None = None     # the text ends at a stop string
    self.reported = False              # a stream has sent its finish_reason

  def update(self, tokens: np.ndarray, logp: np.ndarray) -> bool:
    """Takes the tokens drawn so far; True when a stop string ended the sample."""
    if self.finish is not None:
      return False
    self.tokens, self.logp = tokens, logp
    self.text = self.tok.decode(self._content_tokens(), skip_special_tokens=True)
    hits = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
    if hits:
      self.cut_at = min(hits)
      self.text, self.finish = self.text[:self.cut_at], "stop"
      return True
    return False

  def end(self, ended: scheduler_lib.Ended) -> None:
    if self.update(ended.tokens, ended.logp) or self.finish is not None:
      return
    self.finish = "length" if ended.truncated else "stop"

  def _content_tokens(self) -> np.ndarray:
    n = len(self.tokens)
    return self.tokens[:n - 1] if n and int(self.tokens[-1]) in self.eos else self.tokens

  def delta(self) -> str:
    """Text not yet sent that no stop string can still claim (and no half-decoded character)."""
    end = len(self.text)
    if self.finish is None:
      hold = max((len(s) - 1 for s in self.stops), default=0)
      end = max(self.sent, end - hold)
      while end > self.sent and self.text[end - 1] == "\ufffd":
        end -= 1
    out, self.sent = self.text[self.sent:end], end
    return out

  def token_logprobs(self) -> list[tuple[str, float]]:
    """(token text, log-prob) of the content's tokens (up to a stop string; the EOS left out)."""
    out, content = [], self._content_tokens()
    for i, t in enumerate(content):
      if self.cut_at is not None and len(self.tok.decode(content[:i], skip_special_tokens=True)) >= self.cut_at:
        break
      out.append((self.tok.decode([int(t)], skip_special_tokens=False), float(self.logp[i])))
    return out


def _stops(stop) -> list[str]:
  stops = [stop] if isinstance(stop, str) else list(stop or [])
  if len(stops) > 4 or any(not s for s in stops):
    raise APIError(400, "stop: at most 4 non-empty strings", param="stop")
  return stops


def normalize_message(m: dict, i: int) -> dict:
  """A message as the chat template expects it: text content, tool-call arguments as objects."""
  if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
    raise APIError(400, f"messages[{i}].role: expected system, user, assistant or tool", param=f"messages[{i}].role")
  m = dict(m)
  if m["role"] == "developer":
    m["role"] = "system"
  content = m.get("content")
  if isinstance(content, list):  # Content parts: text only.
    if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
      raise APIError(400, f"messages[{i}].content: only text parts are supported", param=f"messages[{i}].content")
    content = "".join(p.get("text", "") for p in content)
  if content is not None and not isinstance(content, str):
    raise APIError(400, f"messages[{i}].content: expected a string or text parts", param=f"messages[{i}].content")
  m["content"] = content or ""
  calls = []
  for call in m.get("tool_calls") or []:
    f = dict(call.get("function", call))
    if isinstance(f.get("arguments"), str):
      try:
        f["arguments"] = json.loads(f["arguments"] or "{}")
      except json.JSONDecodeError:
        raise APIError(400, f"messages[{i}].tool_calls: arguments are not JSON",
                       param=f"messages[{i}].tool_calls") from None
    calls.append({"type": "function", "function": f, **({"id": call["id"]} if "id" in call else {})})
  if calls:
    m["tool_calls"] = calls
  else:
    m.pop("tool_calls", None)
  return m


def assistant_message(text: str, tools, fmt: str, finish: str = "stop") -> tuple[dict, str]:
  """A policy turn as an OpenAI assistant message and its finish reason: with tools, the calls
  parsed in the template's format become `tool_calls` (arguments as JSON text, as OpenAI sends
  them) and the rest stays the content; a malformed call stays text, for the client to see."""
  if tools:
    try:
      calls = tool_formats.parse_tool_calls(text, fmt)
    except tool_formats.ToolCallError:
      calls = []
    if calls:
      content = tool_formats.strip_calls(text, fmt) if fmt != "gemma" else ""
      return {"role": "assistant", "content": content or None,
              "tool_calls": [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                              "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                             for c in calls]}, "tool_calls"
  return {"role": "assistant", "content": text}, finish


class OpenAIPolicy:
  """The routes' logic over a scheduler: prompts in, OpenAI answers out."""

  def __init__(self, scheduler: scheduler_lib.Scheduler, tok, model_name: str, eos_ids: tuple[int, ...],
               user_prompt=None):
    """`user_prompt` (question -> messages): a chat request that is one user message, without tools, is put
    as a run's training prompts were (`from_config.user_prompt`: the task's instruction, worked examples)."""
    self.scheduler, self.tok, self.model_name, self.eos_ids = scheduler, tok, model_name, tuple(eos_ids)
    self.user_prompt = user_prompt
    self.tool_format = tool_formats.detect(tok)
    self.max_tokens = scheduler.engine.turn_tokens
    self.max_prompt = scheduler.engine.P

  # --- checks ---------------------------------------------------------------------------------

  def _check(self, body: _Body, max_tokens: int | None) -> int:
    if body.model not in (None, self.model_name):
      raise APIError(404, f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                     param="model", code="model_not_found")
    for name in ("presence_penalty", "frequency_penalty"):
      if getattr(body, name):
        raise APIError(400, f"{name}: not supported (0 only)", param=name)
    max_tokens = self.max_tokens if max_tokens is None else max_tokens
    if not 1 <= max_tokens <= self.max_tokens:
      raise APIError(400, f"max_tokens={max_tokens}: expected 1..{self.max_tokens} (the server's --max_new_tokens)",
                     param="max_tokens")
    return max_tokens

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

  async def _run(self, prompt_ids: list[int], body: _Body, max_tokens: int, stops: list[str], n: int, on_update):
    """Runs one prompt's n samples; calls `on_update(g, sample, ended)` as they advance; returns the
    SampleTexts."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    req = scheduler_lib.Request(
        prompt_ids=prompt_ids, n=n, max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
        seed=body.seed, progress=bool(body.stream or stops),
        on_event=lambda *ev: loop.call_soon_threadsafe(events.put_nowait, ev))
    try:
      rid = self.scheduler.submit(req)
    except scheduler_lib.QueueFull as e:
      raise APIError(429, f"the server is busy: {e}", code="queue_full") from None
    samples = [SampleText(self.tok, stops, self.eos_ids) for _ in range(n)]
    ended = 0
    try:
      while ended < n:
        kind, g, x, y = await events.get()
        s = samples[g]
        if kind == "progress":
          if s.update(x, y):
            self.scheduler.cancel(rid, g)
          await on_update(g, s, False)
          continue
        if x is None:
          raise APIError(500, f"the engine failed: {y}")
        s.end(x)
        ended += 1
        await on_update(g, s, True)
    except BaseException:
      self.scheduler.cancel(rid)  # The client went away, or the engine failed: free the slots.
      raise
    return samples

  async def _gather(self, prompts: list[list[int]], body: _Body, max_tokens: int, stops: list[str], on_update):
    async def one(q, ids):
      return await self._run(ids, body, max_tokens, stops, body.n,
                             lambda g, s, done: on_update(q * body.n + g, s, done))
    return [s for ss in await asyncio.gather(*(one(q, ids) for q, ids in enumerate(prompts))) for s in ss]

  @staticmethod
  def _usage(prompts, samples) -> dict:
    p = sum(len(ids) for ids in prompts) * (len(samples) // max(len(prompts), 1))
    c = sum(len(s.tokens) for s in samples)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

  # --- /v1/completions ------------------------------------------------------------------------

  def completion_prompts(self, body: CompletionBody) -> list[list[int]]:
    p = body.prompt
    if isinstance(p, str) or (p and all(isinstance(x, str) for x in p)):
      texts = [p] if isinstance(p, str) else p
      ids = tokenizer_lib.encode_prompts(self.tok, texts)
    else:
      ids = [p] if p and isinstance(p[0], int) else p
    if not ids:
      raise APIError(400, "prompt: no prompt given", param="prompt")
    return [self._prompt_ids(list(x), f"prompt[{i}]" if len(ids) > 1 else "prompt") for i, x in enumerate(ids)]

  def _completion_logprobs(self, s: SampleText) -> dict:
    pairs = s.token_logprobs()
    offsets = np.cumsum([0] + [len(t) for t, _ in pairs])[:-1].tolist()
    return {"tokens": [t for t, _ in pairs], "token_logprobs": [lp for _, lp in pairs],
            "top_logprobs": None, "text_offset": offsets}

  async def completions(self, body: CompletionBody):
    max_tokens = self._check(body, body.max_tokens)
    if body.echo:
      raise APIError(400, "echo: not supported (false only)", param="echo")
    if body.logprobs:
      raise APIError(400, "logprobs: top alternatives are not returned; logprobs=0 gives the sampled tokens' "
                     "log-probs", param="logprobs")
    stops = _stops(body.stop)
    prompts = self.completion_prompts(body)
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": cid, "object": "text_completion", "created": created, "model": self.model_name}
    want_logprobs = body.logprobs is not None

    def choice(i, s: SampleText, text: str, finish):
      return {"index": i, "text": text, "finish_reason": finish,
              "logprobs": self._completion_logprobs(s) if want_logprobs and finish else None}

    if not body.stream:
      samples = await self._gather(prompts, body, max_tokens, stops, _nothing)
      return {**head, "choices": [choice(i, s, s.text, s.finish) for i, s in enumerate(samples)],
              "usage": self._usage(prompts, samples)}

    async def chunks(emit):
      async def update(i, s: SampleText, done: bool):
        text = s.delta()
        if s.reported or not (text or s.finish):
          return
        s.reported = s.finish is not None
        await emit({**head, "choices": [choice(i, s, text, s.finish)]})

      samples = await self._gather(prompts, body, max_tokens, stops, update)
      if (body.stream_options or {}).get("include_usage"):
        await emit({**head, "choices": [], "usage": self._usage(prompts, samples)})
    return _event_stream(chunks)

  # --- /v1/chat/completions -------------------------------------------------------------------

  def chat_prompt(self, body: ChatBody) -> tuple[list[int], list | None]:
    messages = [normalize_message(m, i) for i, m in enumerate(body.messages)]
    tools = body.tools if body.tool_choice != "none" else None
    if tools is not None:
      for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("function", t).get("name"), str):
          raise APIError(400, f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ...}}}}",
                         param=f"tools[{i}]")
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
    return self._prompt_ids(tokenizer_lib.encode_prompts(self.tok, [text])[0], "messages"), tools

  def _message(self, s: SampleText, tools) -> tuple[dict, str]:
    """The assistant message of a finished sample, and its finish reason."""
    return assistant_message(s.text, tools, self.tool_format, s.finish)

  @staticmethod
  def _chat_logprobs(s: SampleText) -> dict:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in s.token_logprobs()]}

  async def chat(self, body: ChatBody):
    max_tokens = self._check(body, body.max_completion_tokens or body.max_tokens)
    if body.top_logprobs:
      raise APIError(400, "top_logprobs: top alternatives are not returned (0 only); logprobs=true gives the "
                     "sampled tokens' log-probs", param="top_logprobs")
    stops = _stops(body.stop)
    ids, tools = self.chat_prompt(body)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": cid, "created": created, "model": self.model_name, "system_fingerprint": None}

    if not body.stream:
      samples = await self._gather([ids], body, max_tokens, stops, _nothing)
      choices = []
      for i, s in enumerate(samples):
        message, finish = self._message(s, tools)
        choices.append({"index": i, "message": message, "finish_reason": finish,
                        "logprobs": self._chat_logprobs(s) if body.logprobs else None})
      return {**head, "object": "chat.completion", "choices": choices, "usage": self._usage([ids], samples)}

    head = {**head, "object": "chat.completion.chunk"}

    async def chunks(emit):
      started = set()

      async def update(i, s: SampleText, done: bool):
        if i not in started:
          started.add(i)
          await emit({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                           "finish_reason": None}]})
        if s.reported or (tools and not done):
          return  # (Calls are parsed from the whole turn: the answer goes out at its end.)
        if tools:
          message, finish = self._message(s, tools)
          delta = {k: v for k, v in message.items() if k != "role"}
          if "tool_calls" in delta:
            delta["tool_calls"] = [dict(c, index=k) for k, c in enumerate(delta["tool_calls"])]
        else:
          delta, finish = {"content": s.delta()}, s.finish
          if not delta["content"] and not (done or s.finish):
            return
        chunk = {"index": i, "delta": delta, "finish_reason": None,
                 "logprobs": None}
        if done or (not tools and s.finish):
          s.reported = True
          chunk["finish_reason"] = finish
          if body.logprobs:
            chunk["logprobs"] = self._chat_logprobs(s)
        await emit({**head, "choices": [chunk]})

      samples = await self._gather([ids], body, max_tokens, stops, update)
      if (body.stream_options or {}).get("include_usage"):
        await emit({**head, "choices": [], "usage": self._usage([ids], samples)})
    return _event_stream(chunks)


async def _nothing(*_):
  return None


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
      except APIError as e:
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
