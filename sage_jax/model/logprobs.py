"""Per-target logprobs and entropies of a batch under the model, optionally in chunks.

The full logits of a batch ([rows, T, vocab] float32: 2.5 GB for 4096 tokens of a 152k
vocabulary, and as much again for their gradient) dominate training memory. With `chunk > 0`
the positions are cut into chunks of about `chunk` tokens (`chunk // rows` positions of every
row, so rows stay split over the data-parallel devices); each chunk's logits are made,
reduced to (logprob, entropy) and dropped, and recomputed in the backward pass
(`jax.checkpoint`), so only [rows, chunk / rows, vocab] is ever live.
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

  `chunk`: tokens per chunk of the logits computation (0, or at least rows * T: all at
  once). The result does not depend on it beyond float rounding.
  """
  hidden, _ = model.hidden_states(tokens, positions, segment_ids=segment_ids)
  rows, t, e = hidden.shape
  per_row = max(1, chunk // rows) if chunk else t
  if per_row >= t:
    return _reduce(model, hidden, targets)
  n = -(-t // per_row)
  pad = n * per_row - t
  if pad:  # padded positions are computed and dropped
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
  h = hidden.reshape(rows, n, per_row, e).swapaxes(0, 1)
  y = targets.reshape(rows, n, per_row).swapaxes(0, 1)

  @jax.checkpoint
  def one(h_c, y_c):
    return _reduce(model, h_c, y_c)

  def body(_, xs):
    return None, one(*xs)

  _, (lp, ent) = jax.lax.scan(body, None, (h, y))
  lp = lp.swapaxes(0, 1).reshape(rows, n * per_row)[:, :t]
  ent = ent.swapaxes(0, 1).reshape(rows, n * per_row)[:, :t]
  return lp, ent
