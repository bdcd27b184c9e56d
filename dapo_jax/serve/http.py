"""What every server here shares: the bind rule, the bearer token, OpenAI-style errors, and an
ASGI app run by uvicorn in a thread (or in the foreground) on a socket bound before it starts.

A server binds to 127.0.0.1 unless told otherwise; on any other address it requires a shared
token, which requests carry as `Authorization: Bearer <token>` (the `openai` client sends its
api_key so). Port 0 takes any free port; `url` says which. What one client may hold of a server
(its body, its connections, the time it takes to send a request) is bounded by `Limits`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import secrets
import socket
import threading

import fastapi
import h11
import starlette.exceptions
import starlette.requests
import uvicorn
from fastapi import responses
from uvicorn.protocols.http.h11_impl import H11Protocol

from dapo_jax import errors

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass(frozen=True)
class Limits:
  """What clients may hold of a server. uvicorn bounds an idle connection between requests
  (keep-alive) and a request's head (16 KiB, h11), but not how long a head or a body may take to
  arrive nor how many connections may be open: a client that opens connections and sends half a
  request would hold them for ever. Every server here takes one (`limits=`)."""
  max_body_bytes: int = 64 << 20   # a request body, as it arrives (chunked or not); 413 past it
  max_connections: int = 512       # connections open at once; one more is answered 503 and closed
  header_timeout_s: float = 10.0   # from a connection's opening (or its next request's first byte) to its last header
  body_timeout_s: float = 30.0     # the longest pause inside a request body; the connection is then closed
  keep_alive_s: float = 30.0       # an idle connection between two requests is closed after this
  max_prompt_chars: int = 1 << 20  # policy server: characters a request may have rendered and tokenised; 400 past it


MAX_BODY_BYTES = Limits.max_body_bytes


def limits(**overrides) -> Limits:
  """`Limits` with the settings given (a command-line flag left unset, None, keeps the default)."""
  return Limits(**{k: v for k, v in overrides.items() if v is not None})


def error_id() -> str:
  """An id for a failure: the client's 500 names it, the server's log has the cause under it."""
  return f"err_{secrets.token_hex(6)}"


def internal_error(what: str, eid: str, code: str = "internal_error") -> "APIError":
  """A 500 that says what failed and under which id the log has why (an exception's text can
  carry paths, data or a secret: it stays in the log)."""
  return APIError(500, f"{what}; the server's log has the cause under {eid}", code=code)


class ServerConfigError(errors.UserError, ValueError):
  """A server that cannot start as configured (a public address without a token, a taken port)."""


class APIError(Exception):
  """An error answered as an OpenAI error object: {"error": {"message", "type", "param", "code"}}."""

  TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
           405: "invalid_request_error", 408: "invalid_request_error", 410: "invalid_request_error",
           413: "invalid_request_error",
           429: "rate_limit_error", 500: "server_error", 503: "server_error"}

  def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code = status, message, param, code

  def response(self) -> responses.JSONResponse:
    body = {"message": self.message, "type": self.TYPES.get(self.status, "server_error"), "param": self.param,
            "code": self.code}
    return responses.JSONResponse({"error": body}, status_code=self.status)


def check_bind(host: str, token: str | None, token_env: str) -> None:
  if host not in LOCAL_HOSTS and not token:
    raise ServerConfigError(f"refusing to serve on {host!r} without a token: pass --token or set {token_env} "
                            "(only 127.0.0.1 / localhost may go without one)")


def check_port(host: str, port: int) -> None:
  """Fails fast, before a model loads, on a port another process listens on (port 0: any free one)."""
  if not port:
    return
  with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      s.bind((host, port))
    except OSError as e:
      raise ServerConfigError(f"cannot bind {host}:{port}: {e}") from None


def new_app(title: str, token: str | None, max_body_bytes: int = Limits.max_body_bytes) -> fastapi.FastAPI:
  """A FastAPI app whose every route but /health needs the token (when one is set), whose bodies
  are capped, and whose errors (ours, FastAPI's validation, anything raised) are error objects."""
  app = fastapi.FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)
  app.add_middleware(_BodyCap, max_body_bytes=max_body_bytes)
  expected = f"Bearer {token}".encode() if token else None

  @app.middleware("http")
  async def guard(request: fastapi.Request, call_next):
    if expected is not None and request.url.path.rstrip("/") != "/health":
      got = request.headers.get("authorization", "").encode()
      if not hmac.compare_digest(got, expected):
        return APIError(401, "missing or wrong 'Authorization: Bearer <token>'", code="invalid_api_key").response()
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
      return APIError(413, f"request body of {length} bytes exceeds {max_body_bytes}").response()
    return await call_next(request)

  @app.exception_handler(APIError)
  async def api_error(request, e: APIError):
    return e.response()

  @app.exception_handler(fastapi.exceptions.RequestValidationError)
  async def bad_request(request, e):
    err = e.errors()[0] if e.errors() else {}
    field = ".".join(str(x) for x in err.get("loc", ())[1:]) or None
    return APIError(400, f"{field or 'body'}: {err.get('msg', 'invalid request')}", param=field).response()

  @app.exception_handler(starlette.exceptions.HTTPException)
  async def http_error(request, e):  # No such route (404), a route without this method (405), ...
    what = "no route" if e.status_code == 404 else str(e.detail).lower()
    return APIError(e.status_code, f"{what}: {request.method} {request.url.path}").response()

  @app.exception_handler(starlette.requests.ClientDisconnect)
  async def gone(request, e):  # The client left while sending its body: nobody reads the answer.
    logging.info("%s %s: the client went away before its body was sent", request.method, request.url.path)
    return APIError(400, "the client went away before its body was sent").response()

  @app.exception_handler(Exception)
  async def internal(request, e):
    eid = error_id()
    logging.exception("%s %s failed (%s)", request.method, request.url.path, eid)
    return internal_error("the server failed on this request", eid).response()

  @app.get("/health")
  async def health():
    return {"status": "ok"}

  return app


