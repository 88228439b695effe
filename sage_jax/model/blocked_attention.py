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


def _blocks(x, i, block, axis=1):
  return jax.lax.dynamic_slice_in_dim(x, i * block, block, axis=axis)


# What a (query block, key block) pair needs: nothing, attention without a mask (below the
# diagonal, one segment on both sides), or the causal / segment mask.
_SKIP, _FULL, _MASKED = 0, 1, 2


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


def _pair_kinds(segments, block):
  """[n, n] int32: `_SKIP`, `_FULL` or `_MASKED` for query block i and key block j (above
  the diagonal: skipped). A pair strictly below the diagonal whose blocks hold one and the
  same id in every row needs no mask (the usual case within a long sequence): its selects
  are skipped."""
  b, t = segments.shape
  n = t // block
  per_block = segments.reshape(b, n, block)
  first = per_block[:, :, 0]
  uniform = (per_block == first[..., None]).all(-1)  # [b, n]
  same = (uniform[:, :, None] & uniform[:, None, :]
          & (first[:, :, None] == first[:, None, :])).all(0)
  below = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]
  causal = jnp.arange(n)[None, :] <= jnp.arange(n)[:, None]
  return jnp.where(~_overlap(segments, block) | ~causal, _SKIP,
                   jnp.where(same & below, _FULL, _MASKED)).astype(jnp.int32)


def _allowed(seg_q, seg_k, i, j, block):
  """[b, bq, bk]: causal by index and within one segment."""
  rows = i * block + jnp.arange(block)
  cols = j * block + jnp.arange(block)
  return (cols[None, :] <= rows[:, None])[None] & (seg_q[:, :, None] == seg_k[:, None, :])


def _layouts(q, k, v):
  """The operands of the blocked products, laid out so that every block is a contiguous
  slice along the tokens and every product a plain [m, k] x [k, n] matmul, the form XLA:CPU
  multiplies without copying an operand per block. Queries are scaled by 1 / sqrt(d) and a
  query block's rows are its (token, group) pairs:
    q [b, kv, t, g, d], q_t [b, kv, d, t, g], k [b, kv, t, d], k_t [b, kv, d, t], v [b, kv, t, d].
  """
  scale = q.shape[-1] ** -0.5
  q = (q * scale).astype(q.dtype).transpose(0, 2, 1, 3, 4)
  k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  return q, q.transpose(0, 1, 4, 2, 3), k, k.transpose(0, 1, 3, 2), v


def _switch(kind, masked, full, skip, *operands):
  return jax.lax.switch(kind, (skip, full, masked), *operands)


def _forward(q, k, v, segments, block):
  """Output [b, t, kv, g, d] and log-sum-exp [b, kv, t, g] (f32) of the scaled scores."""
  b, t, kv, g, d = q.shape
  n = t // block
  kinds = _pair_kinds(segments, block)
  q, _, _, k_t, v = _layouts(q, k, v)

  def query_block(i):
    q_blk, seg_q = _blocks(q, i, block, axis=2), _blocks(segments, i, block)

    def add_key_block(j, carry, masked):
      m, l, acc = carry  # [b, kv, bq, g], [b, kv, bq, g], [b, kv, bq, g, d]
      scores = jnp.einsum("bkqgd,bkds->bkqgs", q_blk, _blocks(k_t, j, block, axis=3),
                          preferred_element_type=_F32)
      if masked:
        allowed = _allowed(seg_q, _blocks(segments, j, block), i, j, block)
        allowed = allowed[:, None, :, None, :]  # [b, 1, bq, 1, bk]
        scores = jnp.where(allowed, scores, _MIN)
      m_new = jnp.maximum(m, scores.max(-1))
      p = jnp.exp(scores - m_new[..., None])
      if masked:  # a query with no allowed key in this block keeps p = 0, not exp(0)
        p = jnp.where(allowed, p, 0.0)
      scale = jnp.exp(m - m_new)
      acc = acc * scale[..., None] + jnp.einsum(
          "bkqgs,bksd->bkqgd", p.astype(v.dtype), _blocks(v, j, block, axis=2),
          preferred_element_type=_F32)
      return m_new, l * scale + p.sum(-1), acc

    def key_block(j, carry):
      return _switch(kinds[i, j], lambda j, c: add_key_block(j, c, True),
                     lambda j, c: add_key_block(j, c, False), lambda j, c: c, j, carry)

    init = (jnp.full((b, kv, block, g), _MIN, _F32), jnp.zeros((b, kv, block, g), _F32),
            jnp.zeros((b, kv, block, g, d), _F32))
    # Every query attends itself, so l > 0 once the diagonal block is in.
    m, l, acc = jax.lax.fori_loop(0, i + 1, key_block, init)
    return acc / l[..., None], m + jnp.log(l)

  out, lse = jax.lax.map(query_block, jnp.arange(n))  # [n, b, kv, block, g, (d)]
  out = out.transpose(1, 0, 3, 2, 4, 5).reshape(b, t, kv, g, d).astype(v.dtype)
  lse = lse.transpose(1, 2, 0, 3, 4).reshape(b, kv, t, g)
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, segments, block):
  return _forward(q, k, v, segments, block)[0]


