"""The engine's jitted device functions: chunked prefill into one slot, a block of decode
steps over all slots, and a prompt's cache rows copied from one slot to another. Prefill and
decode take the model as (graphdef, params), the graphdef static, so engines over models of
one architecture share compilations; all three donate the cache and the presence marks.

Cache layout (see `KVCache`): the token at position p of the sequence in slot s lives at
cache row s, index p. A sequence's last token is never in the cache: it is the slot's
next decode input (`SlotState.tokens`), so prefill handles all but the last token of new
input and the first decode step ingests the last one while sampling the next.

Presence (for the repetition penalty): [slots, vocab] bool, which ids the sequence in each slot
holds. It follows the cache: each token is marked when the model ingests it (in prefill, or
as a decode input), and a slot's row starts afresh when its position 0 is written (a new
sequence's first prefill chunk or prompt copy, or the first decode step of a one-token
prompt). Marking is a scatter of the ingested ids only; reading it costs something only in
a batch where some row has a penalty. Ids a block ingested past a stop string, which the host
cuts off, are taken back (`unmark`) unless the sequence holds them elsewhere.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sage_jax.model.qwen2 import KVCache
from sage_jax.sampler.sampling import sample
from sage_jax.sharding import CACHE_AXES, constrain

# Presence rows go with the cache's: slots over the data axes.
PRESENCE_AXES = ("cache_batch", None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
  """Per-slot decode state, one entry per slot.

  tokens: next decode input (int32), not yet in the cache; positions: its position;
  active: whether the slot decodes; remaining: tokens the turn may still generate;
  limits: most tokens the sequence may hold; temperature / top_p / top_k / min_p /
  repetition_penalty / seeds: sampling.
  """

  tokens: jax.Array
  positions: jax.Array
  active: jax.Array
  remaining: jax.Array
  limits: jax.Array
  temperature: jax.Array
  top_p: jax.Array
  top_k: jax.Array
  min_p: jax.Array
  repetition_penalty: jax.Array
  seeds: jax.Array

  @classmethod
  def empty(cls, num_slots: int) -> "SlotState":
    """Host (numpy) state with every slot idle."""
    zeros = lambda dtype: np.zeros(num_slots, dtype)
    return cls(tokens=zeros(np.int32), positions=zeros(np.int32), active=zeros(np.bool_),
               remaining=zeros(np.int32), limits=zeros(np.int32),
               temperature=zeros(np.float32), top_p=np.ones(num_slots, np.float32),
               top_k=zeros(np.int32), min_p=zeros(np.float32),
               repetition_penalty=np.ones(num_slots, np.float32), seeds=zeros(np.uint32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BlockOutput:
  """What a decode block produced: [slots, steps] tokens (-1 where a slot produced none),
  their sampling and model logprobs, and the number of steps that ran."""

  tokens: jax.Array
  sample_logprobs: jax.Array
  model_logprobs: jax.Array
  steps: jax.Array


def constrain_cache(cache: KVCache) -> KVCache:
  """Pins the cache to its sharding (slots over data axes, KV heads over tensor), so every
  call returns it in the layout the next call was compiled for."""
  return KVCache([constrain(k, CACHE_AXES) for k in cache.k],
                 [constrain(v, CACHE_AXES) for v in cache.v])


def empty_presence(num_slots: int, vocab: int) -> jax.Array:
  """Presence with no id marked, in its sharding (to call under jit)."""
  return constrain(jnp.zeros((num_slots, vocab), jnp.bool_), PRESENCE_AXES)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("attend_len",),
                   donate_argnames=("cache", "presence"))
def prefill(graphdef: nnx.GraphDef, params: nnx.State, cache: KVCache, presence: jax.Array,
            tokens: jax.Array, slot: jax.Array, start: jax.Array, length: jax.Array, *,
            attend_len: int) -> tuple[KVCache, jax.Array]:
  """Writes tokens[:length] (tokens: [chunk] int32) at positions start.. of `slot`, in the
  cache and in the slot's presence row.

  Only the slot's cache row takes part; the rest of the chunk is padding and writes nothing.
  Needs start + length <= attend_len.
  """
  model = nnx.merge(graphdef, params)
  idx = jnp.arange(tokens.shape[0])
  positions = jnp.where(idx < length, start + idx, cache.max_len)[None]
  row = lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=0)
  rows = KVCache([row(k) for k in cache.k], [row(v) for v in cache.v])
  _, rows = model.hidden_states(tokens[None], positions, cache=rows, attend_len=attend_len)
  put = lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r, slot, axis=0)
  held = jnp.where((start == 0) & (length > 0), False, row(presence)[0])  # a new sequence
  held = held.at[jnp.where(idx < length, tokens, held.shape[0])].set(True, mode="drop")
  return (constrain_cache(KVCache([put(k, r) for k, r in zip(cache.k, rows.k)],
                                  [put(v, r) for v, r in zip(cache.v, rows.v)])),
          constrain(put(presence, held[None]), PRESENCE_AXES))


@functools.partial(jax.jit, static_argnames=("span",), donate_argnames=("cache", "presence"))
def copy_prompt(cache: KVCache, presence: jax.Array, src: jax.Array, dst: jax.Array,
                ids: jax.Array, *, span: int) -> tuple[KVCache, jax.Array]:
  """Gives slot `dst` the first `span` cache positions of slot `src`, which holds the prompt
  `ids` (int32 [span], padded with the vocabulary size) at its first positions, and a presence
  row marking those ids: what prefilling the prompt into `dst` would write. Positions past the
  prompt are `src`'s, overwritten before `dst` attends to them. All padding with src == dst
  changes nothing (the engine's warm-up)."""
  vocab = presence.shape[1]
  start = lambda x, slot: (slot,) + (0,) * (x.ndim - 1)
  move = lambda x: jax.lax.dynamic_update_slice(
      x, jax.lax.dynamic_slice(x, start(x, src), (1, span) + x.shape[2:]), start(x, dst))
  held = jnp.zeros((vocab,), jnp.bool_).at[ids].set(True, mode="drop")
  row = jnp.where(jnp.any(ids < vocab), held, presence[dst])
  return (constrain_cache(KVCache([move(k) for k in cache.k], [move(v) for v in cache.v])),
          constrain(presence.at[dst].set(row), PRESENCE_AXES))


@functools.partial(jax.jit, donate_argnames=("presence",))
def unmark(presence: jax.Array, slot: jax.Array, ids: jax.Array) -> jax.Array:
  """Clears `ids` (int32, padded with the vocabulary size) from `slot`'s presence row."""
  vocab = presence.shape[1]
  return constrain(presence.at[slot, jnp.where(ids < vocab, ids, vocab)].set(False, mode="drop"),
                   PRESENCE_AXES)


@functools.partial(jax.jit, static_argnums=0,
                   static_argnames=("num_steps", "attend_len", "eos_ids", "candidates"),
                   donate_argnames=("cache", "presence"))
def decode(graphdef: nnx.GraphDef, params: nnx.State, cache: KVCache, presence: jax.Array,
           state: SlotState, *, num_steps: int, attend_len: int, eos_ids: tuple[int, ...],
           candidates: int) -> tuple[KVCache, jax.Array, SlotState, BlockOutput]:
  """Runs up to `num_steps` decode steps for the active slots, stopping early once none is.

  A slot stops on an EOS id, when its turn budget is spent, or when the sequence has no
  room for another token; the host reads why from the returned state. Needs every active
  slot's position + num_steps <= attend_len.
  """
  model = nnx.merge(graphdef, params)
  num_slots, vocab = presence.shape
  slots = jnp.arange(num_slots)
  eos = jnp.asarray(eos_ids, jnp.int32)
  starting = state.active & (state.positions == 0)  # one-token prompts: nothing prefilled
  presence = jax.lax.cond(jnp.any(starting), lambda: presence & ~starting[:, None],
                          lambda: presence)
  out = BlockOutput(tokens=jnp.full((num_slots, num_steps), -1, jnp.int32),
                    sample_logprobs=jnp.zeros((num_slots, num_steps), jnp.float32),
                    model_logprobs=jnp.zeros((num_slots, num_steps), jnp.float32),
                    steps=jnp.zeros((), jnp.int32))

  def cond(carry):
    _, _, state, out = carry
    return (out.steps < num_steps) & jnp.any(state.active)

  def body(carry):
    cache, presence, state, out = carry
    act = state.active
    positions = jnp.where(act, state.positions, cache.max_len)
    hidden, cache = model.hidden_states(state.tokens[:, None], positions[:, None], cache=cache,
                                        attend_len=attend_len)
    logits = model.logits(hidden[:, 0])
    presence = presence.at[slots, jnp.where(act, state.tokens, vocab)].set(True, mode="drop")
    new_pos = state.positions + 1
    tokens, sample_lp, model_lp = sample(
        logits, state.temperature, state.top_p, state.top_k, state.seeds, new_pos,
        min_p=state.min_p, repetition_penalty=state.repetition_penalty, seen=presence,
        candidates=candidates)
    i = out.steps
    out = BlockOutput(
        tokens=out.tokens.at[:, i].set(jnp.where(act, tokens, -1)),
        sample_logprobs=out.sample_logprobs.at[:, i].set(sample_lp),
        model_logprobs=out.model_logprobs.at[:, i].set(model_lp),
        steps=i + 1)
    remaining = state.remaining - act
    going = (act & ~jnp.isin(tokens, eos) & (remaining > 0) & (new_pos + 1 < state.limits))
    state = dataclasses.replace(
        state, tokens=jnp.where(act, tokens, state.tokens),
        positions=jnp.where(act, new_pos, state.positions), active=going, remaining=remaining)
    return cache, presence, state, out

  cache, presence, state, out = jax.lax.while_loop(cond, body, (cache, presence, state, out))
  return constrain_cache(cache), constrain(presence, PRESENCE_AXES), state, out
