"""The reward-model HTTP server (FastAPI + uvicorn) and its client reward, with real servers on 127.0.0.1."""
import collections
import http.client
import http.server
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from dapo_jax import rewards, testing
from dapo_jax.serve import http as serve_http
from dapo_jax.serve import rm_server

PROMPTS = ["What is 12+30?", "What is 5+5?", "What is 1+1?"]
RESPONSES = ["2+0=2, 1+3=4. Answer: 42", "Answer: 11", "Answer: 2"]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_scores_through_the_server():
  with rm_server.RMServer(testing.arith_rm(), port=0) as server:
    client = rewards.HTTPReward(server.url, timeout_s=10)
    out = client(RESPONSES, ["", "", ""], prompts=PROMPTS)
    assert [r["score"] for r in out] == [1.0, -1.0, 1.0]
    assert [r["acc"] for r in out] == [True, False, True]
    assert client.errors == client.timeouts == 0
    with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
      assert json.loads(r.read()) == {"status": "ok"}
    # Chunks of batch_size responses give the same scores.
    assert rewards.HTTPReward(server.url, batch_size=2)(RESPONSES, [""] * 3, PROMPTS) == out


def test_concurrent_requests_are_batched_into_one_model_call():
  seen = []

  def score_fn(prompts, responses):
    seen.append(list(responses))
    return [float(len(r)) for r in responses]

  # The batch closes when max_batch responses are in (or after max_wait_ms, long here).
  with rm_server.RMServer(score_fn, port=0, max_batch=10, max_wait_ms=10_000) as server:
    results = {}

    def call(k):
      results[k] = rewards.HTTPReward(server.url, timeout_s=30)([f"r{k}", f"rr{k}"], ["", ""], ["p", "p"])

    threads = [threading.Thread(target=call, args=(k,)) for k in range(5)]
    t0 = time.time()
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    assert time.time() - t0 < 9   # It did not wait for max_wait_ms.
    assert server.batcher.calls == 1 and server.batcher.batch_sizes == [10]
    assert sorted(seen[0]) == sorted([f"r{k}" for k in range(5)] + [f"rr{k}" for k in range(5)])
    for k in range(5):  # Each request got its own scores back.
      assert [r["score"] for r in results[k]] == [len(f"r{k}"), len(f"rr{k}")]


def test_server_down_is_retried_counted_and_returns_failures():
  client = rewards.HTTPReward(f"http://127.0.0.1:{free_port()}", timeout_s=2, retries=1, backoff_s=0.01)
  out = client(RESPONSES, [""] * 3, PROMPTS)
  assert out == [rewards.FAILURE] * 3
  assert client.errors == 3 and client.timeouts == 0


def test_slow_server_times_out_and_is_counted():
  def slow(prompts, responses):
    time.sleep(1.5)
    return [1.0] * len(responses)

  with rm_server.RMServer(slow, port=0, max_wait_ms=0) as server:
    client = rewards.HTTPReward(server.url, timeout_s=0.3, retries=0)
    t0 = time.time()
    assert client(RESPONSES[:2], ["", ""], PROMPTS[:2]) == [rewards.FAILURE] * 2
    assert time.time() - t0 < 1.4
    assert client.timeouts == 2 and client.errors == 0


class Garbage(http.server.BaseHTTPRequestHandler):
  replies: list = []
  hits = 0

  def log_message(self, *a):
    pass

  def do_POST(self):
    type(self).hits += 1
    self.rfile.read(int(self.headers["Content-Length"]))
    code, body = self.replies[0]
    self.send_response(code)
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    self.wfile.write(body)