def _attention_fwd(q, k, v, segments, block):
  out, lse = _forward(q, k, v, segments, block)
  return out, (q, k, v, segments, out, lse)


def _attention_bwd(block, residuals, d_out):
  """Works on transposed blocks, keys by (query, group) pairs: P^T = exp(K Q^T - lse), and
  dV = P^T dO, dK = dS^T Q, dQ^T = K^T dS^T are all plain matmuls of what is at hand."""
  q, k, v, segments, out, lse = residuals
  b, t, kv, g, d = q.shape
  n = t // block
  kinds = _pair_kinds(segments, block)
  q, q_t, k, k_t, v = _layouts(q, k, v)
  d_out_h = d_out.transpose(0, 2, 1, 3, 4)  # [b, kv, t, g, d]
  d_out_t = d_out_h.transpose(0, 1, 4, 2, 3)  # [b, kv, d, t, g]
  # D_i = sum_d dO_i * O_i, the softmax backward's per-row term, [b, kv, t, g].
  delta = jnp.einsum("bqkgd,bqkgd->bkqg", d_out.astype(_F32), out.astype(_F32))

  def key_block(j, grads):
    """Adds key block j's share: its dk, dv, and its part of every later query's dq."""
    k_blk, k_t_blk = _blocks(k, j, block, axis=2), _blocks(k_t, j, block, axis=3)
    v_blk, seg_k = _blocks(v, j, block, axis=2), _blocks(segments, j, block)

    def add_query_block(i, carry, masked):
      dq_i, dk_j, dv_j = carry
      blk = lambda x, axis: _blocks(x, i, block, axis=axis)
      scores_t = jnp.einsum("bksd,bkdqg->bksqg", k_blk, blk(q_t, 3),
                            preferred_element_type=_F32)
      p_t = jnp.exp(scores_t - blk(lse, 2)[:, :, None])
      if masked:
        allowed = _allowed(blk(segments, 1), seg_k, i, j, block).swapaxes(1, 2)
        p_t = jnp.where(allowed[:, None, :, :, None], p_t, 0.0)  # [b, 1, bk, bq, 1]
      dp_t = jnp.einsum("bksd,bkdqg->bksqg", v_blk, blk(d_out_t, 3),
                        preferred_element_type=_F32)
      ds_t = p_t * (dp_t - blk(delta, 2)[:, :, None])  # d loss / d scaled scores
      # The (query, group) pairs as one contracted axis: given as two, XLA:CPU transposes
      # both operands to (group, query) order at every pair.
      rows = lambda x: x.reshape(b, kv, block, block * g)
      pairs = lambda x: x.reshape(b, kv, block * g, d)
      dv_j = dv_j + jnp.einsum("bksr,bkrd->bksd", rows(p_t).astype(v.dtype),
                               pairs(blk(d_out_h, 2)), preferred_element_type=_F32)
      dk_j = dk_j + jnp.einsum("bksr,bkrd->bksd", rows(ds_t).astype(q.dtype),
                               pairs(blk(q, 2)), preferred_element_type=_F32)
      dq_i = dq_i + jnp.einsum("bkds,bksqg->bkdqg", k_t_blk, ds_t.astype(k.dtype),
                               preferred_element_type=_F32)
      return dq_i, dk_j, dv_j

    def query_block(i, carry):
      # Only query block i's slice of dq passes through the switch and is written back
      # after it: a conditional that updated all of dq would copy it at every pair.
      dq_t, dk_j, dv_j = carry
      dq_i = _blocks(dq_t, i, block, axis=3)
      dq_i, dk_j, dv_j = _switch(kinds[i, j], lambda i, c: add_query_block(i, c, True),
                                 lambda i, c: add_query_block(i, c, False), lambda i, c: c,
                                 i, (dq_i, dk_j, dv_j))
      return jax.lax.dynamic_update_slice_in_dim(dq_t, dq_i, i * block, axis=3), dk_j, dv_j

    dq_t, dk, dv = grads
    zeros = jnp.zeros((b, kv, block, d), _F32)
    # Query blocks before j cannot see key block j.
    dq_t, dk_j, dv_j = jax.lax.fori_loop(j, n, query_block, (dq_t, zeros, zeros))
    put = lambda x, blk: jax.lax.dynamic_update_slice_in_dim(x, blk, j * block, axis=2)
    return dq_t, put(dk, dk_j), put(dv, dv_j)

  grads = (jnp.zeros(q_t.shape, _F32), jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32))
  dq_t, dk, dv = jax.lax.fori_loop(0, n, key_block, grads)
  # dq_t is the gradient of the scaled queries, [b, kv, d, t, g]; back to the model's layout.
  dq = (dq_t * d ** -0.5).transpose(0, 3, 1, 4, 2)
  dk, dv = dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attention.defvjp(_attention_fwd, _attention_bwd)
