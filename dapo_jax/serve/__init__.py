"""The policy server (the OpenAI API on the engine) and the HTTP plumbing servers share."""
from dapo_jax.serve.http import APIError, Server, ServerConfigError, check_bind, new_app
from dapo_jax.serve.server import TOKEN_ENV, PolicyServer