@pytest.mark.parametrize("code, body", [
    (200, b"not json"), (200, b'{"scores": [1.0]}'), (200, b'{"scores": [1.0, null]}'),
    (200, b'{"scores": [1.0, "high"]}'), (200, b'[1, 2]'), (500, b'{"error": "boom"}'),
])
def test_malformed_replies_are_retried_and_counted(code, body):
  Garbage.replies, Garbage.hits = [(code, body)], 0
  httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Garbage)
  threading.Thread(target=httpd.serve_forever, daemon=True).start()
  try:
    client = rewards.HTTPReward(f"http://127.0.0.1:{httpd.server_address[1]}", timeout_s=5, retries=2,
                                backoff_s=0.01)
    assert client(["a", "b"], ["", ""], ["p", "q"]) == [rewards.FAILURE] * 2
    assert client.errors == 2 and client.timeouts == 0 and Garbage.hits == 3
  finally:
    httpd.shutdown()
    httpd.server_close()


def test_scorer_failure_answers_500_and_the_server_lives_on(caplog):
  calls = []

  def flaky(prompts, responses):
    calls.append(1)
    if len(calls) == 1:
      raise RuntimeError("model fell over at /home/me/secret.ckpt")
    return [0.5] * len(responses)

  with rm_server.RMServer(flaky, port=0, max_wait_ms=0) as server:
    client = rewards.HTTPReward(server.url, retries=0)
    assert client(["a"], [""], ["p"]) == [rewards.FAILURE] and client.errors == 1
    assert client(["a"], [""], ["p"])[0]["score"] == 0.5
    calls.clear()
    code, body = post(server.url, {"prompts": ["p"], "responses": ["a"]})
    # The answer names an id, never the scorer's text; the log has the text under that id.
    assert code == 500 and "fell over" not in json.dumps(body) and "RuntimeError" not in json.dumps(body)
    assert body["error"]["type"] == "server_error" and body["error"]["code"] == "scorer_failed"
    (eid,) = re.findall(r"err_[0-9a-f]{12}", body["error"]["message"])
    logged = [r for r in caplog.records if eid in r.getMessage()]
    assert logged and "fell over at /home/me/secret.ckpt" in logged[0].exc_text


def test_a_request_larger_than_max_batch_is_scored_in_parts():
  """The scorer never sees more than max_batch responses, however large a request is or however
  requests arrive together; every request gets its own scores back, in order."""
  sizes, lock = [], threading.Lock()

  def score_fn(prompts, responses):
    with lock:
      sizes.append(len(responses))
    return [float(r) for r in responses]

  with rm_server.RMServer(score_fn, port=0, max_batch=64, max_wait_ms=5) as server:
    big = [str(i) for i in range(10_000)]
    results = {}

    def call(k, responses):
      results[k] = post(server.url, {"prompts": ["p"] * len(responses), "responses": responses}, timeout=60)

    asks = {"big": big, **{k: [str(k * 100 + j) for j in range(1 + k * 7)] for k in range(8)}}
    threads = [threading.Thread(target=call, args=kv) for kv in asks.items()]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
  assert max(sizes) <= 64 and sum(sizes) == sum(len(r) for r in asks.values())
  for k, responses in asks.items():
    assert results[k] == (200, {"scores": [float(r) for r in responses]}), k
  assert server.batcher.calls == len(sizes) >= 10_000 // 64


def test_a_part_that_fails_fails_its_request_and_its_other_parts_are_not_scored():
  seen = []

  def score_fn(prompts, responses):
    seen.append(list(responses))
    if "bad" in responses:
      raise ValueError("no")
    time.sleep(0.05)
    return [1.0] * len(responses)

  with rm_server.RMServer(score_fn, port=0, max_batch=4, max_wait_ms=0) as server:
    responses = ["a"] * 4 + ["bad"] + ["b"] * 40
    code, body = post(server.url, {"prompts": ["p"] * len(responses), "responses": responses})
    assert code == 500 and body["error"]["code"] == "scorer_failed"
    time.sleep(0.3)
    assert len(seen) < 12   # Not all 12 parts: those queued after the failure were dropped.
    assert post(server.url, {"prompts": ["p"], "responses": ["c"]}) == (200, {"scores": [1.0]})


