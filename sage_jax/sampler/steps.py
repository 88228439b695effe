"""The engine's two jitted device functions: chunked prefill into one slot, and a block of
decode steps over all slots. Both take the model as (graphdef, params), the graphdef static,
so engines over models of one architecture share compilations; both donate the cache.

Cache layout (see `KVCache`): the token at position p of the sequence in slot s lives at
cache row s, index p. A sequence's last token is never in the cache: it is the slot's
next decode input (`SlotState.tokens`), so prefill handles all but the last token of new
input and the first decode step ingests the last one while sampling the next.
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
  """Per-slot decode state, one entry per slot.

  tokens: next decode input (int32), not yet in the cache; positions: its position;
  active: whether the slot decodes; remaining: tokens the turn may still generate;
  limits: most tokens the sequence may hold; temperature / top_p / top_k / seeds: sampling.
  """

  tokens: jax.Array
  positions: jax.Array
  active: jax.Array
  remaining: jax.Array
  limits: jax.Array
  temperature: jax.Array
  top_p: jax.Array
  top_k: jax.Array
  seeds: jax.Array

  @classmethod
  def empty(cls, num_slots: int) -> "SlotState":
    """Host (numpy) state with every slot idle."""
    zeros = lambda dtype: np.zeros(num_slots, dtype)
    return cls(tokens=zeros(np.int32), positions=zeros(np.int32), active=zeros(np.bool_),
               remaining=zeros(np.int32), limits=zeros(np.int32),
               temperature=zeros(np.float32), top_p=np.ones(num_slots, np.float32),
               top_k=zeros(np.int32), seeds=zeros(np.uint32))


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


@functools.partial(jax.jit, static_argnums=0, static_argnames=("attend_len",),
                   donate_argnames=("cache",))
def prefill(graphdef: nnx.GraphDef, params: nnx.State, cache: KVCache, tokens: jax.Array,
            slot: jax.Array, start: jax.Array, length: jax.Array, *,
            attend_len: int) -> KVCache:
  """Writes tokens[:length] (tokens: [chunk] int32) at positions start.. of `slot`.

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
  return constrain_cache(KVCache([put(k, r) for k, r in zip(cache.k, rows.k)],
                                 [put(v, r) for v, r in zip(cache.v, rows.v)]))


@functools.partial(jax.jit, static_argnums=0,
                   static_argnames=("num_steps", "attend_len", "eos_ids", "candidates"),
                   donate_argnames=("cache",))
def decode(graphdef: nnx.GraphDef, params: nnx.State, cache: KVCache, state: SlotState, *,
           num_steps: int, attend_len: int, eos_ids: tuple[int, ...],
           candidates: int) -> tuple[KVCache, SlotState, BlockOutput]:
  """Runs up to `num_steps` decode steps for the active slots, stopping early once none is.

  A slot stops on an EOS id, when its turn budget is spent, or when the sequence has no
  room for another token; the host reads why from the returned state. Needs every active
  slot's position + num_steps <= attend_len.
  """
  model = nnx.merge(graphdef, params)
  num_slots = state.tokens.shape[0]
  eos = jnp.asarray(eos_ids, jnp.int32)
  out = BlockOutput(tokens=jnp.full((num_slots, num_steps), -1, jnp.int32),
                    sample_logprobs=jnp.zeros((num_slots, num_steps), jnp.float32),
                    model_logprobs=jnp.zeros((num_slots, num_steps), jnp.float32),
                    steps=jnp.zeros((), jnp.int32))

  def cond(carry):
    _, state, out = carry
    return (out.steps < num_steps) & jnp.any(state.active)

  def body(carry):
    cache, state, out = carry
    positions = jnp.where(state.active, state.positions, cache.max_len)
    hidden, cache = model.hidden_states(state.tokens[:, None], positions[:, None], cache=cache,
                                        attend_len=attend_len)
    logits = model.logits(hidden[:, 0])
    new_pos = state.positions + 1
    tokens, sample_lp, model_lp = sample(logits, state.temperature, state.top_p, state.top_k,
                                         state.seeds, new_pos, candidates=candidates)
    act = state.active
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
    return cache, state, out

  cache, state, out = jax.lax.while_loop(cond, body, (cache, state, out))
  return constrain_cache(cache), state, out
