"""The run-wide sections (`optim`, `mesh`, `metrics`) and `Config`, every section of a run together."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from dapo_jax import metrics as metrics_lib
from dapo_jax import optim as optim_lib
from dapo_jax.errors import ConfigError
from dapo_jax.settings.model import Model, Tokenizer
from dapo_jax.settings.rl import PPO, Critic, Dapo, Eval, Rollout, Train
from dapo_jax.settings.section import Section, check
from dapo_jax.settings.supervised import DPO, RM, SFT, ChatSFT
from dapo_jax.settings.task import Data, Reward

_OPT, _WRITER = optim_lib.OptimConfig, metrics_lib.WriterConfig


@dataclasses.dataclass(frozen=True)
class Optim(Section):
  """`optim`: the policy's AdamW and its schedule (`optim.OptimConfig` documents each field)."""
  NAME = "optim"
  lr: float = _OPT.lr
  warmup_steps: int = _OPT.warmup_steps
  weight_decay: float = _OPT.weight_decay
  grad_clip: float = _OPT.grad_clip
  b1: float = _OPT.b1
  b2: float = _OPT.b2
  eps: float = _OPT.eps

  def check(self) -> None:
    self.number("lr", 0)
    self.number("warmup_steps", 0, integer=True)
    self.number("weight_decay", 0)
    self.number("grad_clip", 0, allowed=">= 0 (0 = off)")
    self.number("b1", 0, 1, hi_open=True)
    self.number("b2", 0, 1, hi_open=True)
    self.number("eps", 0, lo_open=True)

  def library(self) -> optim_lib.OptimConfig:
    return optim_lib.OptimConfig(**self.to_dict())


@dataclasses.dataclass(frozen=True)
class Mesh(Section):
  """`mesh`: the device mesh's axis sizes (-1 = the rest of the devices), and the rollout's own devices."""
  NAME = "mesh"
  data: int = 1                    # replicas of the params, each with its share of the rows
  fsdp: int = -1                   # devices that split the params and the rows (-1: the rest)
  tensor: int = 1                  # devices that split heads, MLP and vocabulary
  expert: int = 1                  # devices that split a mixture's experts (rows elsewhere)
  sequence: int = 1                # devices that split each row's tokens in the update (docs/packing.md)
  rollout_devices: int = 0         # R > 0: the first R devices decode, the rest train (docs/async.md)

  def check(self) -> None:
    self.number("rollout_devices", 0, integer=True,
                allowed="0 (rollout and training share the devices) or R >= 1 (the first R devices decode)")


@dataclasses.dataclass(frozen=True)
class Metrics(Section):
  """`metrics`: where metrics go: any of "tensorboard" (WORKDIR/tb), "jsonl" (WORKDIR/metrics.jsonl) and
  "wandb" (pip install -e ".[wandb]"; WANDB_MODE=offline writes WORKDIR/wandb for a later `wandb sync`)."""
  NAME = "metrics"
  writers: tuple[str, ...] = _WRITER.writers
  wandb_project: str = _WRITER.wandb_project
  wandb_entity: str = _WRITER.wandb_entity   # "" = the W&B account's default entity
  wandb_name: str = _WRITER.wandb_name       # "" = the workdir's name

  def check(self) -> None:
    self.library()

  def library(self) -> metrics_lib.WriterConfig:
    return metrics_lib.WriterConfig(**self.to_dict())


@dataclasses.dataclass(frozen=True)
class Config:
  """Every section of a run, typed (`configs/common.base()` is its plain values). The defaults
  are the DAPO recipe of the paper (§5.1) on a model to be chosen; configs override what differs."""
  seed: int = 0                    # data order, initial weights, sampling
  model: Model = Model()
  tokenizer: Tokenizer = Tokenizer()
  data: Data = Data()
  rollout: Rollout = Rollout()
  dapo: Dapo = Dapo()
  ppo: PPO = PPO()
  critic: Critic = Critic()
  reward: Reward = Reward()
  optim: Optim = Optim()
  train: Train = Train()
  eval: Eval = Eval()
  sft: SFT = SFT()
  chat_sft: ChatSFT = ChatSFT()
  rm: RM = RM()
  dpo: DPO = DPO()
  mesh: Mesh = Mesh()
  metrics: Metrics = Metrics()

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> "Config":
    """The typed config of plain values (section -> field -> value, e.g. a run's recorded config.json):
    each section built and checked on its own; a name that is not a setting is refused, naming it."""
    if isinstance(values, Config):
      return values
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kw = {}
    for key, value in values.items():
      if key not in fields:
        raise ConfigError(f"{key} is not a config section or setting; known: {', '.join(fields)}")
      default = fields[key].default
      if isinstance(default, Section):
        kw[key] = type(default).from_dict(value or {})
      else:
        check(isinstance(value, int) and not isinstance(value, bool), key, value, "an integer")
        kw[key] = value
    return cls(**kw)

  def to_dict(self) -> dict:
    """Plain values, section by section (what a config file starts from and config.json records)."""
    return {f.name: (v.to_dict() if isinstance(v := getattr(self, f.name), Section) else v)
            for f in dataclasses.fields(self)}