def test_a_request_past_its_timeout_gets_500_and_is_not_scored_later():
  release, seen = threading.Event(), []

  def blocking(prompts, responses):
    seen.append(list(responses))
    release.wait(10)
    return [1.0] * len(responses)

  with rm_server.RMServer(blocking, port=0, max_wait_ms=0, request_timeout_s=0.3) as server:
    first = threading.Thread(target=post, args=(server.url, {"prompts": ["p"], "responses": ["a"]}))
    first.start()
    while not seen:  # "a" holds the scorer; "b" waits in the queue past its timeout.
      time.sleep(0.01)
    code, body = post(server.url, {"prompts": ["p"], "responses": ["b"]})
    assert code == 500 and "within 0.3s" in body["error"]["message"]
    release.set()
    first.join()
    assert post(server.url, {"prompts": ["p"], "responses": ["c"]}) == (200, {"scores": [1.0]})
    assert seen == [["a"], ["c"]]   # "b" gave up before its batch started: never scored.


def post(url, body, headers=None, timeout=10):
  req = urllib.request.Request(url + "/score", data=json.dumps(body).encode(),
                               headers={"Content-Type": "application/json", **(headers or {})}, method="POST")
  try:
    with urllib.request.urlopen(req, timeout=timeout) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def test_token_is_required_when_set(monkeypatch):
  monkeypatch.delenv(rm_server.TOKEN_ENV, raising=False)
  with rm_server.RMServer(testing.arith_rm(), port=0, token="s3cret") as server:
    body = {"prompts": PROMPTS[:1], "responses": RESPONSES[:1]}
    assert post(server.url, body)[0] == 401
    assert post(server.url, body, {"Authorization": "Bearer wrong"})[0] == 401
    assert post(server.url, body, {"Authorization": "Bearer s3cret"}) == (200, {"scores": [1.0]})
    # The client: without the token, counted and not retried; with it (flag or env), scored.
    client = rewards.HTTPReward(server.url, retries=3, backoff_s=5)
    t0 = time.time()
    assert client(RESPONSES[:1], [""], PROMPTS[:1]) == [rewards.FAILURE] and client.errors == 1
    assert time.time() - t0 < 4
    assert rewards.HTTPReward(server.url, token="s3cret")(RESPONSES[:1], [""], PROMPTS[:1])[0]["score"] == 1.0
    monkeypatch.setenv(rm_server.TOKEN_ENV, "s3cret")
    assert rewards.HTTPReward(server.url)(RESPONSES[:1], [""], PROMPTS[:1])[0]["score"] == 1.0


def raw(url, method, path, body=b"", headers=None):
  host, port = url.removeprefix("http://").rsplit(":", 1)
  conn = http.client.HTTPConnection(host, int(port), timeout=10)
  try:
    conn.request(method, path, body, headers or {})
    r = conn.getresponse()
    return r.status, json.loads(r.read())
  finally:
    conn.close()


def test_bad_requests_get_400_as_error_objects():
  with rm_server.RMServer(testing.arith_rm(), port=0) as server:
    code, body = post(server.url, {"prompts": ["a"]})
    assert code == 400 and body["error"]["param"] == "responses" and body["error"]["type"] == "invalid_request_error"
    code, body = post(server.url, {"prompts": ["a"], "responses": ["b", "c"]})
    assert code == 400 and "1 prompts for 2 responses" in body["error"]["message"]
    code, body = post(server.url, {"prompts": [1], "responses": ["b"]})
    assert code == 400 and body["error"]["param"] == "prompts.0"
    assert raw(server.url, "POST", "/score", b"not json")[0] == 400
    assert raw(server.url, "POST", "/score", b"[1, 2]")[0] == 400
    assert post(server.url, {"prompts": [], "responses": []}) == (200, {"scores": []})
    # Any Content-Type is taken, as before.
    assert raw(server.url, "POST", "/score", json.dumps({"prompts": ["What is 1+1?"], "responses": ["Answer: 2"]}),
               {"Content-Type": "text/plain"}) == (200, {"scores": [1.0]})
    # The server serves the next request.
    assert post(server.url, {"prompts": PROMPTS, "responses": RESPONSES}) == (200, {"scores": [1.0, -1.0, 1.0]})


