"""The rollout engine: slots over a preallocated KV cache, chunked prefill, blocked decode.

A sequence lives in one slot from its first turn until `free`. A turn ends (EOS, stop
string, per-turn budget, full context) while the other slots keep decoding; the host then
either appends tokens (an observation plus the next assistant header: only those are
prefilled, the history stays in the cache) or frees the slot for a waiting sequence
(continuous batching). Long inputs are prefilled one chunk per engine step, between decode
blocks, so they never stall the decoding slots for long. A first turn whose prompt starts
with tokens a slot already holds (a GRPO group's rollouts start from one prompt; every agent
prompt starts with the same system prompt) copies that slot's cache rows for the longest
such prefix and prefills only the rest: the values its own prefill computes (for a part of
its prompt, up to the float rounding of prefilling the rest in other chunks).

Every shape the device sees comes from a fixed set of buckets (prefill chunk lengths,
attention windows), so after `warmup()` nothing compiles again.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import itertools
from typing import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from sage_jax import sharding as shd
from sage_jax.model.qwen2 import KVCache, Qwen2
from sage_jax.model.ragged_decode import decode_kernel_for
from sage_jax.sampler import steps
from sage_jax.sampler.sampling import SamplingParams

FINISH_REASONS = ("eos", "stop_string", "max_new_tokens", "context_full")


def _smallest_covering(sizes: Sequence[int], needed: int) -> int:
  """The smallest of the ascending `sizes` that is >= needed (the largest if none is)."""
  return sizes[min(bisect.bisect_left(sizes, needed), len(sizes) - 1)]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static shape of the engine; changing any field means new compilations.

  num_slots: concurrent sequences (decode batch). max_len: cache length per slot, the
  longest sequence. prefill_buckets: prefill chunk lengths; the largest is the chunk size
  that long inputs are split into. min_attend: smallest attention window; windows are
  min_attend * 2^i up to max_len. steps_per_call: decode steps per device call (one host
  sync each). max_top_k: candidates for top-k / top-p (the largest allowed top_k).
  """

  num_slots: int = 8
  max_len: int = 4096
  prefill_buckets: tuple[int, ...] = (32, 128, 512)
  min_attend: int = 256
  steps_per_call: int = 8
  max_top_k: int = 64

  def __post_init__(self):
    buckets = tuple(sorted(set(self.prefill_buckets)))
    object.__setattr__(self, "prefill_buckets", buckets)
    if self.num_slots < 1 or self.steps_per_call < 1 or self.max_top_k < 1:
      raise ValueError(f"{self}: num_slots, steps_per_call and max_top_k must be >= 1")
    if not buckets or buckets[0] < 1 or buckets[-1] > self.max_len:
      raise ValueError(f"prefill_buckets={self.prefill_buckets} must be in [1, max_len="
                       f"{self.max_len}]")
    if self.min_attend < 1:
      raise ValueError(f"min_attend={self.min_attend} must be >= 1")

  @property
  def attend_buckets(self) -> tuple[int, ...]:
    sizes, size = [], self.min_attend
    while size < self.max_len:
      sizes.append(size)
      size *= 2
    return tuple(sizes) + (self.max_len,)


@dataclasses.dataclass(frozen=True)
class TurnResult:
  """One finished turn of a sequence.

  tokens: the sampled ids of this turn (a stop string's turn ends with the token that
  completes it). sample_logprobs / model_logprobs: per token, under the sampling
  distribution and under the unmodified model distribution. prefilled_tokens: input tokens
  the model ingested for this turn: the prompt (prefilled, or in part or whole copied from a
  slot that held its first tokens), or the previous turn's last sampled token plus the
  appended ones. decode_steps: decode steps this sequence ran in the turn (tokens cut after a
  stop string included). length: tokens in the sequence after the turn.
  """

  seq_id: int
  tokens: list[int]
  sample_logprobs: np.ndarray
  model_logprobs: np.ndarray
  finish_reason: str
  prefilled_tokens: int
  decode_steps: int
  length: int


@dataclasses.dataclass
class EngineStats:
  """Engine-wide counters since construction."""

  decode_calls: int = 0
  decode_steps: int = 0
  prefill_calls: int = 0
  prefill_tokens: int = 0
  prefill_padded_tokens: int = 0
  prefill_copied_tokens: int = 0  # prompt tokens copied from a slot holding them
  generated_tokens: int = 0


