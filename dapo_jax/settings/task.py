"""The `data` and `reward` sections: what the policy is asked and how its answers are scored."""
from __future__ import annotations

import dataclasses
import inspect

from dapo_jax.data import prompts as data_lib
from dapo_jax.envs import sandbox as sandbox_lib
from dapo_jax.pipelines import sft as sft_lib
from dapo_jax.rewards import judge as judge_lib
from dapo_jax.rollout import rollout as rollout_lib
from dapo_jax.settings.section import Section, check

TASKS = ("file", "arith", "reasoning_gym", "count_shapes")
SFT_TASKS = ("arith", "count_shapes")  # The tasks with reference solutions (`data.arith_solution`): an SFT warm start.
SOLUTION_STYLES = ("steps", "column", "mixed", "direct", "tool")
_ROLLOUT, _SFT, _JUDGE = rollout_lib.RolloutConfig, sft_lib.SFTConfig, judge_lib.JudgeConfig
_ARITH = inspect.signature(data_lib.arith_examples).parameters  # The arithmetic task's own defaults.


@dataclasses.dataclass(frozen=True)
class Data(Section):
  """`data`: the task, its files or generator, and how prompts are rendered and cut."""
  NAME = "data"
  task: str = "file"               # "file" (DAPO-Math schema), "arith" (built in), "reasoning_gym" or
                                   # "count_shapes" (drawn pictures: a vision-language model's task)
  train_files: tuple[str, ...] = ("",)   # task="file": parquet / jsonl files of training rows
  eval_files: tuple[str, ...] = ("",)    # task="file": held-out rows (e.g. AIME 2024)
  # task="file" with several train_files: each file's share of the prompts drawn (normalised; each file
  # shuffled on its own); () = the files' rows pooled and shuffled together.
  train_weights: tuple[float, ...] = ()
  curriculum: bool = False         # set aside a prompt whose last group was all right or all wrong (data.curriculum)
  revisit_after: int = 10          # data.curriculum: rollout steps a prompt stays aside before it may be drawn again
  curriculum_aside: str = "both"   # data.curriculum: the groups that set their prompt aside: both, solved or unsolved
  curriculum_streak: int = 1       # data.curriculum: such groups in a row (of one prompt) that set it aside
  chat_template: bool = _ROLLOUT.chat_template   # render prompts with the tokenizer's chat template
  prompt_template: str = ""        # e.g. data.DAPO_INSTRUCTION; "" = rows as they are
  max_images: int = _ROLLOUT.max_images   # a vision-language model: image slots per prompt (rows' images <= it)
  pan_and_scan: bool = False       # Gemma 3's pan-and-scan: a wide or tall image also enters as 2-4 crops (slots too)
  max_prompt_len: int = 2048       # tokens; longer prompts keep their end (truncation left)
  prompt_buckets: tuple[int, ...] = _ROLLOUT.prompt_buckets   # prompt lengths compiled for; () = just max_prompt_len
  missing_answer: str = "error"    # error | skip rows without a (usable) ground truth
  digits: int = _ARITH["digits"].default           # arith: digits of the first operand
  ops: str = _ARITH["ops"].default                 # arith: operators drawn from, e.g. "+-"
  heldout_fraction: float = _ARITH["heldout_fraction"].default   # arith: problems reserved for evaluation
  num_eval: int = 128              # held-out examples evaluated (file: the first ones; 0 = all)
  digits_b: int = _ARITH["digits_b"].default       # arith: digits of the second operand (0 = digits)
  fewshot: int = _ARITH["fewshot"].default         # worked examples in the chat before each question
  solution_style: str = _SFT.solution_style   # arith's SFT targets: steps | column | mixed | direct | tool
  rg_tasks: tuple[str, ...] = ()   # task="reasoning_gym": its generators, e.g. ("chain_sum",)
  rg_settings: str = ""            # JSON {task: generator kwargs}, e.g. '{"chain_sum": {"max_terms": 3}}'
  rg_num_train: int = 2000         # training items per reasoning-gym task (held-out: num_eval)
  max_count: int = 4               # count_shapes: red shapes per picture, 1..max_count (chance: 1/max_count)
  blank_images: bool = False       # count_shapes: every picture blank (the control: the text alone)

  def check(self) -> None:
    self.choice("task", TASKS, "'arith', 'file', 'reasoning_gym' or 'count_shapes'")
    self.number("revisit_after", 1, integer=True)
    self.number("curriculum_streak", 1, integer=True)
    self.choice("curriculum_aside", ("both", "solved", "unsolved"), "'both' (all right or all wrong), 'solved' "
                "(all right) or 'unsolved' (all wrong)")
    if self.train_weights:
      files = [f for f in self.train_files if f]
      check(self.task == "file" and len(self.train_weights) == len(files), "data.train_weights", self.train_weights,
            f"one weight per data.train_files entry ({len(files)}) with data.task='file'")
      check(all(isinstance(w, (int, float)) and not isinstance(w, bool) and 0 < w < float("inf")
                for w in self.train_weights), "data.train_weights", self.train_weights, "positive numbers")
    if self.task == "count_shapes":
      self.number("max_count", 1, 12, integer=True)
      check(self.solution_style == "direct", "data.solution_style", self.solution_style,
            "'direct' when data.task='count_shapes' (its answers have no steps)")
    if self.task == "reasoning_gym":
      check(len(self.rg_tasks) > 0, "data.rg_tasks", self.rg_tasks,
            "at least one reasoning-gym task when data.task='reasoning_gym', e.g. ('chain_sum',)")
      self.number("rg_num_train", 1, integer=True)
    elif self.task == "arith":
      self.number("digits", 1, integer=True)
      self.number("digits_b", 0, integer=True)
      self.number("fewshot", 0, integer=True)
      self.number("heldout_fraction", 0, 1, lo_open=True, hi_open=True)
    self.choice("missing_answer", ("error", "skip"), "'error' or 'skip'")
    self.choice("solution_style", SOLUTION_STYLES, "'steps', 'column', 'mixed', 'direct' or 'tool' (calculator "
                "episodes: rollout.env='dapo_jax.envs.tasks:CalculatorArith')")
    self.number("max_images", 1, integer=True)
    P = self.number("max_prompt_len", 1, integer=True)
    for b in self.prompt_buckets:
      check(isinstance(b, int) and 1 <= b <= P, "data.prompt_buckets", self.prompt_buckets,
            f"prompt lengths from 1 to data.max_prompt_len={P}")
    self.number("num_eval", 0, integer=True)