def test_unknown_routes_404_too_large_413_non_finite_null():
  with rm_server.RMServer(lambda p, r: [math.nan, math.inf, 0.25][:len(r)], port=0) as server:
    code, body = raw(server.url, "GET", "/nope")
    assert code == 404 and body["error"]["type"] == "not_found_error"
    assert raw(server.url, "POST", "/v1/score", b"{}")[0] == 404
    # The body cap answers from the Content-Length header, before a byte of the body is read.
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.putrequest("POST", "/score")
    conn.putheader("Content-Length", str(rm_server.MAX_BODY_BYTES + 1))
    conn.endheaders()
    r = conn.getresponse()
    assert r.status == 413 and "exceeds" in json.loads(r.read())["error"]["message"]
    conn.close()
    body = {"prompts": ["p"] * 3, "responses": ["a", "b", "c"]}
    assert post(server.url, body) == (200, {"scores": [None, None, 0.25]})
    # The client counts a non-finite score as a malformed reply.
    client = rewards.HTTPReward(server.url, retries=0)
    assert client(["a"], [""], ["p"]) == [rewards.FAILURE] and client.errors == 1


def test_32_concurrent_clients_x_40_requests_all_answered():
  # The standard-library server reset some of these connections (its listen backlog was 5). Every
  # request is distinct (its own sums, right and wrong answers, 1-3 of them), so an answer sent to
  # the wrong client, or scores shuffled inside a batch, shows.
  failures, answered, lock = collections.Counter(), [0], threading.Lock()
  reference = testing.arith_rm()

  with rm_server.RMServer(testing.arith_rm(), port=0, max_wait_ms=2) as server:
    def client(k):
      for i in range(40):  # A new connection per request (urllib), the case that reset.
        n = 1 + (k + i) % 3
        prompts = [f"What is {k}+{i * 3 + j}?" for j in range(n)]
        responses = [f"Answer: {k + i * 3 + j + (j + i) % 2}" for j in range(n)]
        body = json.dumps({"prompts": prompts, "responses": responses}).encode()
        req = urllib.request.Request(server.url + "/score", data=body, headers={"Content-Type": "application/json"})
        try:
          with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read()) == {"scores": reference(prompts, responses)}
          with lock:
            answered[0] += 1
        except Exception as e:  # Counted, so the assertion below says what went wrong.
          with lock:
            failures[f"{type(e).__name__}: {e}"] += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(32)]
    t0 = time.time()
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    assert (answered[0], dict(failures)) == (32 * 40, {})
    assert time.time() - t0 < 20
    assert max(server.batcher.batch_sizes) > 1   # Requests in flight together were scored together.


def test_non_local_bind_needs_a_token(monkeypatch):
  monkeypatch.delenv(rm_server.TOKEN_ENV, raising=False)
  with pytest.raises(rm_server.ServerConfigError, match="refusing to serve on '0.0.0.0' without a token"):
    rm_server.RMServer(testing.arith_rm(), host="0.0.0.0", port=0)
  monkeypatch.setenv(rm_server.TOKEN_ENV, "t")
  server = rm_server.RMServer(testing.arith_rm(), host="0.0.0.0", port=0).start()
  assert server.token == "t"
  body = {"prompts": PROMPTS[:1], "responses": RESPONSES[:1]}  # Served on every address, with the token only.
  assert post(server.url, body)[0] == 401
  assert post(server.url, body, {"Authorization": "Bearer t"}) == (200, {"scores": [1.0]})
  # A taken port is refused too; the error is both a reward and a server configuration error.
  with pytest.raises(rm_server.ServerConfigError, match="cannot bind") as e:
    rm_server.RMServer(testing.arith_rm(), host="0.0.0.0", port=int(server.url.rsplit(":", 1)[1]))
  assert isinstance(e.value, rewards.RewardConfigError) and isinstance(e.value, serve_http.ServerConfigError)
  server.close()


