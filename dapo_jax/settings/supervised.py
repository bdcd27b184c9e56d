"""The supervised sections: `sft` (the arithmetic warm start, and the steps of `launch.sft`), `chat_sft`
(SFT on conversation files) and the preference-pair trainings `rm` and `dpo`."""
from __future__ import annotations

import dataclasses

from dapo_jax import loss as loss_lib
from dapo_jax.pipelines import pairs, sft, sft_chat
from dapo_jax.pipelines.dpo import DPOTrainConfig
from dapo_jax.pipelines.rm import RMConfig
from dapo_jax.settings.section import Section, check

_SFT, _CHAT, _PAIRS = sft.SFTConfig, sft_chat.ChatSFTConfig, pairs.PairTrainConfig


@dataclasses.dataclass(frozen=True)
class SFT(Section):
  """`sft`: the SFT warm start of model.init="sft" (and the steps, sizes and lr of `launch.sft`)."""
  NAME = "sft"
  steps: int = 0                   # updates (0 = none)
  batch_size: int = _SFT.batch_size
  seq_len: int = _SFT.seq_len      # tokens per packed row
  lr: float = _SFT.lr
  warmup_steps: int = _SFT.warmup_steps
  num_examples: int = _SFT.num_examples
  target_acc: float = _SFT.target_acc      # > 0: stop once greedy solves this fraction of a probe
  probe_size: int = _SFT.probe_size        # training problems in that probe
  probe_every: int = _SFT.probe_every      # steps between probes
  completion_only: bool = _SFT.completion_only   # loss on the solution's tokens only
  train_vision: bool = _SFT.train_vision   # a vision-language model: the warm start trains its tower too
  ckpt_every: int = _SFT.ckpt_every        # updates between checkpoints in WORKDIR/sft (a rerun resumes)
  keep_ckpts: int = _SFT.keep_ckpts

  def check(self) -> None:
    for f in ("steps", "warmup_steps"):
      self.number(f, 0, integer=True)
    for f in ("batch_size", "seq_len", "num_examples", "probe_size", "probe_every", "keep_ckpts"):
      self.number(f, 1, integer=True)
    self.number("lr", 0)
    self.number("target_acc", 0, 1)


@dataclasses.dataclass(frozen=True)
class ChatSFT(Section):
  """`chat_sft`: SFT on conversation files (`launch.sft` with data.task="file"; steps, sizes, lr from `sft`)."""
  NAME = "chat_sft"
  assistant_only: bool = _CHAT.assistant_only   # loss on assistant turns only (False: every token)
  packing: bool = _CHAT.packing                 # several conversations per sft.seq_len row
  heldout_fraction: float = 0.05                # conversations held out for the loss (by prompt hash)
  eval_every: int = _CHAT.eval_every            # updates between held-out losses

  def check(self) -> None:
    self.number("heldout_fraction", 0, 1, hi_open=True)
    self.number("eval_every", 0, integer=True)


@dataclasses.dataclass(frozen=True)
class Pairs(Section):
  """What `rm` and `dpo` share: TRL-schema preference files, the starting HF directory, the optimisation."""
  train_files: tuple[str, ...] = ("",)   # TRL-schema preference files (prompt, chosen, rejected)
  eval_files: tuple[str, ...] = ("",)    # held-out pairs
  init_dir: str = ""               # HF directory of the starting (SFT) policy
  steps: int = _PAIRS.steps
  batch_pairs: int = _PAIRS.batch_pairs
  lr: float = _PAIRS.lr
  warmup_steps: int = _PAIRS.warmup_steps
  weight_decay: float = _PAIRS.weight_decay
  grad_clip: float = _PAIRS.grad_clip
  prompt_len: int = _PAIRS.prompt_len      # tokens; longer prompts keep their end
  response_len: int = _PAIRS.response_len  # tokens with EOS; longer responses keep their start
  eval_every: int = _PAIRS.eval_every
  ckpt_every: int = _PAIRS.ckpt_every
  keep_ckpts: int = _PAIRS.keep_ckpts

  def check(self) -> None:
    """Only what a config may hold before a pair training is chosen; `launch.rm|dpo` check the rest."""
    for f in ("steps", "batch_pairs", "prompt_len", "response_len", "keep_ckpts"):
      self.number(f, 1, integer=True)
    for f in ("warmup_steps", "eval_every", "ckpt_every"):
      self.number(f, 0, integer=True)
    for f in ("lr", "weight_decay", "grad_clip"):
      self.number(f, 0)

  def check_runnable(self) -> None:
    """What a pair training needs to start: files and a starting model."""
    files = [f for f in self.train_files if f]
    check(bool(files), f"{self.NAME}.train_files", self.train_files, "at least one dataset file")
    check(bool(self.init_dir), f"{self.NAME}.init_dir", self.init_dir,
          "the HF directory of the starting model (e.g. the SFT model of launch.sft)")


@dataclasses.dataclass(frozen=True)
class RM(Pairs):
  """`rm`: a reward model trained on preference pairs (`launch.rm`)."""
  NAME = "rm"
  margin: float = RMConfig.margin  # -log σ(r_c - r_r - margin)

  def check(self) -> None:
    super().check()
    self.number("margin", 0)


@dataclasses.dataclass(frozen=True)
class DPO(Pairs):
  """`dpo`: DPO on preference pairs (`launch.dpo`)."""
  NAME = "dpo"
  beta: float = DPOTrainConfig.beta              # β of the implicit reward β·(log π - log π_ref)
  loss_type: str = DPOTrainConfig.loss_type      # sigmoid (DPO) | ipo
  label_smoothing: float = DPOTrainConfig.label_smoothing
  rpo_alpha: float = DPOTrainConfig.rpo_alpha    # RPO: + rpo_alpha * NLL of the chosen responses
  eval_greedy: int = 64            # held-out prompts whose greedy answers are rule-checked
  max_new_tokens: int = 32         # their generation budget

  def check(self) -> None:
    super().check()
    self.number("beta", 0, lo_open=True)
    self.choice("loss_type", loss_lib.DPO_LOSS_TYPES)
    self.number("label_smoothing", 0, 0.5)
    self.number("rpo_alpha", 0)
    self.number("eval_greedy", 0, integer=True)
    self.number("max_new_tokens", 1, integer=True)
