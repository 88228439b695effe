"""Causal attention over packed training rows in blocks, forward and backward.

Dense attention keeps [heads, T, T] scores per layer: 30 GB for one 16k-token row of a 7B
model. Here queries and keys are taken `block` at a time with an online softmax (the flash
attention algorithm, in plain JAX so it runs on every backend), and the backward pass
recomputes each block's probabilities from the saved log-sum-exp, so memory grows with
T x block instead of T x T, and blocks above the diagonal are never computed. Nor are
blocks below it whose queries and keys cannot share a segment: rows packed with several
sequences (RL batches) skip most of the off-diagonal work.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

_F32 = jnp.float32
_MIN = jnp.finfo(_F32).min


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BlockedCausal:
  """Stands in for a dense mask: token i of a row attends token j <= i of its segment
  (`segment_ids` [b, t]; equal ids = same packed sequence), computed `block` at a time."""

  segment_ids: jax.Array
  block: int = dataclasses.field(metadata=dict(static=True))


def blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: BlockedCausal
                      ) -> jax.Array:
  """q: [b, t, kv_heads, group, d]; k, v: [b, t, kv_heads, d]. Returns [b, t, kv, group, d]
  in v's dtype, equal to softmax(q k^T / sqrt(d) masked) v."""
  b, t = q.shape[:2]
  block = mask.block
  pad = -t % block
  if pad:
    widths = lambda x: [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
    q, k, v = (jnp.pad(x, widths(x)) for x in (q, k, v))
  # Padding keys sit after every real query, so causality already hides them; they repeat
  # the row's last id so that the last block's id range (which decides the blocks it skips)
  # stays the real one.
  segments = jnp.pad(mask.segment_ids.astype(jnp.int32), [(0, 0), (0, pad)], mode="edge")
  out = _attention(q, k, v, segments, block)
  return out[:, :t]


def _blocks(x, i, block):
  return jax.lax.dynamic_slice_in_dim(x, i * block, block, axis=1)


def _overlap(segments, block):
  """[n, n] bool: whether query block i and key block j may hold a pair of one segment in
  some row: the ranges of their ids other than 0 meet, or both hold a 0 (the batch's padding,
  which would otherwise stretch the range of a row's last block down to every earlier one).
  Exact for packed rows, whose ids run in order with padding last; for ids in any other
  layout it keeps every block that is needed (a superset)."""
  b, t = segments.shape
  per_block = segments.reshape(b, t // block, block)
  real, limits = per_block != 0, jnp.iinfo(per_block.dtype)
  lo = jnp.where(real, per_block, limits.max).min(-1)  # [b, n]; no real id: an empty range
  hi = jnp.where(real, per_block, limits.min).max(-1)
  pad = (~real).any(-1)
  meet = ((lo[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] <= hi[:, :, None])
          | (pad[:, :, None] & pad[:, None, :]))
  return meet.any(0)


def _scores(q_blk, k_blk, seg_q, seg_k, i, j, block):
  """Scaled scores [b, kv, g, bq, bk] of query block i against key block j, and where the
  mask allows them (causal by index, same segment)."""
  d = q_blk.shape[-1]
  scores = jnp.einsum("bqkgd,bskd->bkgqs", q_blk, k_blk, preferred_element_type=_F32)
  rows = i * block + jnp.arange(block)
  cols = j * block + jnp.arange(block)
  allowed = (cols[None, :] <= rows[:, None])[None] & (seg_q[:, :, None] == seg_k[:, None, :])
  return scores * (d ** -0.5), allowed[:, None, None]


def _forward(q, k, v, segments, block):
  """Output [b, t, kv, g, d] and log-sum-exp [b, kv, g, t] (f32)."""
  b, t, kv, g, d = q.shape
  n = t // block
  overlap = _overlap(segments, block)

  def query_block(i):
    q_blk, seg_q = _blocks(q, i, block), _blocks(segments, i, block)

    def key_block(j, carry):
      return jax.lax.cond(overlap[i, j], add_key_block, lambda j, carry: carry, j, carry)

    def add_key_block(j, carry):
      m, l, acc = carry
      scores, allowed = _scores(q_blk, _blocks(k, j, block), seg_q,
                                _blocks(segments, j, block), i, j, block)
      scores = jnp.where(allowed, scores, _MIN)
      m_new = jnp.maximum(m, scores.max(-1))
      p = jnp.where(allowed, jnp.exp(scores - m_new[..., None]), 0.0)
      scale = jnp.exp(m - m_new)
      acc = acc * scale[..., None] + jnp.einsum(
          "bkgqs,bskd->bkgqd", p.astype(v.dtype), _blocks(v, j, block),
          preferred_element_type=_F32)
      return m_new, l * scale + p.sum(-1), acc

    init = (jnp.full((b, kv, g, block), _MIN, _F32), jnp.zeros((b, kv, g, block), _F32),
            jnp.zeros((b, kv, g, block, d), _F32))
    # Every query attends itself, so l > 0 once the diagonal block is in.
    m, l, acc = jax.lax.fori_loop(0, i + 1, key_block, init)
    return acc / l[..., None], m + jnp.log(l)

  out, lse = jax.lax.map(query_block, jnp.arange(n))  # [n, b, kv, g, block, (d)]
  out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, t, kv, g, d).astype(v.dtype)
  lse = lse.transpose(1, 2, 3, 0, 4).reshape(b, kv, g, t)
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, segments, block):
  return _forward(q, k, v, segments, block)[0]


