"""Ragged decode attention for the sampler on TPUs: a Pallas kernel that reads each
sequence's KV cache only up to its own length.

The XLA decode path (`qwen2._decode_attention`) attends over a window of the cache whose
length is a compile-time bucket (`EngineConfig.min_attend` doubled up to `max_len`), so a
batch of one long and many short sequences reads the long one's window for all of them. Here
a grid step covers one sequence and one block of cache positions, the sequence's length is
prefetched into scalar memory, and blocks past it are neither copied in (their index map
repeats the last needed block, which Pallas does not fetch again) nor computed.

`Qwen2Config.decode_attention_impl` picks the path: "auto" (this kernel on TPU, XLA
elsewhere), "xla" or "ragged". Off TPU the kernel runs in Pallas' TPU interpret mode (what
the CPU tests check; far too slow for sampling).

The cache keeps the layout every path shares, [batch, len, kv_heads, head_dim]: the kernel
sees it as [batch, len, kv_heads * head_dim] (a free reshape), and both products are plain
2-D matmuls over all KV heads at once: the queries go in as a block-diagonal
[heads, kv_heads * head_dim] matrix (zero off each head's own KV head), and the output's
diagonal blocks are each head's attention.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sage_jax import sharding as shd

IMPLEMENTATIONS = ("auto", "xla", "ragged")
# Cache positions per grid step; a cache whose length it does not divide uses the XLA path.
BLOCK = 256
_F32 = jnp.float32


def check_implementation(name: str) -> None:
  if name not in IMPLEMENTATIONS:
    raise ValueError(f"decode_attention_impl={name!r}; expected one of {IMPLEMENTATIONS}")


def decode_kernel_for(name: str, cache_len: int, backend: str | None = None) -> str:
  """"ragged" or "xla" for a cache of `cache_len` positions. "auto" is the kernel on TPU when
  its block divides the cache; an explicit "ragged" that cannot run is an error."""
  check_implementation(name)
  if name == "xla" or (name == "auto" and (backend or jax.default_backend()) != "tpu"):
    return "xla"
  if cache_len % _block(cache_len):
    if name == "ragged":
      raise ValueError(f"decode_attention_impl='ragged': the cache length {cache_len} is not "
                       f"a multiple of {BLOCK}")
    return "xla"
  return "ragged"


def _block(cache_len: int) -> int:
  return min(BLOCK, cache_len)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RaggedDecode:
  """Stands in for the decode mask: sequence b attends cache positions [0, lengths[b])."""

  lengths: jax.Array


def ragged_decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array
                            ) -> jax.Array:
  """q: [b, heads, d]; k, v: [b, s, kv_heads, d] (the whole cache); lengths: [b] int.
  Returns [b, 1, heads, d] in v's dtype: softmax(q k^T / sqrt(d)) v over each sequence's
  first lengths[b] positions (a sequence with none gets zeros)."""
  b, heads, d = q.shape
  kv = k.shape[2]
  q = q.reshape(b, kv, heads // kv, d)
  lengths = lengths.astype(jnp.int32)
  ctx = shd.active()
  if ctx is None:
    return _attend(q, k, v, lengths).reshape(b, 1, heads, d)
  mesh, rules = ctx
  kv_spec = rules.spec(shd.CACHE_AXES, k.shape, mesh)
  if kv_spec[1] is not None:
    raise ValueError("ragged decode attention needs the cache's length unsharded "
                     f"(cache_len -> {kv_spec[1]})")
  spec = jax.sharding.PartitionSpec
  out = jax.shard_map(_attend, mesh=mesh, check_vma=False,
                      in_specs=(spec(kv_spec[0], kv_spec[2]), kv_spec, kv_spec, spec(kv_spec[0])),
                      out_specs=spec(kv_spec[0], kv_spec[2]))(q, k, v, lengths)
  return out.reshape(b, 1, heads, d)


def _attend(q, k, v, lengths):
  """q [b, kv, g, d] -> [b, kv, g, d] on one device's rows and KV heads."""
  b, kv, g, d = q.shape
  s = k.shape[1]
  eye = jnp.eye(kv, dtype=q.dtype)
  # Row (head h of KV head i) holds its query in the columns of KV head i, zeros elsewhere.
  q_blocks = jnp.einsum("bkgd,kj->bkgjd", q * d ** -0.5, eye).reshape(b, kv * g, kv * d)
  block = _block(s)
  interpret = jax.default_backend() != "tpu"
  blocks = _kernel_call(b, kv * g, kv * d, s, block, interpret)(
      lengths, q_blocks.astype(k.dtype), k.reshape(b, s, kv * d), v.reshape(b, s, kv * d))
  out = jnp.einsum("bkgjd,kj->bkgd", blocks.reshape(b, kv, g, kv, d), eye.astype(_F32))
  return out.astype(v.dtype)


