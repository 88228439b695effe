"""Episode records -> packed, length-bucketed device batches for the update.

A record is anything with these attributes or mapping keys (numpy-like, one entry per token of
the whole conversation, exactly the ids the sampler produced and the observations appended):

  tokens            int   [L]  every id of the conversation
  loss_mask         int/bool [L]  1 on tokens the model generated, 0 elsewhere
  sampler_logprobs  float [L]  logprob under the sampling distribution (0 where mask is 0)
  model_logprobs    float [L]  logprob under the unmodified model at sampling time (pi_old)
  advantage         float      scalar, set after rewards and advantages

SFT records need only `tokens` and `loss_mask` (advantage 1, logprobs 0).

The shift. Token i is predicted by the logits at position i - 1. A record of length L becomes
L - 1 input positions: position j holds input `tokens[j]` and target `tokens[j + 1]`, and every
per-token field (mask, logprobs, advantage) is taken at the target, index j + 1. Token 0 has no
prediction, so its mask must be 0 (it is `<|im_start|>` of the system turn in practice).

Layout. Rows of `T` positions hold one (padding) or several (packing) sequences; each packed
sequence restarts positions at 0 and carries its own segment id (1, 2, ...; 0 = padding), so
attention never crosses sequences. `rows_per_micro_batch` rows make a micro-batch and
`num_micro_batches` micro-batches make a `TrainBatch` of shape [M, R, T]. `T` is the smallest
length bucket for which every sequence fits into M x R rows (quadratic attention prefers short
rows); rows stay within the micro-batch token budget, and sequences that do not fit take more
micro-batches (M times a power of two), so a run compiles few train-step variants.

Normalisation. Per-token loss weights are computed here over the whole batch, so the loss of
a batch is `sum(weights * per_token_loss)` whatever the micro-batch split: gradient
accumulation over micro-batches is exact.

Several processes. Each process packs its own sequences into its own rows of the global
batch. Given `allgather` (e.g. `multihost.allgather`), the processes agree on one layout
(row length, rows per process, micro-batches) from the rows each would need per bucket, and
the weights use the global token and sequence counts: the global batch has exactly the loss
of one process packing every sequence.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Literal, Mapping, Sequence

import jax
import numpy as np

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                      "seq-mean-token-sum-norm"]
AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                 "seq-mean-token-sum-norm")

_FIELDS_INT = ("tokens", "positions", "segment_ids", "targets")
_FIELDS_FLOAT = ("loss_mask", "weights", "advantages", "old_logprobs", "sampler_logprobs",
                 "ref_logprobs")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainBatch:
  """Per-position arrays, all the same shape ([M, R, T] for a batch, [R, T] for one
  micro-batch). Position j of a row predicts `targets[j]` from `tokens[..j]`.

  tokens / targets: input and next ids (int32). positions: position inside its sequence.
  segment_ids: 1.. per packed sequence, 0 = padding. loss_mask: 1.0 where the target is a
  model token. weights: the target's share of the batch loss (0 off the mask).
  advantages: the sequence's advantage on every masked target. old_logprobs: pi_old of the
  target (ratio denominator). sampler_logprobs: the sampler's logprob of the target.
  ref_logprobs: the frozen reference's logprob (filled by the trainer when KL is on).
  """

  tokens: Any
  positions: Any
  segment_ids: Any
  targets: Any
  loss_mask: Any
  weights: Any
  advantages: Any
  old_logprobs: Any
  sampler_logprobs: Any
  ref_logprobs: Any

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.tokens.shape)

  def replace(self, **changes) -> "TrainBatch":
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a sequence's L - 1 positions landed: batch[micro, row, offset:offset + length]."""

  micro: int
  row: int
  offset: int
  length: int


@dataclasses.dataclass(frozen=True)
class BatchInfo:
  """Host-side facts about a packed batch (for metrics and for scattering results back).
  `total_positions` counts the micro-batches that hold sequences: the train step skips the
  others."""

  placements: tuple[Placement, ...]
  num_sequences: int
  real_positions: int  # positions holding a sequence (sum of L - 1)
  total_positions: int  # R * T * micro-batches holding sequences
  loss_tokens: int  # masked targets

  @property
  def padding_fraction(self) -> float:
    return 1.0 - self.real_positions / max(self.total_positions, 1)