@dataclasses.dataclass(eq=False)
class _Sequence:
  seq_id: int
  sampling: SamplingParams
  seed: int
  limit: int
  slot: int | None = None
  phase: str = "idle"  # waiting (for a slot) | prefill | decode | idle (between turns)
  length: int = 0  # tokens in the sequence; the last one is not in the cache
  last_token: int = -1
  feed: list[int] = dataclasses.field(default_factory=list)  # still to prefill
  feed_start: int = 0  # position of feed[0]
  tokens: list[int] = dataclasses.field(default_factory=list)  # this turn's
  sample_lps: list[float] = dataclasses.field(default_factory=list)
  model_lps: list[float] = dataclasses.field(default_factory=list)
  prefilled: int = 0
  decode_steps: int = 0
  held: set[int] = dataclasses.field(default_factory=set)  # every id the sequence holds
  prompt: np.ndarray | None = None  # the first turn's input but its last id, until cached


class Engine:
  """Synchronous engine; `AsyncEngine` (driver.py) runs one in a background thread.

  Calls: `start` / `append` queue a turn and return at once; `step` advances the device
  by one prefill chunk and one decode block and returns the turns that finished; `free`
  releases a sequence. Not thread-safe: one thread drives it.

  `eos_ids` end a turn when sampled (none: turns end on their budget or a stop string);
  `detokenize` (ids -> text) is needed for stop strings; with a `mesh`, slots are sharded
  over its data axes and KV heads over its tensor axis, by the model's sharding `rules`.
  """

  def __init__(self, model: Qwen2, config: EngineConfig = EngineConfig(), *,
               eos_ids: Sequence[int], detokenize: Callable[[Sequence[int]], str] | None = None,
               mesh: Mesh | None = None, rules: shd.ShardingRules = shd.ShardingRules()):
    self.config = config
    self.model_config = model.config
    self._eos = tuple(int(i) for i in eos_ids)
    self._detokenize = detokenize
    self._mesh, self._rules = mesh, rules
    self._graphdef, params = nnx.split(model)
    self._param_shardings = (None if mesh is None else
                             shd.state_shardings(params, mesh, rules))
    self._params = self._placed(params)
    cfg = config
    with self._rules_context():
      self._cache = jax.jit(lambda: steps.constrain_cache(
          KVCache.zeros(model.config, cfg.num_slots, cfg.max_len)))()
      self._presence = jax.jit(lambda: steps.empty_presence(cfg.num_slots,
                                                            model.config.vocab_size))()
    self._state = steps.SlotState.empty(cfg.num_slots)
    self._slots: list[_Sequence | None] = [None] * cfg.num_slots
    # The prompt whose keys and values fill the first positions of each slot's cache rows
    # (a first turn's whole input but its last token), kept after its sequence is freed,
    # until a new sequence writes there.
    self._slot_prompts: list[np.ndarray | None] = [None] * cfg.num_slots
    self._seqs: dict[int, _Sequence] = {}
    self._waiting: collections.deque[_Sequence] = collections.deque()
    self._prefilling: collections.deque[_Sequence] = collections.deque()
    self._finished: list[TurnResult] = []
    self._ids = itertools.count()
    self.stats = EngineStats()
    # The ragged decode kernel reads each sequence's keys up to its own length, so decode
    # needs no window smaller than the cache (one compiled decode instead of one per window).
    ragged = decode_kernel_for(model.config.decode_attention_impl, cfg.max_len) == "ragged"
    self._decode_windows = (cfg.max_len,) if ragged else cfg.attend_buckets

  # --- Public API ------------------------------------------------------------------------

  def start(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams(),
            seed: int | None = None) -> int:
    """Queues a new sequence's first turn; returns its id. The turn comes out of `step`.
    `seed` (default: the sequence's id, so that sequences started alike sample apart) fixes
    what the sequence samples, in every turn."""
    self._check_sampling(sampling)
    prompt = self._check_ids(prompt_ids, "prompt_ids")
    if not prompt:
      raise ValueError("prompt_ids is empty")
    seq_id = next(self._ids)
    seq = _Sequence(seq_id=seq_id, sampling=sampling,
                    seed=int(seq_id if seed is None else seed) % 2**32,
                    limit=self._limit(sampling))
    self._seqs[seq.seq_id] = seq
    self._begin_turn(seq, prompt, start=0)
    if seq.phase == "waiting" and seq.feed:
      seq.prompt = np.asarray(seq.feed, np.int32)
    return seq.seq_id

  def append(self, seq_id: int, new_ids: Sequence[int],
             sampling: SamplingParams | None = None) -> None:
    """Queues the next turn of an idle sequence after appending `new_ids` to it.

    Only the new ids (and the last sampled token, never yet ingested) are prefilled.
    `sampling` replaces the sequence's sampling parameters from this turn on.
    """
    seq = self._get(seq_id)
    if seq.phase != "idle":
      raise ValueError(f"sequence {seq_id} is still in a turn ({seq.phase}); "
                       "append only after its turn came back")
    new = self._check_ids(new_ids, "new_ids")
    if not new:
      raise ValueError("new_ids is empty")
    if sampling is not None:
      self._check_sampling(sampling)
      seq.sampling, seq.limit = sampling, self._limit(sampling)
    self._begin_turn(seq, [seq.last_token] + new, start=seq.length - 1)

  def free(self, seq_id: int) -> None:
    """Forgets a sequence and releases its slot; a turn in flight is dropped."""
    seq = self._get(seq_id)
    if seq in self._waiting:
      self._waiting.remove(seq)
    if seq in self._prefilling:
      self._prefilling.remove(seq)
    if seq.slot is not None:
      self._state.active[seq.slot] = False
      self._slots[seq.slot] = None
    del self._seqs[seq_id]

  @property
  def has_work(self) -> bool:
    """Whether `step` can make progress: results to hand out, turns to run, or waiting
    sequences and a free slot. (Idle sequences hold their slots until freed.)"""
    return bool(self._finished or self._prefilling or self._state.active.any()
                or (self._waiting and None in self._slots))

  def step(self) -> list[TurnResult]:
    """Admits waiting sequences, prefills up to one chunk's worth of tokens (all pending
    input when nothing decodes), runs one decode block; returns the finished turns."""
    self._admit()
    decoding = self._state.active.any()
    budget = self.config.prefill_buckets[-1]
    while self._prefilling and (budget > 0 or not decoding):
      budget -= self._prefill_chunk()
    if self._state.active.any():
      self._decode_block()
    finished, self._finished = self._finished, []
    return finished

  def run(self) -> list[TurnResult]:
    """Steps until no turn is in flight; returns the finished turns in order."""
    results = []
    while self.has_work:
      results.extend(self.step())
    self._check_not_stuck()
    return results

  def generate(self, prompts: Sequence[Sequence[int]],
               sampling: SamplingParams | Sequence[SamplingParams],
               seeds: Sequence[int] | None = None) -> list[TurnResult]:
    """One turn for each prompt (continuous batching over the slots), in prompt order.
    `sampling` is one for all prompts or one per prompt; seeds default to 0, 1, ..."""
    seeds = range(len(prompts)) if seeds is None else seeds
    if isinstance(sampling, SamplingParams):
      sampling = [sampling] * len(prompts)
    ids = [self.start(p, sp, s) for p, sp, s in zip(prompts, sampling, seeds, strict=True)]
    by_id = {}
    while self.has_work:
      for result in self.step():
        by_id[result.seq_id] = result
        self.free(result.seq_id)  # Its slot goes to the next waiting prompt.
    self._check_not_stuck()
    return [by_id[i] for i in ids]

  def _check_not_stuck(self) -> None:
    if self._waiting:
      raise RuntimeError(f"{len(self._waiting)} sequence(s) wait for a slot, but every slot "
                         "holds a sequence between turns; free some (Engine.free)")

  def update_params(self, new: Qwen2 | nnx.State) -> None:
    """Samples from `new` (a model or its state, same structure) from the next call on.

    The arrays are used as they are when already in the engine's sharding (no copy);
    otherwise they are moved device to device. Nothing recompiles. Prompts cached under the
    old weights are not copied to new sequences.
    """
    state = nnx.state(new) if isinstance(new, nnx.Module) else new
    avals = lambda tree: [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]
    if (jax.tree.structure(state) != jax.tree.structure(self._params)
        or avals(state) != avals(self._params)):
      raise ValueError("update_params: the new parameters do not match the engine's model "
                       "(structure, shapes or dtypes differ)")
    self._params = self._placed(state)
    self._slot_prompts = [None] * self.config.num_slots
    for seq in self._prefilling:
      if seq.feed_start > 0:  # partly prefilled under the old weights
        seq.prompt = None

  @property
  def weights(self) -> tuple[nnx.GraphDef, nnx.State]:
    """(graph, params) of the model the engine samples with now, for other read-only uses of
    the same weights (the policy's embedding in retrieval)."""
    return self._graphdef, self._params

  def warmup(self) -> None:
    """Compiles every prefill and decode shape the engine can use (no cache writes)."""
    cfg = self.config
    tokens_for = lambda t: np.zeros(t, np.int32)
    for t in cfg.prefill_buckets:
      for a in cfg.attend_buckets:
        if a >= self._attend_bucket(t):
          self._run_prefill(tokens_for(t), slot=0, start=0, length=0, attend_len=a)
    idle = steps.SlotState.empty(cfg.num_slots)
    for a in self._decode_windows:
      self._run_decode(idle, a)
    for a in cfg.attend_buckets:
      self._copy_prompt(0, 0, [], a)  # all padding: slot 0 onto itself, presence unchanged
    self._unmark(0, set())  # all padding: clears nothing

  # --- Turns -----------------------------------------------------------------------------

  def _limit(self, sampling: SamplingParams) -> int:
    if sampling.max_context is not None and sampling.max_context > self.config.max_len:
      raise ValueError(f"max_context={sampling.max_context} exceeds the engine's max_len="
                       f"{self.config.max_len}")
    return sampling.max_context or self.config.max_len

  def _check_sampling(self, sampling: SamplingParams) -> None:
    if sampling.top_k > self.config.max_top_k:
      raise ValueError(f"top_k={sampling.top_k} exceeds the engine's max_top_k="
                       f"{self.config.max_top_k}")
    if sampling.stop_strings and self._detokenize is None:
      raise ValueError("stop_strings need an engine built with detokenize=")

  def _check_ids(self, ids: Sequence[int], name: str) -> list[int]:
    ids = [int(i) for i in ids]
    self.model_config.check_token_ids(ids, name)
    return ids

  def _get(self, seq_id: int) -> _Sequence:
    try:
      return self._seqs[seq_id]
    except KeyError:
      raise KeyError(f"unknown sequence id {seq_id} (never started, or freed)") from None

  def _begin_turn(self, seq: _Sequence, inputs: list[int], start: int) -> None:
    """Starts a turn that first ingests `inputs` at positions start..; the last input
    token becomes the slot's first decode input."""
    seq.tokens, seq.sample_lps, seq.model_lps = [], [], []
    seq.prefilled, seq.decode_steps = len(inputs), 0
    # start < 0: the prompt never fit, there is nothing to continue.
    if start < 0 or start + len(inputs) + 1 > seq.limit:
      seq.prefilled = 0
      self._finish(seq, "context_full")
      return
    seq.feed, seq.feed_start = inputs[:-1], start
    seq.length, seq.last_token = start + len(inputs), inputs[-1]
    seq.held.update(inputs)
    if seq.slot is None:
      seq.phase = "waiting"
      self._waiting.append(seq)
    else:
      seq.phase = "prefill"
      self._prefilling.append(seq)

  def _finish(self, seq: _Sequence, reason: str) -> None:
    seq.phase = "idle"
    self._finished.append(TurnResult(
        seq_id=seq.seq_id, tokens=seq.tokens,
        sample_logprobs=np.asarray(seq.sample_lps, np.float32),
        model_logprobs=np.asarray(seq.model_lps, np.float32), finish_reason=reason,
        prefilled_tokens=seq.prefilled, decode_steps=seq.decode_steps, length=seq.length))

  def _admit(self) -> None:
    """Gives waiting sequences free slots: one that holds the sequence's prompt, else one that
    holds no prompt, else any. A slot's prompt stays held until its new sequence's first
    prefill (`_prefill_chunk`), so that prompts sharing its first tokens can still copy them."""
    while self._waiting and None in self._slots:
      seq = self._waiting.popleft()
      free = [s for s, held in enumerate(self._slots) if held is None]
      seq.slot = min(free, key=lambda s: (not self._holds_whole(s, seq.prompt),
                                          self._slot_prompts[s] is not None, s))
      if seq.prompt is None:
        self._slot_prompts[seq.slot] = None  # the new sequence writes from position 0
      self._slots[seq.slot] = seq
      seq.phase = "prefill"
      self._prefilling.append(seq)

  def _holds_whole(self, slot: int, prompt: np.ndarray | None) -> bool:
    held = self._slot_prompts[slot]
    return prompt is not None and held is not None and np.array_equal(held, prompt)

  def _longest_held_prefix(self, prompt: np.ndarray) -> tuple[int, int]:
    """(slot, n): a slot whose held prompt starts with the first n tokens of `prompt`, n the
    largest (0 if none does)."""
    best = (0, 0)
    for slot, held in enumerate(self._slot_prompts):
      if held is not None:
        n = min(len(held), len(prompt))
        differ = np.flatnonzero(held[:n] != prompt[:n])
        n = int(differ[0]) if differ.size else n
        best = max(best, (n, -slot))
    return -best[1], best[0]

  def _activate(self, seq: _Sequence) -> None:
    s, st, sp = seq.slot, self._state, seq.sampling
    st.tokens[s], st.positions[s], st.active[s] = seq.last_token, seq.length - 1, True
    st.remaining[s], st.limits[s] = sp.max_new_tokens, seq.limit
    st.temperature[s], st.top_p[s], st.top_k[s] = sp.temperature, sp.top_p, sp.top_k
    st.min_p[s], st.repetition_penalty[s] = sp.min_p, sp.repetition_penalty
    st.seeds[s] = seq.seed
    seq.phase = "decode"

  # --- Device calls ----------------------------------------------------------------------

  def _rules_context(self):
    if self._mesh is None:
      return contextlib.nullcontext()
    return shd.use_rules(self._mesh, self._rules)

  def _placed(self, params: nnx.State) -> nnx.State:
    return params if self._mesh is None else jax.device_put(params, self._param_shardings)

  def _attend_bucket(self, needed: int) -> int:
    return _smallest_covering(self.config.attend_buckets, needed)

  def _run_prefill(self, tokens: np.ndarray, *, slot: int, start: int, length: int,
                   attend_len: int) -> None:
    with self._rules_context():
      self._cache, self._presence = steps.prefill(
          self._graphdef, self._params, self._cache, self._presence, tokens, np.int32(slot),
          np.int32(start), np.int32(length), attend_len=attend_len)

  def _run_decode(self, state: steps.SlotState,
                  attend_len: int) -> tuple[steps.SlotState, steps.BlockOutput]:
    with self._rules_context():
      self._cache, self._presence, state, out = steps.decode(
          self._graphdef, self._params, self._cache, self._presence, state,
          num_steps=self.config.steps_per_call, attend_len=attend_len, eos_ids=self._eos,
          candidates=self.config.max_top_k)
    return state, out

  def _copy_prompt(self, src: int, dst: int, prompt: Sequence[int], span: int) -> None:
    padded = np.full(span, self.model_config.vocab_size, np.int32)
    padded[:len(prompt)] = prompt
    with self._rules_context():
      self._cache, self._presence = steps.copy_prompt(
          self._cache, self._presence, np.int32(src), np.int32(dst), padded, span=span)

  def _unmark(self, slot: int, ids: set[int]) -> None:
    """Takes `ids` out of the slot's presence row (no more than a decode block's)."""
    padded = np.full(self.config.steps_per_call, self.model_config.vocab_size, np.int32)
    padded[:len(ids)] = sorted(ids)
    with self._rules_context():
      self._presence = steps.unmark(self._presence, np.int32(slot), padded)

  def _prefill_chunk(self) -> int:
    """Prefills the next chunk of the oldest pending input; returns its length. A first turn
    starts by copying the longest prefix of its prompt that a slot holds, when that prefix is
    its whole prompt or at least the smallest prefill chunk (every chat prompt shares its
    first few tokens: not worth a device call of their own)."""
    seq = self._prefilling[0]
    if seq.prompt is not None and seq.feed_start == 0:
      src, shared = self._longest_held_prefix(seq.prompt)
      if not self._holds_whole(seq.slot, seq.prompt):
        self._slot_prompts[seq.slot] = None  # the sequence writes its own prompt from here
      if shared == len(seq.prompt) or shared >= self.config.prefill_buckets[0]:
        self._copy_prompt(src, seq.slot, seq.prompt[:shared], self._attend_bucket(shared))
        self.stats.prefill_copied_tokens += shared
        seq.feed, seq.feed_start = seq.feed[shared:], shared
    buckets = self.config.prefill_buckets
    chunk = seq.feed[:buckets[-1]]
    if chunk:
      size = buckets[bisect.bisect_left(buckets, len(chunk))]
      tokens = np.zeros(size, np.int32)
      tokens[:len(chunk)] = chunk
      attend = self._attend_bucket(max(seq.feed_start + len(chunk), size))
      self._run_prefill(tokens, slot=seq.slot, start=seq.feed_start, length=len(chunk),
                        attend_len=attend)
      self.stats.prefill_calls += 1
      self.stats.prefill_tokens += len(chunk)
      self.stats.prefill_padded_tokens += size
      seq.feed, seq.feed_start = seq.feed[len(chunk):], seq.feed_start + len(chunk)
    if not seq.feed:
      if seq.prompt is not None:
        self._slot_prompts[seq.slot], seq.prompt = seq.prompt, None
      self._prefilling.popleft()
      self._activate(seq)
    return len(chunk)

  def _decode_block(self) -> None:
    st, cfg = self._state, self.config
    needed = int(st.positions[st.active].max()) + cfg.steps_per_call
    state, out = self._run_decode(st, _smallest_covering(self._decode_windows, needed))
    state, out = jax.device_get((state, out))
    self._state = jax.tree.map(np.array, state)
    self.stats.decode_calls += 1
    self.stats.decode_steps += int(out.steps)
    for seq in self._slots:
      if seq is not None and seq.phase == "decode":
        self._collect(seq, out)

  def _collect(self, seq: _Sequence, out: steps.BlockOutput) -> None:
    """Moves a slot's new tokens into its turn and ends the turn if it stopped."""
    s, st = seq.slot, self._state
    n = int((out.tokens[s] >= 0).sum())
    first = len(seq.tokens)
    seq.tokens.extend(int(t) for t in out.tokens[s, :n])
    seq.sample_lps.extend(out.sample_logprobs[s, :n].tolist())
    seq.model_lps.extend(out.model_logprobs[s, :n].tolist())
    seq.decode_steps += n
    self.stats.generated_tokens += n
    cut = self._stop_string_end(seq, first)
    if cut is not None:
      ingested = seq.tokens[cut:first + n - 1]  # decode inputs after the cut: marked present
      del seq.tokens[cut:], seq.sample_lps[cut:], seq.model_lps[cut:]
      seq.held.update(seq.tokens[first:])
      stale = set(ingested) - seq.held
      if stale:
        self._unmark(s, stale)
      seq.length = int(st.positions[s]) + 1 - (first + n - cut)
      seq.last_token = seq.tokens[-1]
      st.active[s], st.tokens[s], st.positions[s] = False, seq.last_token, seq.length - 1
      self._finish(seq, "stop_string")
      return
    seq.held.update(seq.tokens[first:])
    seq.length, seq.last_token = int(st.positions[s]) + 1, int(st.tokens[s])
    if st.active[s]:
      return
    if seq.last_token in self._eos:
      self._finish(seq, "eos")
    elif seq.length + 1 > seq.limit:
      self._finish(seq, "context_full")
    else:
      self._finish(seq, "max_new_tokens")

  def _stop_string_end(self, seq: _Sequence, first: int) -> int | None:
    """Length of the turn up to the first token (at index >= first) that completes a stop
    string, or None. Each check decodes a window just long enough to hold a stop string."""
    stops = seq.sampling.stop_strings
    if not stops:
      return None
    window = max(len(s.encode()) for s in stops) + 1
    for i in range(first, len(seq.tokens)):
      text = self._detokenize(seq.tokens[max(0, i + 1 - window):i + 1])
      if any(s in text for s in stops):
        return i + 1
    return None
