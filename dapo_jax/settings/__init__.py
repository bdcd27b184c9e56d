"""Every setting of a run, one typed section per config section (`Config`).

A field's name is the name users type (`--config.dapo.eps_high`); its default and one-line doc sit on
the field, or on the library class field it takes its default from. `configs/common.base()` is built
from `Config().to_dict()`; the launch boundary (`dapo_jax.builders`), the only reader of a config file's
ConfigDict, turns its values back into a `Config` with `Config.from_dict`, which checks each section.
"""
from dapo_jax.settings.model import RUNTIME_FIELDS, Lora, Model, Tokenizer  # noqa: F401
from dapo_jax.settings.rl import PPO, Critic, Dapo, Eval, Rollout, RolloutCorrection, Train  # noqa: F401
from dapo_jax.settings.run import Config, Mesh, Metrics, Optim  # noqa: F401
from dapo_jax.settings.section import Section, check, number, pick  # noqa: F401
from dapo_jax.settings.supervised import DPO, RM, SFT, ChatSFT, Pairs  # noqa: F401
from dapo_jax.settings.task import SFT_TASKS, Data, Reward  # noqa: F401
