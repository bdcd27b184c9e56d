"""Rewards, free of jax (reward-pool workers import this face): the rule checks (`rules`), clients
that run any reward with a timeout (`clients`: a process pool, HTTP, weighted combinations), the
reward-model scorer (`model`, imported only for rm:DIR), a language model as judge (`judge`,
judge:URL). The RM server is `serve.rm_server`."""
from dapo_jax.rewards.clients import (
                                      FAILURE,
                                      CombinedReward,
                                      HTTPReward,
                                      RewardConfigError,
                                      RewardFn,
                                      RewardPool,
                                      combine,
                                      make_reward,
                                      parse_weighted,
                                      resolve,
)
from dapo_jax.rewards.code import python_tests
from dapo_jax.rewards.judge import JudgeConfig, JudgeReward
from dapo_jax.rewards.reasoning_gym import reasoning_gym
from dapo_jax.rewards.rules import math_dapo, math_verify, normalize_final_answer, overlong_penalty
