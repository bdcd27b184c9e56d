"""What every server here shares (`serve/http.py`), on a real uvicorn server on 127.0.0.1 driven by
raw sockets: bodies capped as they arrive (a chunked body declares no length), a client that goes
away mid-body or mid-answer, the work of an abandoned whole answer cancelled, half-sent requests
closed at their deadline, connections past the cap refused, and 500s that name an id."""
import asyncio
import json
import logging
import re
import select
import socket
import threading
import time

import fastapi

from dapo_jax.serve import http


def chunked_post(port: int, path: str, chunks: list[bytes], close_after: int | None = None) -> bytes:
  """POSTs `chunks` with Transfer-Encoding: chunked; closes after `close_after` chunks (None: reads the answer)."""
  s = socket.create_connection(("127.0.0.1", port), timeout=10)
  try:
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              "Transfer-Encoding: chunked\r\n\r\n".encode())
    for i, c in enumerate(chunks):
      if close_after is not None and i == close_after:
        return b""
      s.sendall(f"{len(c):x}\r\n".encode() + c + b"\r\n")
    s.sendall(b"0\r\n\r\n")
    out = b""
    while b"\r\n\r\n" not in out or not out.rstrip().endswith(b"}"):
      data = s.recv(65536)
      if not data:
        break
      out += data
    return out
  finally:
    s.close()


def status(answer: bytes) -> int:
  return int(answer.split(b" ", 2)[1])


class App:
  """An app of `http.new_app` whose /echo answers the length of the body it read and whose /wait
  runs until cancelled (through `until_disconnected`), recording that it was."""

  def __init__(self, max_body_bytes: int):
    self.app = http.new_app("test", token=None, max_body_bytes=max_body_bytes)
    self.started, self.cancelled = threading.Event(), threading.Event()

    @self.app.post("/echo")
    async def echo(request: fastapi.Request):
      return {"bytes": len(await request.body())}

    @self.app.post("/wait")
    async def wait(request: fastapi.Request):
      async def forever():
        self.started.set()
        try:
          await asyncio.sleep(3600)
        except asyncio.CancelledError:
          self.cancelled.set()
          raise
      return await http.until_disconnected(request, forever())


def test_a_chunked_body_past_the_cap_is_413_and_the_server_serves_on(caplog):
  app = App(max_body_bytes=1000)
  with http.Server(app.app, port=0) as server:
    port = int(server.url.rsplit(":", 1)[1])
    assert json.loads(chunked_post(port, "/echo", [b"x" * 400, b"y" * 400]).split(b"\r\n\r\n", 1)[1]) == {"bytes": 800}
    answer = chunked_post(port, "/echo", [b"x" * 600] * 100)
    assert status(answer) == 413 and b"request body exceeds 1000 bytes" in answer
    assert json.loads(chunked_post(port, "/echo", [b"z" * 10]).split(b"\r\n\r\n", 1)[1]) == {"bytes": 10}