def _attention_fwd(q, k, v, segments, block):
  out, lse = _forward(q, k, v, segments, block)
  return out, (q, k, v, segments, out, lse)


def _attention_bwd(block, residuals, d_out):
  q, k, v, segments, out, lse = residuals
  b, t, kv, g, d = q.shape
  n = t // block
  scale = d ** -0.5
  overlap = _overlap(segments, block)
  # D_i = sum_d dO_i * O_i, the softmax backward's per-row term.
  delta = jnp.einsum("bqkgd,bqkgd->bkgq", d_out.astype(_F32), out.astype(_F32))

  def key_block(j, grads):
    """Adds key block j's share: its dk, dv, and its part of every later query's dq."""
    k_blk, v_blk, seg_k = _blocks(k, j, block), _blocks(v, j, block), _blocks(segments, j, block)

    def query_block(i, carry):
      return jax.lax.cond(overlap[i, j], add_query_block, lambda i, carry: carry, i, carry)

    def add_query_block(i, carry):
      dq, dk_j, dv_j = carry
      q_blk, d_out_i = _blocks(q, i, block), _blocks(d_out, i, block)
      lse_i = jax.lax.dynamic_slice_in_dim(lse, i * block, block, axis=3)
      delta_i = jax.lax.dynamic_slice_in_dim(delta, i * block, block, axis=3)
      scores, allowed = _scores(q_blk, k_blk, _blocks(segments, i, block), seg_k, i, j, block)
      p = jnp.where(allowed, jnp.exp(scores - lse_i[..., None]), 0.0)
      dp = jnp.einsum("bqkgd,bskd->bkgqs", d_out_i, v_blk, preferred_element_type=_F32)
      ds = p * (dp - delta_i[..., None]) * scale
      dv_j = dv_j + jnp.einsum("bkgqs,bqkgd->bskd", p, d_out_i.astype(_F32))
      dk_j = dk_j + jnp.einsum("bkgqs,bqkgd->bskd", ds, q_blk.astype(_F32))
      dq_i = _blocks(dq, i, block) + jnp.einsum("bkgqs,bskd->bqkgd", ds, k_blk.astype(_F32))
      return jax.lax.dynamic_update_slice_in_dim(dq, dq_i, i * block, axis=1), dk_j, dv_j

    dq, dk, dv = grads
    zeros = jnp.zeros((b, block, kv, d), _F32)
    # Query blocks before j cannot see key block j.
    dq, dk_j, dv_j = jax.lax.fori_loop(j, n, query_block, (dq, zeros, zeros))
    put = lambda x, blk: jax.lax.dynamic_update_slice_in_dim(x, blk, j * block, axis=1)
    return dq, put(dk, dk_j), put(dv, dv_j)

  grads = (jnp.zeros(q.shape, _F32), jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32))
  dq, dk, dv = jax.lax.fori_loop(0, n, key_block, grads)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attention.defvjp(_attention_fwd, _attention_bwd)
