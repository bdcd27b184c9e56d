"""Shapes and the batches that cross module boundaries.

The one-letter shape alphabet (array names end with their axes: `x_BTD`, `logp_BC`):
  Q prompts (questions)      G completions per prompt    B rows = Q*G (what the model sees)
  P prompt positions         C completion positions      T = P + C model positions
  S key / cache slots        L layers                    D model width
  F MLP width                V vocabulary                N query heads
  M packed sequences (of T positions each; `PackedRows`)
  K KV heads                 R query heads per KV head   H head dimension
`sharding.LOGICAL` maps these letters to logical axis names.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import struct


@struct.dataclass
class PackedRows:
  """The model's inputs of a packed micro-batch (`packing.packed_microbatches`): rows' real tokens
  packed into M sequences of T positions, one segment per row, or per prompt where rows share one, or
  per sequence where its prompts begin alike; each data shard holds M / shards consecutive sequences
  and the rows packed in them. Attention stays inside a segment, inside a prompt's part but for the
  segment's shared beginning, and inside a branch but for the part's trunk (`packed_attention.sees`);
  positions are each row's own."""
  tokens_MT: jax.Array      # int32 [M, T]
  positions_MT: jax.Array   # int32: position within the segment (the row's position ids)
  segments_MT: jax.Array    # int32: 1.. = the segment's number in its sequence; 0 = padding
  # int32: 0 = the beginning the segment's prompts share (a segment of several prompts), k = its k-th
  # prompt's part, which sees that beginning and itself.
  prompts_MT: jax.Array
  # int32: 0 = the prompt part's trunk (a shared prompt but its last token, or a whole row), k = its
  # k-th row's branch, which sees the trunk and itself.
  branches_MT: jax.Array
  # The scored tokens, K per shard (shard d's are the d-th K; the row slots of shard d are the d-th
  # B / shards). int32 [shards x K]: the index, in its shard's sequences laid end to end, of the
  # position that predicts the token; the token; its place b x C + c in the micro-batch's [B, C]
  # arrays (B x C: padding, dropped).
  source_K: jax.Array
  target_K: jax.Array
  place_K: jax.Array
  row_B: jax.Array          # bool [B]: a row of the mini-batch (False: an unused row slot)
  # int32 [M, P]: the (query block, key block) pairs attention computes, blocks of `block` positions,
  # -1 = none (`packing.block_pairs`, `packed_attention.attend_blocks`); None: dense under the mask.
  query_block_MP: jax.Array | None = None
  key_block_MP: jax.Array | None = None
  # Routing replay: int32 [M, T, L_moe, k], each packed token's recorded experts (-1: none); None: no replay.
  routes_MTLk: jax.Array | None = None
  # int32 [M, T]: the rows that read each token (a shared trunk: its branches; a shared beginning: its
  # sequence's rows; else 1; padding 0), the weights of per-row statistics; None: segments_MT > 0.
  rows_MT: jax.Array | None = None
  # Images (`RLBatch.images_BMD`): int32 [M, T], each placeholder's image, numbered within its shard (0:
  # text), whose tokens see each other both ways; int32 [M, N], the vector of each sequence's n-th
  # placeholder in its shard's row slots' vectors laid end to end (slot r's i-th at r x M_img + i).
  image_MT: jax.Array | None = None
  image_source_MN: jax.Array | None = None
  # int32 [M, T, 3]: each token's M-RoPE (temporal, height, width) positions, its row's (Qwen2.5-VL:
  # `mrope.mrope_positions`); None: positions_MT.
  mrope_MT3: jax.Array | None = None
  shards: int = struct.field(pytree_node=False, default=1)
  block: int = struct.field(pytree_node=False, default=0)