@dataclasses.dataclass(frozen=True)
class BatchConfig:
  """How sequences are laid out for one train step.

  micro_batch_tokens: token budget of one micro-batch (rows x row length), which bounds the
    update's activation memory: rows per micro-batch = micro_batch_tokens // T (at least 1),
    rounded up to `row_multiple`. A micro-batch exceeds the budget only when the rows that
    hold the longest sequence must (the shortest bucket that holds it).
  num_micro_batches: gradient-accumulation steps per train step. If the sequences do not fit
    in that many, more micro-batches are used, in the allowed bucket that needs the fewest
    positions, their count rounded up to num_micro_batches times a power of two (the
    padding micro-batches are skipped by the train step), so a run compiles few variants.
  length_buckets: allowed row lengths T; the longest sequence (minus one) must fit the
    largest.
  pack: several sequences per row (segment ids keep them apart); False gives one sequence
    per row (padding, still bucketed).
  row_multiple: rows per micro-batch are a multiple of this (the data-parallel size, so
    rows split evenly over devices).
  """

  micro_batch_tokens: int = 16384
  num_micro_batches: int = 1
  length_buckets: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
  pack: bool = True
  row_multiple: int = 1

  def __post_init__(self):
    buckets = tuple(sorted(set(int(b) for b in self.length_buckets)))
    object.__setattr__(self, "length_buckets", buckets)
    if not buckets or buckets[0] < 1:
      raise ValueError(f"length_buckets={self.length_buckets} must be positive")
    if self.micro_batch_tokens < 1 or self.num_micro_batches < 1 or self.row_multiple < 1:
      raise ValueError(f"{self}: micro_batch_tokens, num_micro_batches and row_multiple "
                       "must be >= 1")

  def rows_per_micro_batch(self, row_len: int) -> int:
    rows = max(1, self.micro_batch_tokens // row_len)
    return -(-rows // self.row_multiple) * self.row_multiple


# --- Records ------------------------------------------------------------------------------


def _get(record: Any, name: str, default: Any = None) -> Any:
  if isinstance(record, Mapping):
    return record.get(name, default)
  return getattr(record, name, default)


@dataclasses.dataclass(frozen=True)
class _Seq:
  tokens: np.ndarray
  mask: np.ndarray
  sampler_lp: np.ndarray
  model_lp: np.ndarray
  advantage: float


def _read(record: Any, index: int, need_advantage: bool) -> _Seq:
  tokens = _get(record, "tokens")
  mask = _get(record, "loss_mask")
  if tokens is None or mask is None:
    raise ValueError(f"sequence {index}: needs `tokens` and `loss_mask`")
  tokens = np.asarray(tokens, np.int32).reshape(-1)
  mask = np.asarray(mask).reshape(-1).astype(np.float32)
  n = tokens.shape[0]
  if n < 2:
    raise ValueError(f"sequence {index}: {n} tokens; need at least 2")
  if mask.shape[0] != n:
    raise ValueError(f"sequence {index}: loss_mask has {mask.shape[0]} entries, tokens {n}")
  if not np.isin(mask, (0.0, 1.0)).all():
    raise ValueError(f"sequence {index}: loss_mask must hold only 0 and 1")
  if mask[0]:
    raise ValueError(f"sequence {index}: token 0 is masked for the loss, but nothing "
                     "predicts the first token")

  def per_token(name):
    value = _get(record, name)
    if value is None:
      return np.zeros(n, np.float32)
    value = np.asarray(value, np.float32).reshape(-1)
    if value.shape[0] != n:
      raise ValueError(f"sequence {index}: {name} has {value.shape[0]} entries, tokens {n}")
    return value

  advantage = _get(record, "advantage")
  if advantage is None:
    if need_advantage:
      raise ValueError(f"sequence {index}: no advantage (set it after rewards/advantages)")
    advantage = 1.0
  advantage = float(advantage)
  if not math.isfinite(advantage):
    raise ValueError(f"sequence {index}: advantage {advantage} is not finite")
  return _Seq(tokens, mask, per_token("sampler_logprobs"), per_token("model_logprobs"),
              advantage)


# --- Loss weights -------------------------------------------------------------------------


def loss_weights(masks: Sequence[np.ndarray], aggregation: str = "token-mean",
                 norm_constant: float | None = None, *, total_tokens: float | None = None,
                 trained_sequences: int | None = None) -> list[np.ndarray]:
  """Each sequence's per-token weight so that the batch loss is sum(weight * token_loss).

  The modes and their results are verl's `agg_loss` (and tunix's) on the batch's loss matrix:
  token-mean: every masked token of the batch counts the same (1 / masked tokens of the batch).
  seq-mean-token-mean: mean over sequences of each sequence's token mean.
  seq-mean-token-sum: mean over sequences of each sequence's token sum.
  seq-mean-token-sum-norm (Dr.GRPO): the sum over every masked token of the batch divided by
    a constant (`norm_constant`, e.g. the generation budget), whatever the number of
    sequences. The Dr.GRPO paper's form, the mean over sequences of sum / constant, is
    seq-mean-token-sum at a learning rate divided by the constant.
  A sequence without masked tokens (an episode that ended before its first sample) contributes
  nothing and, as in verl and tunix, is not counted by the sequence means.
  `total_tokens` / `trained_sequences` (masked tokens; sequences holding one) are the batch's
  counts when `masks` are one process's part of it (default: the counts of `masks`).
  """
  masks = [np.asarray(m, np.float32) for m in masks]
  n = sum(1 for m in masks if m.any()) if trained_sequences is None else trained_sequences
  if not masks:
    return []
  if aggregation == "token-mean":
    total = sum(float(m.sum()) for m in masks) if total_tokens is None else total_tokens
    return [m / total if total else m * 0 for m in masks]
  if aggregation == "seq-mean-token-mean":
    return [m / (n * m.sum()) if m.sum() else m * 0 for m in masks]
  if aggregation == "seq-mean-token-sum":
    return [m / n if n else m * 0 for m in masks]
  if aggregation == "seq-mean-token-sum-norm":
    if not norm_constant or norm_constant <= 0:
      raise ValueError("seq-mean-token-sum-norm needs a positive norm_constant")
    return [m / float(norm_constant) for m in masks]
  raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {AGGREGATIONS}")


# --- Packing ------------------------------------------------------------------------------


def _pack_rows(lengths: Sequence[int], row_len: int, pack: bool) -> list[list[int]]:
  """First-fit decreasing: lists of sequence indices per row (each row's total <= row_len)."""
  order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
  if not pack:
    return [[i] for i in order]
  rows: list[list[int]] = []
  free: list[int] = []
  for i in order:
    for r, space in enumerate(free):
      if lengths[i] <= space:
        rows[r].append(i)
        free[r] -= lengths[i]
        break
    else:
      rows.append([i])
      free.append(row_len - lengths[i])
  return rows


def _rows_per_process(config: BatchConfig, row_len: int, num_processes: int) -> int:
  """Rows of one process in a micro-batch: the global rows rounded up to split evenly."""
  rows = config.rows_per_micro_batch(row_len)
  step = math.lcm(config.row_multiple, num_processes)
  return -(-rows // step) * step // num_processes


def _choose_layout(lengths: Sequence[int], config: BatchConfig,
                   allgather: Callable[[np.ndarray], np.ndarray] | None):
  """(row_len, rows per process per micro-batch, micro-batches, of which hold sequences,
  processes, this process's rows as lists of sequence indices)."""
  buckets = config.length_buckets
  packed = {b: _pack_rows(lengths, b, config.pack) for b in buckets
            if not lengths or b >= max(lengths)}
  needed = np.asarray([len(packed[b]) if b in packed else -1 for b in buckets], np.int64)
  every = needed[None] if allgather is None else np.asarray(allgather(needed))
  num_processes = every.shape[0]
  fits = [i for i, b in enumerate(buckets) if (every[:, i] >= 0).all()]
  if not fits:
    longest = max(lengths, default=0)
    if longest > buckets[-1]:
      raise ValueError(f"a sequence needs {longest} positions (length - 1), more than the "
                       f"largest length bucket {buckets[-1]}")
    raise ValueError(f"a sequence of another process needs more positions (length - 1) than "
                     f"the largest length bucket {buckets[-1]}; this process's longest needs "
                     f"{longest}")
  # Micro-batches over the budget would trade gradient-accumulation steps for the quadratic
  # attention and activations the budget was set to avoid: only the shortest rows that hold
  # the longest sequence may exceed it.
  layouts = []  # (row_len, rows, micro-batches holding sequences)
  for i in fits:
    r = _rows_per_process(config, buckets[i], num_processes)
    if i == fits[0] or r * num_processes * buckets[i] <= config.micro_batch_tokens:
      layouts.append((buckets[i], r, -(-int(every[:, i].max()) // r)))
  m = config.num_micro_batches
  fitting = [lay for lay in layouts if lay[2] <= m]
  if fitting:  # the shortest rows that fit in num_micro_batches
    row_len, r, used = fitting[0]
  else:
    # More micro-batches, with the layout that has the fewest positions (ties: the shorter
    # rows), their count rounded up to m times a power of two.
    row_len, r, used = min(layouts, key=lambda lay: (lay[2] * lay[1] * lay[0], lay[0]))
    m *= 1 << (-(-used // m) - 1).bit_length()
  return row_len, r, m, used, num_processes, packed.get(row_len, [])


def make_batch(records: Sequence[Any], config: BatchConfig = BatchConfig(), *,
               aggregation: str = "token-mean", norm_constant: float | None = None,
               need_advantage: bool = True,
               allgather: Callable[[np.ndarray], np.ndarray] | None = None
               ) -> tuple[TrainBatch, BatchInfo]:
  """Packs `records` into one numpy `TrainBatch` [M, R, T] plus where each one landed.

  With `allgather` (one call per process, same order everywhere), `records` are this
  process's part of the batch and the result is its rows [M, R / processes, T] of the global
  batch; BatchInfo's counts are then global. A process may then have no records.
  """
  if not records and allgather is None:
    raise ValueError("make_batch needs at least one sequence")
  seqs = [_read(r, i, need_advantage) for i, r in enumerate(records)]
  lengths = [s.tokens.shape[0] - 1 for s in seqs]
  masks = [s.mask[1:] for s in seqs]
  counts = np.asarray([sum(float(m.sum()) for m in masks), len(seqs), sum(lengths),
                       sum(1 for m in masks if m.any())], np.float64)
  if allgather is not None:
    counts = np.asarray(allgather(counts)).sum(0)
  loss_tokens, num_sequences, real_positions, trained = (float(counts[0]), int(counts[1]),
                                                         int(counts[2]), int(counts[3]))
  row_len, r, m, used, num_processes, rows = _choose_layout(lengths, config, allgather)
  weights = loss_weights(masks, aggregation, norm_constant, total_tokens=loss_tokens,
                         trained_sequences=trained)

  shape = (m * r, row_len)
  out = {f: np.zeros(shape, np.int32) for f in _FIELDS_INT}
  out.update({f: np.zeros(shape, np.float32) for f in _FIELDS_FLOAT})
  placements: list[Placement | None] = [None] * len(seqs)
  for row, members in enumerate(rows):
    offset = 0
    for seg, i in enumerate(members, start=1):
      s, n = seqs[i], lengths[i]
      sl = slice(offset, offset + n)
      out["tokens"][row, sl] = s.tokens[:-1]
      out["targets"][row, sl] = s.tokens[1:]
      out["positions"][row, sl] = np.arange(n)
      out["segment_ids"][row, sl] = seg
      out["loss_mask"][row, sl] = s.mask[1:]
      out["weights"][row, sl] = weights[i]
      out["advantages"][row, sl] = s.advantage * s.mask[1:]
      out["old_logprobs"][row, sl] = s.model_lp[1:] * s.mask[1:]
      out["sampler_logprobs"][row, sl] = s.sampler_lp[1:] * s.mask[1:]
      placements[i] = Placement(row // r, row % r, offset, n)
      offset += n
  batch = TrainBatch(**{k: v.reshape(m, r, row_len) for k, v in out.items()})
  info = BatchInfo(placements=tuple(placements), num_sequences=num_sequences,
                   real_positions=real_positions,
                   total_positions=used * r * num_processes * row_len,
                   loss_tokens=int(loss_tokens))
  return batch, info


def gather(values: np.ndarray, info: BatchInfo) -> list[np.ndarray]:
  """Per-sequence slices of a [M, R, T] array: entry k of sequence i is about its token k + 1."""
  values = np.asarray(values)
  return [values[p.micro, p.row, p.offset:p.offset + p.length] for p in info.placements]


def micro_batches(batch: TrainBatch) -> list[TrainBatch]:
  """The M micro-batches [R, T] of a batch [M, R, T]."""
  m = batch.shape[0]
  return [jax.tree.map(lambda x, i=i: x[i], batch) for i in range(m)]


def stack_micro_batches(micros: Sequence[TrainBatch]) -> TrainBatch:
  """Inverse of `micro_batches`."""
  return jax.tree.map(lambda *xs: np.stack(xs), *micros)


def split_mini_batches(records: Sequence[Any], num_mini_batches: int,
                       rng: np.random.Generator | None = None) -> list[list[Any]]:
  """Splits a rollout batch into `num_mini_batches` nearly equal groups (shuffled by `rng`
  when given, else in order), one optimiser update each. With fewer records than groups some
  groups are empty: in a multi-process batch every process must take part in each update,
  even one that holds few or no records (dynamic sampling, environment failures)."""
  if num_mini_batches < 1:
    raise ValueError(f"num_mini_batches={num_mini_batches} must be >= 1")
  order = np.arange(len(records)) if rng is None else rng.permutation(len(records))
  return [[records[i] for i in part] for part in np.array_split(order, num_mini_batches)]