@dataclasses.dataclass(frozen=True)
class Reward(Section):
  """`reward`: the rollout's scorer."""
  NAME = "reward"
  # module:function(response, ground_truth), http://HOST:PORT (launch.serve_rm), rm:DIR (a reward model) or
  # judge:http://HOST:PORT/v1 (a language model behind an OpenAI-compatible endpoint, grading by a rubric).
  fn: str = "dapo_jax.rewards:math_dapo"
  fns: tuple[str, ...] = ()        # a weighted sum instead of fn, e.g. ("rm:DIR", "0.5*dapo_jax.rewards:math_dapo")
  timeout_s: float = 10.0          # one scoring call; a hung one scores as failed
  workers: int = 2                 # scoring processes
  # Code the policy writes (rewards:python_tests, the python tool) runs in a sandbox (bubblewrap
  # namespaces, one cgroup, a seccomp filter: docs/sandbox.md); "none" is for trusted code only, and warns.
  sandbox: str = "namespaces"
  # judge:URL (rewards/judge.py): a language model grading by a rubric; each field's doc is JudgeConfig's.
  judge_model: str = _JUDGE.judge_model
  judge_rubric: str = _JUDGE.judge_rubric
  judge_pattern: str = _JUDGE.judge_pattern
  judge_max_score: float = _JUDGE.judge_max_score
  judge_max_tokens: int = _JUDGE.judge_max_tokens
  judge_token_env: str = _JUDGE.judge_token_env

  def check(self) -> None:
    self.number("timeout_s", 0, lo_open=True)
    self.number("judge_max_score", 0, lo_open=True)
    self.number("judge_max_tokens", 1, integer=True)
    self.number("workers", 1, integer=True)
    check(isinstance(self.fn, str) and ":" in self.fn, "reward.fn", self.fn,
          "'package.module:function', 'http://HOST:PORT' (a reward-model server), 'rm:DIR' (a reward model) or "
          "'judge:http://HOST:PORT/v1' (a judge)")
    self.choice("sandbox", sandbox_lib.MODES, "'namespaces' or 'none' (trusted code only)")
