"""Environments and tools: the Env interface (`base`), tool-call formats per chat template
(`tool_formats`), the tool environment and its calculator (`tool_env`), games, built-in tasks, and
the text an observation adds to an episode (`render`). Free of jax: environments run in worker
threads beside the engine."""
from dapo_jax.envs.base import Env, StepResult, Tool, ToolCall, resolve
from dapo_jax.envs.games import GuessNumberEnv, guess_number_examples
from dapo_jax.envs.tool_env import ToolEnv, calculate, calculator_tool
from dapo_jax.envs.tool_formats import ToolCallError, detect, parse_tool_calls, render_tool_calls
