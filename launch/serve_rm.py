"""Serve a reward model over HTTP, for `reward.fn=http://HOST:PORT` in training runs on other hosts.

  python -m launch.serve_rm --model_dir=runs/rm/rm_model --port=8000
  DAPO_RM_TOKEN=secret python -m launch.serve_rm --model_dir=DIR --host=0.0.0.0 --port=8000
POST /score {"prompts": [...], "responses": [...]} -> {"scores": [...]}; GET /health. Only 127.0.0.1
is served without a token; requests then carry `Authorization: Bearer <token>`. FastAPI + uvicorn
(`pip install -e ".[serve]"`), as the policy server (`launch.serve`).
"""
from absl import flags

from . import common

_MODEL_DIR = flags.DEFINE_string("model_dir", None, "Reward-model directory (passed to the scorer factory).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to bind; anything but localhost needs a token.")
_PORT = flags.DEFINE_integer("port", 8000, "Port (0: any free one; the URL is printed).")
_TOKEN = flags.DEFINE_string("token", None, "Shared token (default: env DAPO_RM_TOKEN).")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 64, "Most responses scored in one model call.")
_MAX_WAIT_MS = flags.DEFINE_float("max_wait_ms", 10.0, "How long a batch waits for more requests.")
# What clients may hold of the server; unset, serve.http.Limits' defaults.
_MAX_CONNECTIONS = flags.DEFINE_integer("max_connections", None, "Connections open at once (http.Limits).")
_HEADER_TIMEOUT_S = flags.DEFINE_float("header_timeout_s", None, "Seconds to send a request's head (http.Limits).")
_BODY_TIMEOUT_S = flags.DEFINE_float("body_timeout_s", None, "Longest pause inside a request body (http.Limits).")
_SCORER = flags.DEFINE_string("scorer", "dapo_jax.rewards.model:scorer",
                              "'module:factory'; factory(model_dir) returns score_fn(prompts, responses).")


def main(argv):
  del argv
  import os  # noqa: PLC0415

  from dapo_jax.serve import http, rm_server
  try:  # Before the scorer loads its model: a public address without a token, a taken port.
    http.check_bind(_HOST.value, _TOKEN.value or os.environ.get(rm_server.TOKEN_ENV), rm_server.TOKEN_ENV)
  except http.ServerConfigError as e:
    raise rm_server.ServerConfigError(str(e)) from None
  http.check_port(_HOST.value, _PORT.value)
  score_fn = rm_server.load_scorer(_SCORER.value, _MODEL_DIR.value)
  limits = http.limits(max_connections=_MAX_CONNECTIONS.value, header_timeout_s=_HEADER_TIMEOUT_S.value,
                       body_timeout_s=_BODY_TIMEOUT_S.value)
  server = rm_server.RMServer(score_fn, _HOST.value, _PORT.value, _TOKEN.value, _MAX_BATCH.value,
                              _MAX_WAIT_MS.value, limits=limits)
  print(f"serving {_MODEL_DIR.value or _SCORER.value} on {server.url} (POST /score)", flush=True)
  common.serve_until_interrupted(server)


if __name__ == "__main__":
  common.run(main)