@struct.dataclass
class RLBatch:
  """One mini-batch of scored rollouts, laid out as [left-padded prompt | right-padded completion]."""
  tokens_BT: jax.Array      # int32 [B, P+C]
  mask_BT: jax.Array        # bool: real prompt tokens and completion tokens up to and including EOS
  loss_mask_BC: jax.Array   # bool: completion tokens counted in the loss (overlong filtering zeroes rows)
  old_logp_BC: jax.Array    # fp32 log π_old of the completion tokens
  adv_B: jax.Array          # fp32 advantage per row
  ref_logp_BC: jax.Array    # fp32 log π_ref (zeros when the KL term is off)
  # bool: rows sampled by an earlier policy (carried-over groups), whose old_logp_BC is their
  # sampling policy's log-probs; None (the batch has no such row): π_old is this step's policy.
  behaviour_B: jax.Array | None = None
  adv_BC: jax.Array | None = None  # fp32 advantage per token (GAE, REINFORCE++); None: adv_B on every token
  rollout_logp_BC: jax.Array | None = None  # fp32 the sampler's log-probs (mismatch, rollout correction)
  # The shared-prefix layout (`train_step.shared_prefix_layout`; static, so a new pair compiles anew):
  # every prompt begins with the same `prefix_len` real tokens, which the model then runs once per
  # batch, and the rest of each prompt fits in its last `suffix_len` columns. 0: each group's prompt whole.
  prefix_len: int = struct.field(pytree_node=False, default=0)
  suffix_len: int = struct.field(pytree_node=False, default=0)
  # A vision-language model's rows: each row's image vectors (`vision.image_features`, a group's rows
  # alike), placed at its prompt's image placeholders by every pass that scores a token; None: no images.
  images_BMD: jax.Array | None = None
  # fp32 [B, I, C, S, S]: the rows' images' pixels when the tower trains (`model.train_vision`): every pass
  # that scores a token runs its own tower on them instead of reading images_BMD; None: a frozen tower.
  pixels_BICSS: jax.Array | None = None
  # int32 [B, I, 2]: with pixels at native resolution (`VisionConfig.native_resolution`), each image's
  # (h, w) patches (`data.images.grid`); None: S x S images.
  grids_BI2: jax.Array | None = None
  # Routing replay (`model.router_replay="R3"`): int32 [B, C, L_moe, k], the experts the sampler sent each
  # completion token to in every expert layer (-1: none); None: no replay.
  routes_BCLk: jax.Array | None = None
  # A packed micro-batch: the model reads `packed`; tokens_BT / mask_BT then hold the completions
  # alone ([B, C], no prompt columns) and every [B, ...] array has B = D x R row slots.
  packed: PackedRows | None = None


@struct.dataclass
class LMBatch:
  """Language-modelling batch (SFT): predict tokens_BT[:, 1:] where loss_mask_BT[:, 1:]."""
  tokens_BT: jax.Array      # int32 [B, T]
  mask_BT: jax.Array        # bool attention mask
  loss_mask_BT: jax.Array   # bool: positions whose token is a target
  images_BMD: jax.Array | None = None  # a vision-language model's rows: their image vectors (as RLBatch's)
  pixels_BICSS: jax.Array | None = None  # or their images' pixels, which the loss runs the tower on (it trains)
  grids_BI2: jax.Array | None = None  # and their grids at native resolution (as RLBatch's)


