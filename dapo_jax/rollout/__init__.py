"""Prompts -> scored, filtered groups: `Rollout` (the public way to sample), the continuous-batching
`Engine` on the jitted prefill/decode of `sampling`, and dynamic sampling (`stream_groups` through
the engine; `fill_batch`, the reference's whole generation batches)."""
from dapo_jax.rollout.dynamic_sampling import DynamicSamplingCapError, FillStats, fill_batch, keep_groups, stream_groups
from dapo_jax.rollout.engine import Engine
from dapo_jax.rollout.rollout import FILTER_METRICS, Rollout, RolloutConfig, filter_values
from dapo_jax.rollout.sampling import SamplerConfig, Samples
