"""Per-target logprobs and entropies of a batch under the model, optionally in chunks.

The full logits of a long row ([rows, T, vocab] float32, 2.5 GB for one 4096-token row of a
152k vocabulary) dominate training memory. With `chunk > 0` the rows are cut into chunks of
`chunk` positions; each chunk's logits are made, reduced to (logprob, entropy) and dropped,
and recomputed in the backward pass (`jax.checkpoint`), so only [rows, chunk, vocab] is ever
live.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sage_jax.model.qwen2 import Qwen2

_F32 = jnp.float32


def _reduce(model: Qwen2, hidden: jax.Array, targets: jax.Array):
  logits = model.logits(hidden)  # float32 [..., vocab]
  lse = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  probs = jnp.exp(logits - lse[..., None])
  entropy = lse - jnp.sum(probs * logits, axis=-1)
  return target_logit - lse, entropy


def token_logprobs(model: Qwen2, tokens: jax.Array, positions: jax.Array,
                   segment_ids: jax.Array, targets: jax.Array, *,
                   chunk: int = 0) -> tuple[jax.Array, jax.Array]:
  """(log pi(targets[b, j] | tokens[b, :j+1]), entropy of that distribution), [rows, T] each.

  `chunk` must divide T when set; 0 (or >= T) computes all logits at once.
  """
  hidden, _ = model.hidden_states(tokens, positions, segment_ids=segment_ids)
  rows, t, e = hidden.shape
  if not chunk or chunk >= t:
    return _reduce(model, hidden, targets)
  if t % chunk:
    raise ValueError(f"logprob chunk {chunk} does not divide the row length {t}")
  n = t // chunk
  h = hidden.reshape(rows, n, chunk, e).swapaxes(0, 1)
  y = targets.reshape(rows, n, chunk).swapaxes(0, 1)

  @jax.checkpoint
  def one(h_c, y_c):
    return _reduce(model, h_c, y_c)

  def body(_, xs):
    return None, one(*xs)

  _, (lp, ent) = jax.lax.scan(body, None, (h, y))
  return lp.swapaxes(0, 1).reshape(rows, t), ent.swapaxes(0, 1).reshape(rows, t)