def test_a_client_gone_mid_body_is_no_server_error_and_the_next_is_served(caplog):
  app = App(max_body_bytes=1 << 20)
  with caplog.at_level(logging.INFO), http.Server(app.app, port=0) as server:
    port = int(server.url.rsplit(":", 1)[1])
    chunked_post(port, "/echo", [b"x" * 100] * 5, close_after=2)
    time.sleep(0.3)
    assert json.loads(chunked_post(port, "/echo", [b"z" * 10]).split(b"\r\n\r\n", 1)[1]) == {"bytes": 10}
  assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_the_work_of_a_whole_answer_is_cancelled_when_its_client_goes_away():
  app = App(max_body_bytes=1 << 20)
  with http.Server(app.app, port=0) as server:
    port = int(server.url.rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /wait HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    assert app.started.wait(10)
    s.close()
    assert app.cancelled.wait(5)  # Not an hour later.
    assert json.loads(chunked_post(port, "/echo", [b"z"]).split(b"\r\n\r\n", 1)[1]) == {"bytes": 1}


def open_stalled(port: int, count: int, head: bytes) -> list[socket.socket]:
  """`count` connections that each send `head` (part of a request) and then nothing."""
  socks = []
  for _ in range(count):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(head)
    socks.append(s)
  return socks


def wait_closed(socks: list[socket.socket], within_s: float) -> tuple[list[bytes], int]:
  """What each connection got before the server closed it, and how many are still open after `within_s`."""
  got = {s: b"" for s in socks}
  open_ = set(socks)
  deadline = time.monotonic() + within_s
  for s in socks:
    s.setblocking(False)
  while open_ and time.monotonic() < deadline:
    ready, _, _ = select.select(list(open_), [], [], 0.2)
    for s in ready:
      try:
        data = s.recv(4096)
      except ConnectionResetError:
        data = b""
      got[s] += data
      if not data:
        open_.discard(s)
  return [got[s] for s in socks], len(open_)


def health(port: int) -> float:
  """Seconds /health took to answer 200."""
  t0 = time.monotonic()
  with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    reply = b""
    while data := s.recv(4096):
      reply += data
  assert status(reply) == 200, reply
  return time.monotonic() - t0


def test_half_sent_requests_are_closed_at_the_header_timeout_and_health_answers_meanwhile():
  """300 connections each send part of a request's head and stall (and 3 more trickle a byte every
  0.2 s, which does not extend the deadline): all are closed with a 408 after `header_timeout_s`,
  /health answers meanwhile, and the server serves on."""
  app = App(max_body_bytes=1 << 20)
  limits = http.Limits(header_timeout_s=1.0, max_connections=400)
  with http.Server(app.app, port=0, limits=limits) as server:
    port = int(server.url.rsplit(":", 1)[1])
    t0 = time.monotonic()
    halves = [b"POST /ec", b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Le"]
    socks = open_stalled(port, 150, halves[0]) + open_stalled(port, 150, halves[1])
    trickled = open_stalled(port, 3, b"GET /health HTTP/1.1\r\n")
    assert health(port) < 1.0                 # Served beside them.
    for _ in range(8):                        # 1.6 s of a byte every 0.2 s: past the deadline.
      time.sleep(0.2)
      for s in trickled:
        try:
          s.sendall(b"X")
        except OSError:                       # Closed already.
          pass
    replies, still_open = wait_closed(socks + trickled, within_s=10)
    assert still_open == 0 and time.monotonic() - t0 < 12
    assert all(r.startswith(b"HTTP/1.1 408") and b"header_timeout" in r for r in replies), set(replies)
    assert json.loads(chunked_post(port, "/echo", [b"z"]).split(b"\r\n\r\n", 1)[1]) == {"bytes": 1}


def test_connections_past_the_cap_get_503_and_a_stalled_body_is_closed():
  app = App(max_body_bytes=1 << 20)
  limits = http.Limits(max_connections=20, header_timeout_s=30, body_timeout_s=1.0)
  with http.Server(app.app, port=0, limits=limits) as server:
    port = int(server.url.rsplit(":", 1)[1])
    held = open_stalled(port, 20, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
    time.sleep(0.2)
    refused = open_stalled(port, 1, b"")
    replies, still_open = wait_closed(refused, within_s=5)
    assert still_open == 0 and status(replies[0]) == 503 and b"too_many_connections" in replies[0]
    replies, still_open = wait_closed(held, within_s=10)  # Their bodies paused past body_timeout_s.
    assert still_open == 0
    assert json.loads(chunked_post(port, "/echo", [b"z"]).split(b"\r\n\r\n", 1)[1]) == {"bytes": 1}


def test_a_500_names_an_id_and_not_the_exceptions_text(caplog):
  app = App(max_body_bytes=1 << 20)

  @app.app.get("/fail")
  async def fail():
    raise RuntimeError("secret=hunter2 at /home/me/data")

  with caplog.at_level(logging.ERROR), http.Server(app.app, port=0) as server:
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
      s.sendall(b"GET /fail HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
      reply = b""
      while data := s.recv(4096):
        reply += data
  assert status(reply) == 500
  err = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
  assert "hunter2" not in json.dumps(err) and "RuntimeError" not in json.dumps(err)
  (eid,) = re.findall(r"err_[0-9a-f]{12}", err["message"])
  logged = [r for r in caplog.records if eid in r.getMessage()]
  assert logged and "hunter2" in logged[0].exc_text