def test_the_rewards_face_and_the_server_import_no_jax():
  code = "import sys, dapo_jax.rewards, dapo_jax.serve.rm_server; assert 'jax' not in sys.modules, 'jax imported'"
  subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_launch_serve_rm_process_and_training_going_on_after_it_stops():
  env = {**os.environ, "DAPO_RM_TOKEN": ""}
  proc = subprocess.Popen([sys.executable, "-m", "launch.serve_rm", "--scorer=dapo_jax.testing:arith_rm",
                           "--port=0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  try:
    line = proc.stdout.readline()
    assert " on http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
    url = line.split(" on ")[1].split()[0]
    client = rewards.HTTPReward(url, timeout_s=10, retries=1, backoff_s=0.01)
    assert [r["score"] for r in client(RESPONSES, [""] * 3, PROMPTS)] == [1.0, -1.0, 1.0]
    port = url.rsplit(":", 1)[1]  # Taken: a second server says so in one line.
    res = subprocess.run([sys.executable, "-m", "launch.serve_rm", "--scorer=dapo_jax.testing:arith_rm",
                          f"--port={port}"], capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 1 and res.stderr.strip().splitlines()[-1].startswith(
        f"error: cannot bind 127.0.0.1:{port}: [Errno 98]"), res.stderr[-2000:]
  finally:
    proc.kill()
    proc.wait()
  assert client(RESPONSES, [""] * 3, PROMPTS) == [rewards.FAILURE] * 3 and client.errors == 3
  # A public address without a token is refused in one line.
  res = subprocess.run([sys.executable, "-m", "launch.serve_rm", "--scorer=dapo_jax.testing:arith_rm",
                        "--host=0.0.0.0", "--port=0"], capture_output=True, text=True, timeout=60, env=env)
  assert res.returncode == 1 and res.stderr.strip().startswith("error: refusing to serve on '0.0.0.0'")


def test_combine_and_weights():
  rm = [{"score": 0.8, "acc": True, "pred": "0.8"}, {"score": -0.2, "acc": False, "pred": "-0.2"}]
  rule = [{"score": -1.0, "acc": False, "pred": "7"}, {"score": 1.0, "acc": True, "pred": "9"}]
  out = rewards.combine([rm, rule], [0.5, 2.0], acc_from=1)
  assert out == [{"score": 0.4 - 2.0, "acc": False, "pred": "7"}, {"score": -0.1 + 2.0, "acc": True, "pred": "9"}]
  with pytest.raises(ValueError, match="2 reward results for 1 weights"):
    rewards.combine([rm, rule], [1.0])
  assert rewards.parse_weighted(["0.5*http://127.0.0.1:8000", "dapo_jax.rewards:math_dapo"]) == [
      ("http://127.0.0.1:8000", 0.5), ("dapo_jax.rewards:math_dapo", 1.0)]
  with pytest.raises(rewards.RewardConfigError, match="WEIGHT"):
    rewards.parse_weighted(["x*http://a"])


def test_combined_reward_rm_plus_rule_check():
  with rm_server.RMServer(testing.arith_rm(), port=0) as server:
    combined = rewards.CombinedReward([(server.url, 0.5), ("dapo_jax.rewards:math_dapo", 1.0)], timeout_s=30,
                                      workers=1)
    try:
      # The rule check's ground truths are wrong on purpose for sample 0, so the parts disagree.
      out = combined(RESPONSES, ["41", "11", "2"], PROMPTS)
    finally:
      combined.close()
    assert [r["score"] for r in out] == [0.5 - 1.0, -0.5 + 1.0, 0.5 + 1.0]
    assert [r["acc"] for r in out] == [False, True, True]   # acc from the rule check
    assert combined.errors == combined.timeouts == 0
