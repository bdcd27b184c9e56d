"""A `python` tool: the policy's code runs in the sandbox; the tool result is its output.

    rollout.env_args = '{"tools": ["dapo_jax.envs.python_tool:python_tool"], ...}'

Each call is a fresh sandbox (`dapo_jax.envs.sandbox`): nothing persists between calls. The result
shows stdout, the tail of stderr and how the program ended, cut to `max_chars`.
"""
from __future__ import annotations

from dapo_jax.envs import base, sandbox

TOOL_LIMITS = sandbox.Limits(cpu_s=5, wall_s=10, memory_mb=512, processes=16, output_bytes=16384)
MAX_CODE_CHARS = 20_000


def _cut(text: str, max_chars: int, keep: str = "head") -> str:
  if len(text) <= max_chars:
    return text
  return (text[:max_chars] + "\n[... cut]") if keep == "head" else ("[cut ...]\n" + text[-max_chars:])


def format_result(result: sandbox.Result, max_chars: int = 2000) -> str:
  """What the policy sees: stdout (its head), stderr (its tail, where the traceback ends), the ending."""
  parts = [_cut(result.stdout, max_chars)] if result.stdout else []
  if result.stderr:
    parts.append("stderr:\n" + _cut(result.stderr, max_chars // 2, keep="tail"))
  if result.timed_out:
    parts.append("[timed out]")
  elif result.killed_by_signal:
    parts.append(f"[killed by signal {result.killed_by_signal}]")
  elif result.exit_code:
    parts.append(f"[exit status {result.exit_code}]")
  if result.truncated:
    parts.append("[output truncated]")
  return "\n".join(p.rstrip("\n") for p in parts) or "[no output]"


def python_tool(limits: sandbox.Limits = TOOL_LIMITS, max_chars: int = 2000) -> base.Tool:
  """The `python` tool: {"code": str} -> the program's output, run in a fresh sandbox."""

  def run_code(code: str) -> str:
    if not isinstance(code, str):
      return "error: 'code' must be a string"
    if len(code) > MAX_CODE_CHARS:
      return f"error: the code has {len(code)} characters; the limit is {MAX_CODE_CHARS}"
    return format_result(sandbox.run_python(code, limits=limits), max_chars)

  return base.Tool(
      name="python",
      description=("Runs a Python 3 program in a fresh sandbox (no network, no files kept between calls, "
                   f"{limits.cpu_s:g} s of CPU) and returns what it prints. Use print() to see values."),
      parameters={"type": "object",
                  "properties": {"code": {"type": "string", "description": "the whole program"}},
                  "required": ["code"]},
      fn=run_code)