class _BodyCap:
  """Caps the bytes a request body may bring, as they arrive: a chunked body declares no length, so
  the Content-Length check alone would let it grow without bound (413 once it passes the cap)."""

  def __init__(self, app, max_body_bytes: int):
    self.app, self.max = app, max_body_bytes

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    seen = 0

    async def capped():
      nonlocal seen
      message = await receive()
      seen += len(message.get("body", b""))
      if seen > self.max:  # An HTTPException: FastAPI's body parsing passes it on as it is (413).
        raise starlette.exceptions.HTTPException(413, f"request body exceeds {self.max} bytes")
      return message

    await self.app(scope, capped, send)


async def until_disconnected(request: fastapi.Request, work):
  """Awaits `work` (a coroutine) unless the client goes away first: then it is cancelled (with it the
  samples it runs) and this raises ClientDisconnect. A streamed answer notices on its next write; a
  whole one would otherwise decode to its end for nobody. (After the body, the next ASGI message is
  the disconnect; `Request.is_disconnected` cannot see it through the middleware's task group.)"""
  async def gone():
    while (await request.receive())["type"] != "http.disconnect":
      pass

  task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone())
  try:
    await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
      return task.result()
    raise starlette.requests.ClientDisconnect()
  finally:
    for t in (task, watch):
      t.cancel()