@dataclasses.dataclass
class Groups:
  """Scored rollouts on the host (NumPy), one leading entry per prompt group (Q), G responses each."""
  prompt_QP: np.ndarray      # left-padded prompt tokens
  prompt_mask_QP: np.ndarray
  tokens_QGC: np.ndarray     # right-padded completions
  mask_QGC: np.ndarray       # tokens up to and including the first EOS
  length_QG: np.ndarray
  truncated_QG: np.ndarray   # no EOS within the budget
  score_QG: np.ndarray       # the reward: correctness score + overlong penalty
  acc_QG: np.ndarray         # correctness alone
  filter_QG: np.ndarray      # what dynamic sampling compares within a group (`dapo.filter_metric`)
  logp_QGC: np.ndarray       # fp32 log-probs of the tokens under the sampling (behaviour) policy
  carried_Q: np.ndarray      # bool: sampled in an earlier rollout step (carry-over); π_old is logp_QGC
  policy_QGC: np.ndarray | None = None  # episodes: the tokens the policy sampled (None: all of mask_QGC)
  # int32: the policy version (rollout step whose params sampled the row); -1 = not stamped yet
  # (the loop stamps rows as it receives them, `loop.DAPO.stamp`).
  version_QG: np.ndarray | None = None
  # int32: partial rollouts (`rollout.partial_rollouts`): the row's first token sampled by version
  # version_QG + 1, whose params reached the rollout while the row was in flight; -1 = none was.
  switch_QG: np.ndarray | None = None
  # bool: rows in the loss and in their group's statistics; False: an episode whose environment failed
  # (`rollout.env_error="mask"`): no loss token, and its group's advantages are those without it.
  valid_QG: np.ndarray | None = None
  # fp32 [Q, I*M, D]: a vision-language model's prompts' image vectors (`vision.image_features`); M*I = 0
  # for a text model.
  images_QMD: np.ndarray | None = None
  # fp32 [Q, I, C, S, S]: the prompts' images' pixels when the tower trains (`model.train_vision`); I = 0 else.
  pixels_QICSS: np.ndarray | None = None
  # int32 [Q, I, 2]: with those pixels at native resolution, each image's (h, w) patches; I = 0 else.
  grids_QI2: np.ndarray | None = None
  # fp32 [Q, G, K]: the reward's components `dapo.gdpo_reward_keys` names (GDPO normalises each in its
  # group); K = 0 without them.
  parts_QGK: np.ndarray | None = None
  # int32 [Q, G, C, L_moe, k]: routing replay's record, each completion token's experts in every expert
  # layer of the sampler (-1: none; `sampling.Samples.experts_BCLk`); L_moe = k = 0 without one.
  experts_QGCLk: np.ndarray | None = None

  def __post_init__(self):
    if self.policy_QGC is None:
      self.policy_QGC = self.mask_QGC
    if self.version_QG is None:
      self.version_QG = np.full(np.shape(self.length_QG), -1, np.int32)
    if self.switch_QG is None:
      self.switch_QG = np.full(np.shape(self.length_QG), -1, np.int32)
    if self.valid_QG is None:
      self.valid_QG = np.ones(np.shape(self.length_QG), bool)
    if self.images_QMD is None:
      self.images_QMD = np.zeros((len(self.prompt_QP), 0, 0), np.float32)
    if self.pixels_QICSS is None:
      self.pixels_QICSS = np.zeros((len(self.prompt_QP), 0, 0, 0, 0), np.float32)
    if self.grids_QI2 is None:
      self.grids_QI2 = np.zeros((len(self.prompt_QP), 0, 2), np.int32)
    if self.parts_QGK is None:
      self.parts_QGK = np.zeros(np.shape(self.length_QG) + (0,), np.float32)
    if self.experts_QGCLk is None:
      self.experts_QGCLk = np.zeros(np.shape(self.tokens_QGC) + (0, 0), np.int32)

  def __len__(self) -> int:
    return len(self.prompt_QP)

  @classmethod
  def from_samples(cls, prompt_QP, prompt_mask_QP, samples, score_QG, acc_QG, filter_QG, valid_QG=None,
                   images_QMD=None, parts_QGK=None, pixels_QICSS=None, grids_QI2=None) -> "Groups":
    """Q prompts' groups from their Q*G sampled rows (`sampling.Samples`, group-major) and scores."""
    Q, (B, C) = len(prompt_QP), samples.tokens_BC.shape
    G = B // Q
    return cls(prompt_QP=prompt_QP, prompt_mask_QP=prompt_mask_QP, tokens_QGC=samples.tokens_BC.reshape(Q, G, C),
               mask_QGC=samples.mask_BC.reshape(Q, G, C), length_QG=samples.length_B.reshape(Q, G),
               truncated_QG=samples.truncated_B.reshape(Q, G), score_QG=score_QG, acc_QG=acc_QG, filter_QG=filter_QG,
               logp_QGC=samples.logp_BC.reshape(Q, G, C), carried_Q=np.zeros(Q, bool),
               policy_QGC=None if samples.policy_BC is None else samples.policy_BC.reshape(Q, G, C),
               switch_QG=None if samples.switch_B is None else np.asarray(samples.switch_B, np.int32).reshape(Q, G),
               valid_QG=None if valid_QG is None else np.asarray(valid_QG, bool).reshape(Q, G),
               images_QMD=None if images_QMD is None else np.asarray(images_QMD, np.float32),
               pixels_QICSS=None if pixels_QICSS is None else np.asarray(pixels_QICSS, np.float32),
               grids_QI2=None if grids_QI2 is None else np.asarray(grids_QI2, np.int32),
               parts_QGK=None if parts_QGK is None else np.asarray(parts_QGK, np.float32).reshape(Q, G, -1),
               experts_QGCLk=None if samples.experts_BCLk is None else np.asarray(samples.experts_BCLk, np.int32)
               .reshape(Q, G, C, *samples.experts_BCLk.shape[2:]))

  def take(self, idx) -> "Groups":
    return Groups(*(getattr(self, f.name)[idx] for f in dataclasses.fields(self)))

  @staticmethod
  def concat(parts: list["Groups"]) -> "Groups":
    return Groups(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(Groups)))

  def to_json(self) -> dict:
    return {f.name: getattr(self, f.name).tolist() for f in dataclasses.fields(self)} | {
        "dtypes": {f.name: str(getattr(self, f.name).dtype) for f in dataclasses.fields(self)}}

  @staticmethod
  def from_json(d: dict) -> "Groups":
    """Inverse of `to_json`. Groups saved before the behaviour log-probs were kept have none: they
    come back as not carried (logp zeros), so their π_old is recomputed by the current policy."""
    if "policy_QGC" not in d:  # Saved before episodes: every completion token is the policy's.
      d = dict(d, policy_QGC=d["mask_QGC"], dtypes=dict(d["dtypes"], policy_QGC="bool"))
    if "logp_QGC" not in d:
      d = dict(d, logp_QGC=np.zeros(np.shape(d["tokens_QGC"]), np.float32),
               carried_Q=np.zeros(len(d["prompt_QP"]), bool),
               dtypes=dict(d["dtypes"], logp_QGC="float32", carried_Q="bool"))
    if "version_QG" not in d:  # Saved before versions were stamped: unknown (the loop stamps them).
      d = dict(d, version_QG=np.full(np.shape(d["length_QG"]), -1, np.int32),
               dtypes=dict(d["dtypes"], version_QG="int32"))
    if "switch_QG" not in d:  # Saved before partial rollouts: every row had one sampler.
      d = dict(d, switch_QG=np.full(np.shape(d["length_QG"]), -1, np.int32),
               dtypes=dict(d["dtypes"], switch_QG="int32"))
    if "images_QMD" not in d:  # Saved before images: none.
      d = dict(d, images_QMD=np.zeros((len(d["prompt_QP"]), 0, 0), np.float32),
               dtypes=dict(d["dtypes"], images_QMD="float32"))
    if "pixels_QICSS" not in d:  # Saved before the tower trained in RL: no pixels.
      d = dict(d, pixels_QICSS=np.zeros((len(d["prompt_QP"]), 0, 0, 0, 0), np.float32),
               dtypes=dict(d["dtypes"], pixels_QICSS="float32"))
    if "grids_QI2" not in d:  # Saved before native resolution: S x S images.
      d = dict(d, grids_QI2=np.zeros((len(d["prompt_QP"]), 0, 2), np.int32), dtypes=dict(d["dtypes"], grids_QI2="int32"))
    if "valid_QG" not in d:  # Saved before masked rows: every row counts.
      d = dict(d, valid_QG=np.ones(np.shape(d["length_QG"]), bool), dtypes=dict(d["dtypes"], valid_QG="bool"))
    if "parts_QGK" not in d:  # Saved before reward components: none.
      d = dict(d, parts_QGK=np.zeros(np.shape(d["length_QG"]) + (0,), np.float32),
               dtypes=dict(d["dtypes"], parts_QGK="float32"))
    if "experts_QGCLk" not in d:  # Saved before routing replay: no record.
      d = dict(d, experts_QGCLk=np.zeros(np.shape(d["tokens_QGC"]) + (0, 0), np.int32),
               dtypes=dict(d["dtypes"], experts_QGCLk="int32"))
    groups = Groups(*(np.asarray(d[f.name], dtype=d["dtypes"][f.name]) for f in dataclasses.fields(Groups)))
    if groups.images_QMD.ndim != 3:  # No images: JSON lists lose the empty axes.
      groups.images_QMD = groups.images_QMD.reshape(len(groups.prompt_QP), 0, 0)
    if groups.pixels_QICSS.ndim != 5:
      groups.pixels_QICSS = groups.pixels_QICSS.reshape(len(groups.prompt_QP), 0, 0, 0, 0)
    if groups.grids_QI2.ndim != 3:
      groups.grids_QI2 = groups.grids_QI2.reshape(len(groups.prompt_QP), 0, 2)
    if groups.parts_QGK.ndim != 3:  # No components: likewise.
      groups.parts_QGK = groups.parts_QGK.reshape(*groups.length_QG.shape, 0)
    if groups.experts_QGCLk.ndim != 5:  # No record: likewise.
      groups.experts_QGCLk = groups.experts_QGCLk.reshape(*groups.tokens_QGC.shape, 0, 0)
    return groups


