"""The launch boundary: the only code that reads a ConfigDict. It turns one into a typed
`settings.Config` (each section checked), checks what spans sections (`checks`), and builds what a run
needs from it, module by module in data-flow order: `task` (datasets, prompts, episodes, the reward) <
`model` (tokenizer, architecture, initial weights incl. the SFT warm start, restore) < `rl` (the DAPO
run) and `pipelines` (SFT, RM, DPO); `record` is the run's record in its workdir.

The default job is self-contained: with no paths set it trains its own tokenizer on the task's text,
initialises a small model and warm-starts it with SFT (the result is saved in the workdir and reused
by later runs).
"""
from dapo_jax.builders.checks import (  # noqa: F401
  ConfigError,
  as_config,
  check,
  dataset_files,
  number,
  typed,
  validate,
  validate_pairs,
)
from dapo_jax.builders.model import (  # noqa: F401
  bf16_cpu_warning,
  chat_tokenizer,
  gguf_model_dir,
  initial_model,
  lora_config,
  model_config,
  model_dir,
  padded_vocab,
  restore_policy,
  runtime_overrides,
  served_policy,
  sft_config,
  tokenizer,
  trained_model,
  trainer,
  warm_start,
)
from dapo_jax.builders.pipelines import chat_sft_config, dpo_config, dpo_evaluator, rm_config, run_sft  # noqa: F401
from dapo_jax.builders.record import (  # noqa: F401
  COMMAND_FILE,
  CONFIG_FILE,
  PIPELINE_RESUME_FIELDS,
  RESUME_FIELDS,
  load_run_config,
  save_pipeline_config,
  save_run_config,
)
from dapo_jax.builders.rl import (  # noqa: F401
  critic,
  dapo,
  dump_rollouts_every,
  eval_sampler_config,
  evaluator,
  kl_controller,
  kl_in_reward,
  loop_config,
  pg_config,
  rollout_config,
  run,
  sampler_config,
  teacher,
)
from dapo_jax.builders.task import (  # noqa: F401
  completion_len,
  conversation_data,
  data_iterator,
  datasets,
  episodes,
  preference_data,
  reward,
  row_check,
  turn_stop_ids,
  user_prompt,
  user_prompt_messages,
)
