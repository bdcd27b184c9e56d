"""Host-side data (NumPy, no jax): prompts and their iterator, tokenizers and chat templates,
conversations for SFT, preference pairs for the RM and DPO."""
from dapo_jax.data.prompts import (
                                   ARITH_INSTRUCTION,
                                   DAPO_INSTRUCTION,
                                   DataError,
                                   Example,
                                   PromptIterator,
                                   arith_examples,
                                   arith_problem,
                                   arith_solution,
                                   in_heldout,
                                   load_file,
                                   read_rows,
)
