"""The policy server (the OpenAI API on the engine) and the HTTP plumbing servers share.

The plumbing (`serve.http`) is free of jax, for the reward-model server; the policy server is
imported on first use."""
from dapo_jax.serve.http import APIError, Limits, Server, ServerConfigError, check_bind, new_app


def __getattr__(name):
  if name in ("PolicyServer", "TOKEN_ENV"):
    from dapo_jax.serve import server
    return getattr(server, name)
  raise AttributeError(name)
