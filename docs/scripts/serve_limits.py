"""What a costly or stalling client does to the servers (docs/serving.md, "Limits"): /health's
slowest answer while a 4 MB chat prompt is rendered and tokenised; the log-probs of a sample cut by
a stop string at 1k, 2k and 4k tokens; how long 300 connections that send half a request head and
stall stay open (the RM server, default limits). The test tokenizer (a 300-token BPE) and a tiny
random model. Run from the repository root (about a minute on 2 CPU cores):

  python docs/scripts/serve_limits.py
"""
import inspect
import json
import os
import select
import socket
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.getcwd())


def logprob_seconds(tok, eos) -> None:
  import numpy as np

  from dapo_jax import testing
  from dapo_jax.serve import openai_api
  words = " ".join(testing.corpus())
  end = tok(" STOP here", add_special_tokens=False)["input_ids"]
  for n in (1000, 2000, 4000):
    tokens = np.asarray(tok(words * 4, add_special_tokens=False)["input_ids"][:n - len(end)] + end, np.int32)
    sample = openai_api.SampleText(tok, ["STOP"], eos)
    sample.update(tokens, np.zeros(n, np.float32))
    times = []
    for _ in range(3):
      t0 = time.perf_counter()
      sample.token_logprobs()
      times.append(time.perf_counter() - t0)
    print(json.dumps({"logprobs_with_a_stop_string_tokens": n, "seconds": round(statistics.median(times), 4)}))


def health_beside_a_4mb_prompt(tok, eos) -> None:
  import httpx
  import jax

  from dapo_jax import testing
  from dapo_jax.model import transformer
  from dapo_jax.serve import http
  from dapo_jax.serve import server as server_lib
  cfg = testing.tiny_model_config(vocab_size=len(tok), embed_dim=64, mlp_dim=128)
  params = transformer.init_params(cfg, jax.random.key(0))
  takes_limits = "limits" in inspect.signature(server_lib.PolicyServer).parameters
  kw = {"limits": http.Limits(max_prompt_chars=8 << 20)} if takes_limits else {}
  with server_lib.PolicyServer(cfg, params, tok, eos_ids=eos, slots=2, max_prompt_len=64, max_new_tokens=8,
                               **kw) as server:
    big = ("What is 12 + 5? " * (1 << 18))[:4 << 20]
    out = {}

    def post():
      t0 = time.monotonic()
      r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": big}]},
                     timeout=600)
      out["status"], out["seconds"] = r.status_code, time.monotonic() - t0

    worker = threading.Thread(target=post)
    worker.start()
    time.sleep(0.2)
    waits = []
    while worker.is_alive():
      t0 = time.monotonic()
      httpx.get(server.url + "/health", timeout=600)
      waits.append(time.monotonic() - t0)
      time.sleep(0.05)
    worker.join()
    print(json.dumps({"4mb_request_seconds": round(out["seconds"], 2), "its_status": out["status"],
                      "health_calls": len(waits), "health_slowest_s": round(max(waits), 3),
                      "health_median_s": round(statistics.median(waits), 4)}))


def half_open_connections() -> None:
  from dapo_jax.serve import rm_server
  with rm_server.RMServer(lambda prompts, responses: [0.0] * len(responses), port=0) as server:
    port = int(server.url.rsplit(":", 1)[1])
    socks = []
    for _ in range(300):
      s = socket.create_connection(("127.0.0.1", port))
      s.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Le")
      socks.append(s)
    t0, still_open, closed_at = time.monotonic(), set(socks), []
    while still_open and time.monotonic() - t0 < 20:
      for s in select.select(list(still_open), [], [], 0.2)[0]:
        while s.recv(4096):
          pass
        still_open.discard(s)
        closed_at.append(time.monotonic() - t0)
    print(json.dumps({"half_open_connections": 300, "open_after_20s": len(still_open),
                      "all_closed_at_s": round(max(closed_at), 2) if not still_open else None}))
    for s in socks:
      s.close()


def main():
  from dapo_jax import testing
  from dapo_jax.data import tokenizer as tokenizer_lib
  tok = tokenizer_lib.train_bpe(tempfile.mkdtemp(), testing.corpus(), vocab_size=300,
                                chat_template=tokenizer_lib.CHATML_TOOLS_TEMPLATE)
  eos = tokenizer_lib.eos_ids(tok)
  logprob_seconds(tok, eos)
  health_beside_a_4mb_prompt(tok, eos)
  half_open_connections()


if __name__ == "__main__":
  main()