@functools.lru_cache(maxsize=None)
def _kernel_call(b: int, rows: int, width: int, s: int, block: int, interpret: bool):
  """The pallas_call over (sequence, cache block): lengths [b] (scalar prefetch), block-diagonal
  queries [b, rows, width], keys and values [b, s, width] -> float32 [b, rows, width]."""
  def last_needed(i, lengths_ref):  # lax.div: a length is never negative
    return jax.lax.div(jnp.maximum(lengths_ref[i] - 1, 0), block)

  kv_spec = pl.BlockSpec((1, block, width),
                         lambda i, j, lengths_ref: (i, jnp.minimum(j, last_needed(i, lengths_ref)),
                                                    0))
  row_spec = pl.BlockSpec((1, rows, width), lambda i, j, lengths_ref: (i, 0, 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(b, s // block),
      in_specs=[row_spec, kv_spec, kv_spec], out_specs=row_spec,
      scratch_shapes=[pltpu.VMEM((rows, 1), _F32), pltpu.VMEM((rows, 1), _F32),
                      pltpu.VMEM((rows, width), _F32)])
  return pl.pallas_call(
      functools.partial(_kernel, block=block), grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((b, rows, width), _F32),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False)


def _kernel(lengths_ref, q_ref, k_ref, v_ref, out_ref, max_ref, sum_ref, acc_ref, *, block):
  """Online softmax over the cache blocks of sequence i (grid axis 1), flash-decoding style."""
  i, j = pl.program_id(0), pl.program_id(1)
  length = lengths_ref[i]

  @pl.when(j == 0)
  def _init():
    max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, _F32)
    sum_ref[...] = jnp.zeros(sum_ref.shape, _F32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)

  @pl.when(j * block < length)
  def _block_step():
    q, k, v = q_ref[0], k_ref[0], v_ref[0]  # [rows, width], [block, width], [block, width]
    scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                 preferred_element_type=_F32)  # [rows, block]
    position = j * block + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    scores = jnp.where(position < length, scores, -jnp.inf)
    # Values past the length are zeroed too: whatever a cache holds there (even NaN) stays out.
    row = j * block + jax.lax.broadcasted_iota(jnp.int32, v.shape, 0)
    v = jnp.where(row < length, v, jnp.zeros_like(v))
    new_max = jnp.maximum(max_ref[...], scores.max(axis=1, keepdims=True))
    rescale = jnp.exp(max_ref[...] - new_max)
    probs = jnp.exp(scores - new_max)
    sum_ref[...] = rescale * sum_ref[...] + probs.sum(axis=1, keepdims=True)
    acc_ref[...] = rescale * acc_ref[...] + jnp.dot(probs.astype(v.dtype), v,
                                                    preferred_element_type=_F32)
    max_ref[...] = new_max

  @pl.when(j == pl.num_programs(1) - 1)
  def _write():
    total = sum_ref[...]
    out_ref[0] = jnp.where(total > 0, acc_ref[...] / jnp.where(total > 0, total, 1.0), 0.0)
