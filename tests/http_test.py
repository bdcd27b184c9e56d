"""What every server here shares (`serve/http.py`), on a real uvicorn server on 127.0.0.1 driven by
raw sockets: bodies capped as they arrive (a chunked body declares no length), a client that goes
away mid-body or mid-answer, and the work of an abandoned whole answer cancelled."""
import asyncio
import json
import logging
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
