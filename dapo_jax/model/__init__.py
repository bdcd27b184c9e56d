"""The network: ModelConfig, init_params, forward, logits, completion_logits, decode_step.

One layer function serves teacher forcing, prefill and decode (`layers`); `transformer` stacks it
under an LM or scalar head; `kv_cache`, `lora`, `quant` and `memory` are its parts and its plan.
"""
from dapo_jax.model.config import ModelConfig
from dapo_jax.model.decode import decode_params, decode_step
from dapo_jax.model.transformer import (
                                        Transformer,
                                        causal_mask,
                                        completion_logits,
                                        completion_logits_after_prefix,
                                        embed,
                                        forward,
                                        init_boxed,
                                        init_params,
                                        last_token_scores,
                                        logits,
                                        packed_attention_mask,
                                        positions,
)