@struct.dataclass
class PackedLMBatch:
  """Packed language-modelling batch (SFT on conversations): several documents per row.

  A token attends only to earlier tokens of its own document (`segment_ids_BT`) and positions
  restart at 0 for each document (`conversations.pack`).
  """
  tokens_BT: jax.Array       # int32 [B, T]
  positions_BT: jax.Array    # int32, 0 at each document's first token
  segment_ids_BT: jax.Array  # int32, 1.. per document in a row, 0 = padding
  loss_mask_BT: jax.Array    # bool: tokens that are targets of the loss


@struct.dataclass
class PreferenceBatch:
  """Preference pairs for the reward model and DPO, laid out like the RL batch
  [left-padded prompt | right-padded response]: rows 2i (chosen) and 2i+1 (rejected) share a prompt."""
  tokens_BT: jax.Array      # int32 [2N, P+C]
  mask_BT: jax.Array        # bool: real prompt tokens and response tokens up to and including EOS
  loss_mask_BC: jax.Array   # bool [2N, C]: response tokens
  ref_logp_B: jax.Array     # fp32 Σ log π_ref over the response (DPO; zeros for the reward model)

  @staticmethod
  def from_pairs(tokens_BT: np.ndarray, mask_BT: np.ndarray, response_mask_BC: np.ndarray) -> "PreferenceBatch":
    """From `preference.pair_batch`'s layout (rows 0..N-1 chosen, N..2N-1 rejected) to interleaved pairs."""
    N = tokens_BT.shape[0] // 2
    order = np.stack([np.arange(N), np.arange(N) + N], axis=1).reshape(-1)
    return PreferenceBatch(tokens_BT=tokens_BT[order], mask_BT=mask_BT[order],
                           loss_mask_BC=response_mask_BC[order], ref_logp_B=np.zeros(2 * N, np.float32))


@struct.dataclass
class ValueBatch:
  """PPO critic batch, laid out like `RLBatch`: values predict the return from each completion token's state."""
  tokens_BT: jax.Array      # int32 [B, P+C]
  mask_BT: jax.Array        # bool
  loss_mask_BC: jax.Array   # bool: completion tokens in the loss
  old_values_BC: jax.Array  # fp32 values of the critic that rolled out (clipping centre)
  returns_BC: jax.Array     # fp32 GAE returns (advantages.gae)
  packed: PackedRows | None = None  # A packed micro-batch, as `RLBatch.packed`
  images_BMD: jax.Array | None = None  # a vision-language policy's rows: their image vectors, as `RLBatch`'s