class _Protocol(H11Protocol):
  """uvicorn's h11 protocol with `Limits`: a deadline on each request's head (counted from the
  connection's opening, then from each later request's first byte, so trickling bytes does not
  extend it), a bound on each pause inside a body, and a cap on open connections (answered at once:
  uvicorn's `limit_concurrency` answers only once a request's head is in, which a stalled client
  never sends)."""

  limits = Limits()

  def connection_made(self, transport) -> None:
    self._head_timer = self._body_timer = None
    if len(self.connections) >= self.limits.max_connections:
      self.transport = transport
      logging.warning("refusing a connection: %d are open (Limits.max_connections)", len(self.connections))
      _answer_raw(transport, 503, "Service Unavailable", f"the server holds {len(self.connections)} connections, "
                  "its most; retry later", "too_many_connections")
      return
    super().connection_made(transport)
    self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_late)

  def data_received(self, data: bytes) -> None:
    if self._head_timer is None and self.conn.their_state is h11.IDLE:  # A later request's first byte.
      self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_late)
    super().data_received(data)
    self._follow_state()

  def on_response_complete(self) -> None:
    super().on_response_complete()
    if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0] and self._head_timer is None:
      self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_late)
    self._follow_state()

  def connection_lost(self, exc) -> None:
    self._cancel_timers()
    if self.flow is None:  # Refused at once (the connection cap): never counted, nothing to end.
      return
    super().connection_lost(exc)

  def _follow_state(self) -> None:
    """Stops the head's deadline once the head is in; restarts the body's pause bound while it arrives."""
    state = self.conn.their_state
    if state is not h11.IDLE and self._head_timer is not None:
      self._head_timer.cancel()
      self._head_timer = None
    if self._body_timer is not None:
      self._body_timer.cancel()
      self._body_timer = None
    if state is h11.SEND_BODY and not self.transport.is_closing():
      self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_late)

  def _cancel_timers(self) -> None:
    for t in (self._head_timer, self._body_timer):
      if t is not None:
        t.cancel()
    self._head_timer = self._body_timer = None

  def _head_late(self) -> None:
    self._head_timer = None
    if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
      logging.info("closing a connection whose request head took over %.1fs (Limits.header_timeout_s)",
                   self.limits.header_timeout_s)
      _answer_raw(self.transport, 408, "Request Timeout", f"no complete request head within "
                  f"{self.limits.header_timeout_s:g}s", "header_timeout")

  def _body_late(self) -> None:
    self._body_timer = None
    if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
      return
    if self.flow.read_paused:  # We stopped reading (the app is behind), not the client: wait on.
      self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_late)
      return
    logging.info("closing a connection whose body paused over %.1fs (Limits.body_timeout_s)",
                 self.limits.body_timeout_s)
    self.transport.close()  # The app's next read sees the client gone.


def _answer_raw(transport, status: int, reason: str, message: str, code: str) -> None:
  """Writes an error object and closes: for a connection that has no request (h11 answers only one)."""
  body = json.dumps({"error": {"message": message, "type": APIError.TYPES.get(status, "server_error"),
                               "param": None, "code": code}}).encode()
  transport.write(f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}"
                  "\r\nconnection: close\r\n\r\n".encode() + body)
  transport.close()


class Server:
  """Runs an ASGI app with uvicorn on host:port within `limits`; `start()` serves in a thread,
  `serve_forever()` in the foreground, `close()` stops; a context manager."""

  def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *, name: str = "server",
               limits: Limits = Limits()):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    self.sock = socket.socket(family, socket.SOCK_STREAM)
    self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      self.sock.bind((host, port))
    except OSError as e:
      self.sock.close()
      raise ServerConfigError(f"cannot bind {host}:{port}: {e}") from None
    self.sock.listen(2048)
    self.name, self.limits = name, limits
    protocol = type("Protocol", (_Protocol,), {"limits": limits})
    # No access log per request.
    config = uvicorn.Config(app, http=protocol, log_level="warning", access_log=False,
                            timeout_keep_alive=limits.keep_alive_s, backlog=2048, lifespan="off")
    self.uvicorn = uvicorn.Server(config)
    self._thread: threading.Thread | None = None

  @property
  def url(self) -> str:
    host, port = self.sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

  def serve_forever(self) -> None:
    asyncio.run(self.uvicorn.serve(sockets=[self.sock]))

  def start(self) -> "Server":
    self._thread = threading.Thread(target=self.serve_forever, name=self.name, daemon=True)
    self._thread.start()
    return self

  def close(self) -> None:
    self.uvicorn.should_exit = True
    if self._thread is not None:
      self._thread.join(timeout=10)
    self.sock.close()

  def __enter__(self) -> "Server":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.close()
