"""Shared config pieces: the base recipe every config starts from, and `parse_arg`."""
import json

import ml_collections as mlc


def parse_arg(arg, **defaults):
  """'size=7b,runlocal' -> ConfigDict(size='7b', runlocal=True), over the given defaults."""
  out = mlc.ConfigDict(defaults)
  for part in (arg or "").split(","):
    if not part:
      continue
    key, _, value = part.partition("=")
    if key not in defaults:
      raise ValueError(f"config argument {key!r} is unknown; known: {sorted(defaults)}")
    if not value:
      out[key] = True
    elif isinstance(defaults[key], bool):
      out[key] = value.lower() in ("1", "true", "yes")
    else:
      out[key] = type(defaults[key])(value)
  return out


def base() -> mlc.ConfigDict:
  """The DAPO recipe of the paper (§5.1) on a model to be chosen; configs override what differs."""
  c = mlc.ConfigDict()
  c.seed = 0

  # Model: `init` is "random" (from the fields below), "hf" (from `hf_dir`), "gguf" (from `gguf`:
  # a .gguf file or "smollm2", converted once into WORKDIR/model) or "sft" (random init, then the
  # SFT warm start, whose result is reused on later runs).
  c.model = dict(init="random", hf_dir="", gguf="", vocab_size=0, embed_dim=128, mlp_dim=384, num_layers=4,
                 num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10_000.0, norm_eps=1e-6,
                 qkv_bias=True, tie_embeddings=True, param_dtype="float32",
                 dtype="float32",            # compute dtype: bfloat16 on GPU/TPU
                 matmul_dtype="",            # weight-matmul operands ("" = dtype; fp32 accumulation)
                 remat="dots",               # none | full | dots: on XLA:CPU "dots" (keep matmul
                                             # outputs, recompute the rest) is also the fastest
                 attn_chunk=0,               # attention query block (0 = whole rows); long rows need it
                 attention_impl="einsum",    # attention core: einsum | xla | cudnn (jax.nn.dot_product_attention;
                                             # cudnn = flash attention on NVIDIA GPUs, bf16 only)
                 logits_chunk=0,             # RL update: completion positions unembedded at once (0 = all);
                                             # a large vocabulary (Gemma 3's 262K) needs it
                 # Family (a loaded model takes these from its config.json): qwen2 | llama | qwen3 |
                 # qwen3_moe | gemma3.
                 arch="qwen2", qk_norm=False,
                 rope_type="default",        # RoPE scaling: default | linear | llama3 | yarn
                 rope_factor=1.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                 rope_original_max_pos=8192, rope_beta_fast=32.0, rope_beta_slow=1.0,
                 rope_attention_factor=0.0, rope_truncate=True,
                 sliding_window=0,           # tokens seen by local layers (Gemma 3)
                 local_layers=(),            # indices of the sliding-window layers
                 rope_local_theta=10_000.0,  # RoPE base of local layers
                 query_scale=0.0,            # scores scale by query_scale**-0.5 (0 = head_dim)
                 attn_softcap=0.0, final_softcap=0.0,   # tanh soft-capping of scores / logits (0 = off)
                 # Mixture of experts (qwen3_moe): E experts of width expert_mlp_dim, k per token.
                 num_experts=0, experts_per_token=0, expert_mlp_dim=0,
                 norm_topk_prob=False,       # renormalise the k router probabilities to sum to 1
                 dense_layers=(),            # layers that keep a dense MLP of mlp_dim
                 router_aux_coef=0.0,        # load-balancing loss weight in training (0 = off, as verl)
                 expert_chunk=0,             # tokens per device per expert-dispatch block (0 = all)
                 # LoRA: rank > 0 trains adapters of that rank on the `targets` projections of every
                 # layer (PEFT names) and freezes the base; the reference model is the base with its
                 # adapters off. alpha: the adapters' output scales by alpha / rank. dropout: PEFT's
                 # lora_dropout, on the adapters' input in training forwards only.
                 lora=dict(rank=0, alpha=32.0, dropout=0.0,
                           targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
                 base_quant="")              # "int8": the frozen base's layer matrices in int8 (needs lora.rank > 0)
  c.tokenizer = dict(path="",                # "" = train a small BPE on the task text into workdir
                     vocab_size=256)
  c.data = dict(task="file",                 # "file" (DAPO-Math schema), "arith" (built in) or "reasoning_gym"
                train_files=("",), eval_files=("",),
                chat_template=True,          # render prompts with the tokenizer's chat template
                prompt_template="",          # e.g. data.DAPO_INSTRUCTION; "" = rows as they are
                max_prompt_len=2048,         # tokens; longer prompts keep their end (truncation left)
                prompt_buckets=(),            # prompt lengths compiled for; () = just max_prompt_len
                missing_answer="error",      # error | skip rows without a (usable) ground truth
                digits=2, ops="+", heldout_fraction=0.1, num_eval=128,   # arith task knobs
                digits_b=0,                  # digits of the second operand (0 = digits)
                fewshot=0,                   # worked examples in the chat before each question
                solution_style="steps",      # SFT targets for arith: "steps" (column addition) | "column"
                                             # | "mixed" | "direct"
                rg_tasks=(),                 # task="reasoning_gym": its generators, e.g. ("chain_sum",)
                rg_settings="",              # JSON {task: generator kwargs}, e.g. '{"chain_sum": {"max_terms": 3}}'
                rg_num_train=2000)           # training items per reasoning-gym task (held-out: num_eval)
  c.rollout = dict(group_size=16,            # G, responses per prompt
                   max_new_tokens=20_480,    # L_max, completion tokens
                   temperature=1.0, top_p=1.0, top_k=0,
                   engine="continuous",      # "continuous": a pool of decode slots refilled as samples
                                             # end (cost follows the tokens generated); "static": each
                                             # sampler call decodes until its longest row ends
                   slots=0,                  # continuous: decode slots of every engine call, rollout and
                                             # evaluation (0 = the rows of a train batch, Q*G)
                   prefill_tokens=2048,      # continuous: prompt tokens an insert prefills at once (a power
                                             # of two of whole prompts, at least one); their keys and values
                                             # for every layer exist at once beside the cache
                   kv_cache_dtype="",        # continuous: KV-cache dtype ("" = model.dtype); bfloat16 halves
                                             # the bytes a decode step reads (log-prob shift: docs/benchmarks.md)
                   shared_prefix=32,         # continuous: prompts of one prefill sharing >= this many first
                                             # tokens (few-shot examples) run them once (0 = off; docs/benchmarks.md)
                   rows_per_call=0,          # static: rows per sampler call (0 = the whole generation batch)
                   # Rollout versions a trained sample may lag the policy it updates (docs/async.md):
                   # 0 = synchronous (generate, then train); 1 = one-step-off: step k+1's rollout is
                   # generated by the policy before update k, in a thread while update k runs;
                   # S > 1 queues the rollouts of steps up to k+S by that policy (one worker thread).
                   max_staleness=0,
                   # Stale rows' π_old: False = their sampler log-probs (PPO's clip bounds the
                   # off-policy ratio, no extra forward); True = AReaL's decoupled objective: π_old is
                   # the proximal policy (this step's params) and π_prox/π_behav is weighted through
                   # dapo.rollout_correction (AReaL's actor.use_decoupled_loss).
                   use_decoupled_loss=False,
                   # Partial rollouts (max_staleness=1, streaming): once update k ends, the samples of
                   # step k+1 still in flight continue with the new params (their KV cache kept) and
                   # the prompts not yet started start with them; each token keeps its sampler's
                   # log-prob and version (docs/async.md).
                   partial_rollouts=False,
                   # What ends a completion: "generation_config" = the model's EOS ids as verl reads
                   # them (generation_config.json, else config.json, else the tokenizer's EOS; for a
                   # base model often <|endoftext|> alone), "chat" = those plus the chat template's
                   # end-of-turn tokens (<|im_end|>, <|eot_id|>, <|endoftext|>) in the vocabulary.
                   # "chat" here: the tasks below are chat-templated and an instruct model ends its
                   # turn with <|im_end|>; the default job's own tokenizer has no
                   # generation_config.json. The paper recipe sets "generation_config" (reference).
                   stop="chat",
                   # Episodes (docs/environments.md): `env` ("module:Class", an envs.Env; "" = single
                   # turn) builds each episode's prompt, answers between policy turns and gives the
                   # reward (reward.fn is then unused); env_args: JSON keyword arguments of the class.
                   # max_new_tokens is then one turn's budget; max_episode_tokens the whole context
                   # (prompt, turns and observations; 0 = data.max_prompt_len + max_turns x
                   # max_new_tokens).
                   env="", env_args="{}", max_turns=4, max_episode_tokens=0,
                   env_timeout_s=30.0,       # one environment step; a hung one ends its episode
                   env_workers=8,            # environment steps running at once (threads)
                   env_failure_score=-1.0,   # the reward of an episode cut by max_turns / max_episode_tokens
                   env_error="mask",         # failed env: "mask" the row out of the loss, or "score" env_failure_score
                   turn_stop=())             # tokens that also end a policy turn, kept in its text: a tool
                                             # call's closing tag that is one token ("</tool_call>" in Qwen's)
  c.dapo = dict(prompts_per_step=512,        # Q, prompts in a train batch
                gen_prompts=1536,            # prompts per generation batch (3x for dynamic sampling)
                dynamic_sampling=True,       # drop groups whose correctness is all equal (Eq. 11)
                max_gen_batches=10,          # cap per step: at most max_gen_batches x gen_prompts prompts
                                             # are sampled in a rollout step; 0 = unlimited
                streaming=True,              # admit prompts into the engine as they may be needed; each
                                             # step trains the first Q kept groups in prompt order, sampled
                                             # by the current policy. False: whole generation batches, then
                                             # the filter (the reference; carry_over then applies)
                admit_ahead=True,            # streaming admits by the running keep rate (expected keeps of
                                             # the groups in flight >= those needed + 1 std), cancelling and
                                             # rewinding what the step did not need: the same groups, in
                                             # fewer waves. False: admit only while kept + in flight < Q
                admit_margin=1.0,            # that margin in standard deviations: lower wastes fewer
                                             # prompts (work-bound CPUs), higher needs fewer waves
                filter_metric="acc",         # what must vary in a group: acc | score (the scorer's) |
                                             # seq_reward | seq_final_reward (score + overlong penalty)
                # Ours below; the reference (verl's recipe, configs/dapo_qwen2_5_32b.py) raises at the
                # cap and discards surplus groups: on_cap="raise", carry_over=False.
                on_cap="train",              # at the cap: "train" on what was kept, or "raise" (reference)
                carry_over=True,             # keep surplus groups for the next step (reference: discard);
                                             # their π_old is the sampling policy's log-probs
                eps_low=0.2, eps_high=0.28,  # decoupled clip (Eq. 10)
                clip_ratio_c=10.0,           # dual clip for A<0; 0 = off
                # verl's registry (loss.POLICY_LOSSES; docs/losses.md): vanilla (the decoupled clip) |
                # gspo | sapo | gpg | clip_cov | kl_cov | geo_mean | dro | cispo | dppo_tv | dppo_kl |
                # reinforce. dppo_*: eps_low / eps_high are divergence bounds, clip_ratio_c truncates.
                policy_loss="vanilla",
                tau_pos=1.0, tau_neg=1.05,   # sapo: gate temperatures for A > 0 / A <= 0
                clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0,   # clip_cov: tokens cut, cov band
                kl_cov_ratio=0.0002, ppo_kl_coef=0.1,                      # kl_cov: tokens, |log r| coef
                dro_beta=0.0,                # dro: β of the quadratic log-ratio penalty (> 0 when used)
                # Sampler-vs-trainer correction, verl's algorithm.rollout_correction ("" = null, off):
                # rollout_is "token" | "sequence" with rollout_is_threshold a number (TIS) or
                # "lower_upper" (IcePop); rollout_rs e.g. "token_k1,seq_mean_k3" with one threshold
                # or one each; bypass_mode: π_old = the sampler's log-probs, loss_type ppo_clip |
                # reinforce. The mismatch metrics (mismatch/*) are logged whatever is set here.
                rollout_correction=dict(rollout_is="", rollout_is_threshold="2.0",
                                        rollout_is_batch_normalize=False, rollout_rs="",
                                        rollout_rs_threshold="", bypass_mode=False, loss_type="ppo_clip"),
                loss_agg="token_mean",       # token_mean | token_sum | seq_mean_token_{mean,sum,sum_norm}
                                             # (sum_norm: Dr.GRPO, verl's "seq-mean-token-sum-norm") |
                                             # seq_sum_token_sum_norm (verl's formula before 2026-02-26)
                # True: each micro-batch's loss is its own token mean weighted by its share of the
                # mini-batch's rows, as verl weights micro-batches (on our micro-batch split, not
                # verl's: verl balances rows across ranks and packs micro-batches by token count).
                verl_microbatch_weighting=False,
                norm_adv_by_std=True,        # False = Dr.GRPO (mean-only)
                overlong_buffer=4096,        # L_cache (Eq. 13); 0 = off
                overlong_penalty=1.0,        # penalty factor
                overlong_filter=False,       # mask truncated samples out of the loss
                kl_coef=0.0, kl_estimator="k3",    # DAPO: no KL, no reference model
                # Advantages: grpo (group-relative, Eq. 9) | rloo (leave-one-out) | reinforce_pp
                # (REINFORCE++: per-token return-to-go) | gae (PPO: a value model, `critic` below)
                # | distill (on-policy distillation: A_t = log π_teacher - log π per token)
                adv_estimator="grpo",
                teacher_dir="")              # distill: the teacher, an HF directory of the policy's tokenizer
  # The token-level estimators (dapo.adv_estimator="gae" or "reinforce_pp"): the reward of each token
  # is -β·(log π - log π_ref), plus the score on the last one (Ziegler et al. 2019; verl's
  # use_kl_in_reward), against the frozen initial policy. Defaults are verl's.
  c.ppo = dict(gamma=1.0,                    # γ, discount per token
               lam=1.0,                      # λ of GAE
               kl_coef=0.001,                # β (the first one, with the adaptive controller); 0 = no KL
               kl_ctrl="fixed",              # fixed | adaptive: β·(1 + clip(KL/target_kl - 1, ±0.2)·n/horizon)
               target_kl=0.1,                # adaptive: the KL per token that β steers to (k1, nats)
               horizon=10_000)               # adaptive: responses over which β changes by at most 20%
  # PPO's value model (dapo.adv_estimator="gae"): its own params, optimizer state and learning rate,
  # on the policy's mesh, checkpointed with the policy.
  c.critic = dict(init="policy",             # "policy": the policy's trunk with a zero scalar head;
                                             # "rm": a reward model (HF ...ForSequenceClassification dir)
                  model_dir="",              # init="rm": that directory ("" = the rm:DIR of reward.fn)
                  lr=1e-5, warmup_steps=0, weight_decay=0.0, grad_clip=1.0,
                  clip_range=0.5)            # values move at most this far from the rollout's (verl's
                                             # cliprange_value)
  c.reward = dict(fn="dapo_jax.rewards:math_dapo",   # module:function(response, ground_truth),
                                                     # http://HOST:PORT (launch.serve_rm) or rm:DIR
                  fns=(),                            # weighted sum instead of fn, e.g.
                                                     # ("rm:DIR", "0.5*dapo_jax.rewards:math_dapo")
                  timeout_s=10.0, workers=2,
                  # Code the policy writes (dapo_jax.rewards:python_tests, the python tool) runs in a
                  # sandbox (bubblewrap namespaces, one cgroup, a seccomp filter: docs/sandbox.md);
                  # "none" is for trusted code only, and warns.
                  sandbox="namespaces")
  c.optim = dict(lr=1e-6, warmup_steps=10, weight_decay=0.1, grad_clip=1.0, b1=0.9, b2=0.999, eps=1e-8)
  c.train = dict(num_steps=500,              # rollout steps
                 minibatches=16,             # optimizer updates per rollout step and epoch
                 ppo_epochs=1,
                 num_microbatches=0,         # gradient accumulation inside one update; 0 = auto:
                 microbatch_tokens=2048,     # the fewest micro-batches of at most this many tokens
                                             # per data shard (the SFT warm start always uses auto)
                 share_prompt=True,          # a group's prompt runs through the model once (exact)
                 shared_prefix=32,           # and the first tokens every prompt of a mini-batch shares (a
                                             # system prompt, few-shot examples), in multiples of this many,
                                             # once per mini-batch (exact up to summation order; 0 = off)
                 length_buckets=8,           # micro-batches of groups sorted by length, each cut to one
                                             # of this many lengths (eighths of max_new_tokens) and, with
                                             # auto micro-batches, packed to microbatch_tokens at that
                                             # length; 0 = pad every row to max_new_tokens
                 ckpt_every=5, keep_ckpts=3,
                 eval_every=5, log_samples_every=5,
                 max_bad_steps=5,            # stop after this many non-finite updates in a row
                 # Every scored rollout (kept or dropped) to WORKDIR/rollouts/step_<N>.jsonl.gz, and the
                 # held-out samples of each evaluation to eval_step_<N>.jsonl.gz, every this many rollout
                 # steps; 0 = off; -1 = every step on small jobs (Q·G·max_new_tokens <= 2^20), else off.
                 dump_rollouts_every=-1,
                 profile_steps=(),           # (a, b): a JAX profiler trace of rollout steps a..b (1-based)
                                             # in WORKDIR/profile (TensorBoard's profile plugin, Perfetto)
                 peak_flops=0.0)             # FLOP/s per device for perf/mfu; 0 = by device kind (CPU: none)
  c.eval = dict(k=32, temperature=1.0, top_p=0.7, greedy=False, max_new_tokens=0,  # 0: rollout's
                reward_fn="")                # "" = reward.fn; e.g. a rule check for a run trained on an RM
  c.sft = dict(steps=0, batch_size=32, seq_len=128, lr=1e-3, warmup_steps=20, num_examples=20_000,
               target_acc=0.0,       # >0: stop early once greedy solves this fraction of a probe
               probe_size=256,       # training problems in that probe
               probe_every=25,       # steps between probes
               completion_only=False,  # loss on the solution's tokens only (prompt, tool results masked)
               ckpt_every=100,       # updates between checkpoints in WORKDIR/sft (a rerun resumes)
               keep_ckpts=2)
  # SFT on conversation files (`launch.sft` with data.task="file"; steps, sizes and lr from `sft`).
  c.chat_sft = dict(assistant_only=True,     # loss on assistant turns only (False: every token)
                    packing=True,            # several conversations per sft.seq_len row
                    heldout_fraction=0.05,   # conversations held out for the loss (by prompt hash)
                    eval_every=100)          # updates between held-out losses
  # Preference-pair trainings (`launch.rm`, `launch.dpo`): TRL-schema files, start from an HF dir.
  pairs = dict(train_files=("",), eval_files=("",),
               init_dir="",                  # HF directory of the starting (SFT) policy
               steps=300, batch_pairs=32, lr=1e-4, warmup_steps=10, weight_decay=0.0, grad_clip=1.0,
               prompt_len=64,                # tokens; longer prompts keep their end
               response_len=64,              # tokens with EOS; longer responses keep their start
               eval_every=50, ckpt_every=100, keep_ckpts=2)
  c.rm = dict(pairs, margin=0.0)             # -log σ(r_c - r_r - margin)
  c.dpo = dict(pairs, beta=0.1,              # β of the implicit reward β·(log π - log π_ref)
               loss_type="sigmoid",          # sigmoid (DPO) | ipo
               label_smoothing=0.0,
               rpo_alpha=0.0,                # RPO: + rpo_alpha * NLL of the chosen responses (0 = plain DPO)
               eval_greedy=64,               # held-out prompts whose greedy answers are rule-checked
               max_new_tokens=32)            # their generation budget
  c.mesh = dict(data=1, fsdp=-1, tensor=1,  # -1: the rest of the devices
                expert=1,                  # devices that split a mixture's experts (rows elsewhere)
                rollout_devices=0)         # R > 0: the first R devices decode, the rest train, each on a
                                           # mesh of these axes (docs/async.md); 0: both share all devices
  # Where metrics go: any of "tensorboard" (WORKDIR/tb), "jsonl" (WORKDIR/metrics.jsonl) and "wandb"
  # (pip install -e ".[wandb]"; WANDB_MODE=offline writes WORKDIR/wandb for a later `wandb sync`).
  c.metrics = dict(writers=("tensorboard", "jsonl"),
                   wandb_project="dapo_jax",
                   wandb_entity="",          # "" = the W&B account's default entity
                   wandb_name="")            # "" = the workdir's name
  return c


def qwen2_5(size: str) -> dict:
  """Model fields of a Qwen2.5 size ('32b', '7b', '0_5b'), for a run that loads its HF weights."""
  return preset({"32b": "qwen2_5_32b", "7b": "qwen2_5_7b", "0_5b": "qwen2_5_0_5b"}[size])


def preset(name: str) -> dict:
  """Model fields of a `ModelConfig` preset ('qwen3_8b', 'llama3_1_8b', 'gemma3_4b', ...)."""
  import dataclasses

  from dapo_jax.model import transformer as model
  return dataclasses.asdict(getattr(model.ModelConfig, name)())


def runlocal(c: mlc.ConfigDict) -> None:
  """Shrinks any recipe to a seconds-long CPU smoke run on the built-in arithmetic task."""
  c.model.update(init="random", hf_dir="", gguf="", vocab_size=0, embed_dim=32, mlp_dim=64, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10_000.0, qkv_bias=True,
                 tie_embeddings=True, param_dtype="float32", dtype="float32", matmul_dtype="", remat="none",
                 attn_chunk=0, logits_chunk=0, arch="qwen2", qk_norm=False, rope_type="default", sliding_window=0,
                 local_layers=(), query_scale=0.0, attn_softcap=0.0, final_softcap=0.0, num_experts=0,
                 experts_per_token=0, expert_mlp_dim=0, norm_topk_prob=False, dense_layers=(),
                 router_aux_coef=0.0, expert_chunk=0)
  c.tokenizer.update(path="", vocab_size=300)
  c.data.update(task="arith", max_prompt_len=32, prompt_buckets=(), prompt_template="", num_eval=8,
                digits_b=0, fewshot=0)
  c.rollout.update(group_size=4, max_new_tokens=8, rows_per_call=0)
  # A random tiny model rarely solves anything, so at the cap a smoke run trains on what it kept.
  c.dapo.update(prompts_per_step=4, gen_prompts=8 if c.dapo.dynamic_sampling else 4, max_gen_batches=2,
                overlong_buffer=min(c.dapo.overlong_buffer, 2), on_cap="train")
  c.train.update(num_steps=2, minibatches=2, num_microbatches=1, ckpt_every=0, eval_every=0,
                 log_samples_every=1)
  c.eval.update(k=2, max_new_tokens=0)
  c.sft.steps = 0
  c.mesh.update(data=1, fsdp=-1, tensor=1, expert=1)


# reasoning-gym tasks the small checkpoints train on (configs/smollm2_135m_reasoning.py,
# configs/gemma3_270m_reasoning.py), with their generator settings: one-digit operands, short answers.
# Greedy before RL, SmolLM2-135M-Instruct with 3 worked examples: chain_sum 27%, basic_arithmetic 6%.
RG_TASKS = {"chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1},
            "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
# No "e.g. <answer>42</answer>" (data.reasoning_gym.INSTRUCTION): with worked examples before the
# question it only teaches a small model to answer 42.
RG_INSTRUCTION = "{question}\nGive your final answer inside <answer></answer> tags."


def reasoning_gym(c: mlc.ConfigDict, tasks: str) -> None:
  """DAPO on reasoning-gym tasks ("chain_sum+basic_arithmetic"), each scored by its own verifier,
  with three worked examples before each question."""
  names = tuple(tasks.split("+"))
  for name in names:
    if name not in RG_TASKS:
      raise ValueError(f"tasks={tasks!r}: {name!r} is not one of {sorted(RG_TASKS)}")
  c.data.update(task="reasoning_gym", rg_tasks=names, rg_settings=json.dumps({t: RG_TASKS[t] for t in names}),
                rg_num_train=4000, num_eval=48, fewshot=3, prompt_template=RG_INSTRUCTION,
                max_prompt_len=224, prompt_buckets=(224,))
  c.reward.update(fn="dapo_jax.rewards:reasoning_gym", workers=2)
  c.rollout.update(group_size=8, max_new_tokens=32, temperature=1.0, top_p=1.0, top_k=0)
  c.dapo.update(prompts_per_step=8, gen_prompts=12, max_gen_batches=3, overlong_buffer=8)
  c.train.update(num_steps=30, minibatches=1, ckpt_every=5, eval_every=10, log_samples_every=5)
  c.eval.update(k=4, temperature=1.0, top_p=1.0, greedy=True)
  c.mesh.update(data=1, fsdp=-1, tensor=1)
