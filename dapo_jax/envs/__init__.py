"""Environments and tools: the Env interface (`base`), tool-call formats per chat template, the
sandbox, and built-in tasks. Free of jax (environments run in worker threads beside the engine)."""
from dapo_jax.envs.base import Env, StepResult, Tool, ToolCall
