"""The episode gateway: the OpenAI chat API in front of a training rollout's episodes.

    outside harness ── POST {url}/episodes/{id}/v1/chat/completions ──► the episode's inbox
          ▲                                                               │ (HarnessEnv: reset / step)
          └──────────── the turn the engine sampled, as an assistant message ◄┘

Each episode has its own base URL (`url_for(id)`) and its own token (`Episode.token`), so any
OpenAI client is a harness: the id travels in the path, the token as the api_key, and one episode's
client cannot speak for another. A request waits until the engine has sampled the episode's next
turn with the training policy; the answer carries that turn's text (tool calls parsed as the
template writes them). One gateway per process, on 127.0.0.1, within `http.Limits`.
"""
from __future__ import annotations

import asyncio
import hmac
import queue
import secrets
import threading
import time

import fastapi

from dapo_jax.serve import http, openai_messages

REPLY_TIMEOUT_S = 600.0


class Episode:
  """One episode's side of the gateway: requests wait in `inbox` as (body, reply) until the
  environment takes them; `reply(answer)` answers one (a dict, or an APIError). Its requests carry
  `token` (its harness's api_key), no other episode's."""

  def __init__(self, eid: str):
    self.eid = eid
    self.token = secrets.token_hex(16)
    self.inbox: queue.Queue = queue.Queue()
    self.closed = False


class Gateway:
  def __init__(self, host: str = "127.0.0.1", port: int = 0, limits: http.Limits = http.Limits()):
    self.episodes: dict[str, Episode] = {}
    self._lock = threading.Lock()
    # No gateway-wide token: each route checks its episode's own (`_episode`).
    app = http.new_app("dapo_jax episode gateway", None, limits.max_body_bytes)
    self._routes(app)
    self.server = http.Server(app, host, port, name="episode-gateway", limits=limits).start()

  @property
  def url(self) -> str:
    return self.server.url

  def url_for(self, eid: str) -> str:
    return f"{self.url}/episodes/{eid}/v1"

  def open(self) -> Episode:
    ep = Episode(secrets.token_hex(8))
    with self._lock:
      self.episodes[ep.eid] = ep
    return ep

  def close_episode(self, ep: Episode) -> None:
    """Ends an episode: its waiting and later requests are answered 410."""
    with self._lock:
      self.episodes.pop(ep.eid, None)
    ep.closed = True
    ep.inbox.put(None)  # Wakes an environment waiting on it.
    while True:
      try:
        item = ep.inbox.get_nowait()
      except queue.Empty:
        return
      if item is not None and callable(item[1]):  # (Not the harness's own ("end" | "error", ...) note.)
        item[1](http.APIError(410, f"episode {ep.eid} has ended", code="episode_ended"))

  def _routes(self, app: fastapi.FastAPI) -> None:
    @app.get("/episodes/{eid}/v1/models")
    async def models(eid: str, request: fastapi.Request):
      self._episode(eid, request)
      return {"object": "list", "data": [{"id": "policy", "object": "model", "created": 0, "owned_by": "dapo_jax"}]}

    @app.post("/episodes/{eid}/v1/chat/completions")
    async def chat(eid: str, body: dict, request: fastapi.Request):
      ep = self._episode(eid, request)
      if body.get("stream"):
        raise http.APIError(400, "stream: the episode gateway answers whole turns (stream=false)", param="stream")
      await asyncio.to_thread(_check_request, body)  # A malformed request is the harness's 400, not the episode's end.
      loop = asyncio.get_running_loop()
      answer = loop.create_future()
      ep.inbox.put((body, lambda x: loop.call_soon_threadsafe(_settle, answer, x)))
      if ep.closed:  # Closed while we queued: nobody will take it.
        raise http.APIError(410, f"episode {eid} has ended", code="episode_ended")
      try:
        out = await asyncio.wait_for(answer, REPLY_TIMEOUT_S)
      except asyncio.TimeoutError:
        raise http.APIError(503, f"episode {eid}: no turn within {REPLY_TIMEOUT_S:.0f}s") from None
      if isinstance(out, http.APIError):
        raise out
      return out

  def _episode(self, eid: str, request: fastapi.Request) -> Episode:
    """The episode a request names, if it carries that episode's token (ids are random: an unknown
    one reveals nothing, so it is a 404, for a harness whose episode has ended)."""
    ep = self.episodes.get(eid)
    if ep is None:
      raise http.APIError(404, f"no episode {eid!r} (ended, or never opened)", code="episode_not_found")
    got = request.headers.get("authorization", "").encode()
    if not hmac.compare_digest(got, f"Bearer {ep.token}".encode()):
      raise http.APIError(401, "missing or wrong 'Authorization: Bearer <token>' (each episode has its own)",
                          code="invalid_api_key")
    return ep


def _check_request(body: dict) -> None:
  """A 400 naming the field for what the episode could not take: no messages, a malformed one."""
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise http.APIError(400, "messages: expected a non-empty list of messages", param="messages")
  for i, m in enumerate(messages):
    openai_messages.normalize_message(m, i)
  if body.get("tools") is not None:
    openai_messages.check_tools(body["tools"])


def _settle(fut: asyncio.Future, x) -> None:
  if not fut.done():
    fut.set_result(x)


def chat_completion(message: dict, finish: str, usage: dict) -> dict:
  return {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
          "model": "policy", "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
          "usage": usage}


_gateway: Gateway | None = None
_gateway_lock = threading.Lock()


def gateway() -> Gateway:
  """The process's gateway, started on first use."""
  global _gateway
  with _gateway_lock:
    if _gateway is None:
      _gateway = Gateway()
    return _gateway
