"""Per-target logprobs and entropies of a batch under the model, optionally in chunks.

The LM head, log-softmax and entropy are one operation with a hand-written gradient
(`head_logprobs`). Left to autodiff, XLA:CPU materialises the [tokens, vocab] float32 logits
four more times (probabilities, the entropy's products, the logits' gradient and its
transpose for the head's weight gradient) and runs the entropy's sum of products as a slow
library reduction: 2.2x the time of this operation (bench/train_kernels.py).
Here the forward pass keeps the logits and reduces them (max, then the sum of exponentials
and that of their products with the logits); the backward pass forms the logits' gradient
once and contracts it in the orders the matmul wants.

The full logits of a batch ([rows, T, vocab] float32: 2.5 GB for 4096 tokens of a 152k
vocabulary, and as much again for their gradient) dominate training memory. With `chunk > 0`
the positions are cut into chunks of about `chunk` tokens (`chunk // rows` positions of every
row, so rows stay split over the data-parallel devices); each chunk's logits are made,
reduced to (logprob, entropy) and dropped, and recomputed in the backward pass
(`jax.checkpoint`), so only [rows, chunk / rows, vocab] is ever live.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from sage_jax.model.qwen2 import LOGIT_AXES, Qwen2
from sage_jax.sharding import active, constrain

_F32 = jnp.float32


def _logits(hidden: jax.Array, head: jax.Array, temperature: float) -> jax.Array:
  """Float32 logits [rows, t, vocab] of hidden [rows, t, embed] under head [vocab, embed],
  over `temperature` in float32, as the sampler divides them."""
  out = jnp.einsum("rte,ve->rtv", hidden, head.astype(hidden.dtype),
                   preferred_element_type=_F32)
  if temperature != 1.0:
    out = out / _F32(temperature)
  return constrain(out, LOGIT_AXES)


def _sums_of_exps(shifted):
  """(sum(e^z), sum(e^z z)) over the vocabulary, in one pass over the logits. XLA:CPU adds a
  two-output reduction's terms one after another, and over a whole 152k vocabulary the small
  terms vanish once the running total nears 1 (every logprob ~3e-4 too high, every entropy
  too low): blocks of up to 256 entries are summed first, then the block sums. A block lies
  within one device's share of a vocabulary split over the mesh, so the split stays."""
  vocab = shifted.shape[-1]
  ways = 1
  if (context := active()) is not None:
    mesh, rules = context
    split = rules.spec(LOGIT_AXES, shifted.shape, mesh)[-1]
    ways = math.prod(mesh.shape[a] for a in ((split,) if isinstance(split, str) else split or ()))
  block = 1
  while block < 256 and (vocab // ways) % (2 * block) == 0:
    block *= 2
  exps = jnp.exp(shifted)
  blocks = lambda x: x.reshape(x.shape[:-1] + (vocab // block, block))
  total, weighted = jax.lax.reduce((blocks(exps), blocks(exps * shifted)), (_F32(0), _F32(0)),
                                   lambda a, b: (a[0] + b[0], a[1] + b[1]), (shifted.ndim,))
  return jnp.sum(total, axis=-1), jnp.sum(weighted, axis=-1)


def _head_forward(hidden, head, targets, temperature):
  logits = _logits(hidden, head, temperature)
  top = jnp.max(logits, axis=-1, keepdims=True)
  shifted = logits - top
  total, weighted = _sums_of_exps(shifted)
  log_total = jnp.log(total)
  logprob = jnp.take_along_axis(shifted, targets[..., None], axis=-1)[..., 0] - log_total
  entropy = log_total - weighted / total
  lse = top[..., 0] + log_total
  return (logprob, entropy), (hidden, head, targets, logits, lse, entropy)


def _head_backward(temperature, residuals, cotangents):
  hidden, head, targets, logits, lse, entropy = residuals
  d_logprob, d_entropy = cotangents
  log_p = logits - lse[..., None]
  p = jnp.exp(log_p)
  target = jnp.arange(logits.shape[-1], dtype=targets.dtype) == targets[..., None]
  # d logprob / d logits = onehot - p;  d entropy / d logits = -p (log p + entropy).
  d_logits = (d_logprob[..., None] * (target - p)
              - d_entropy[..., None] * p * (log_p + entropy[..., None]))
  if temperature != 1.0:  # to the gradient of the unscaled logits
    d_logits = d_logits / _F32(temperature)
  d_logits = constrain(d_logits.astype(hidden.dtype), LOGIT_AXES)
  rows_t, vocab, embed = hidden.shape[:-1], head.shape[0], head.shape[1]
  flat_d, flat_h = d_logits.reshape(-1, vocab), hidden.reshape(-1, embed)
  d_hidden = jnp.dot(flat_d, head.astype(hidden.dtype),
                     preferred_element_type=_F32).reshape(rows_t + (embed,))
  # [embed, vocab] then transposed: with the logits' gradient as the right operand XLA:CPU
  # needs no transposed copy of it.
  d_head = jnp.dot(flat_h.T, flat_d, preferred_element_type=_F32).T
  return d_hidden.astype(hidden.dtype), d_head.astype(head.dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def head_logprobs(hidden: jax.Array, head: jax.Array, targets: jax.Array,
                  temperature: float = 1.0):
  """(log softmax(hidden . head^T / temperature)[targets], entropy of that softmax), [rows, t]
  each, float32.

  hidden: [rows, t, embed] final hidden states; head: [vocab, embed] output embedding;
  targets: [rows, t] int. Differentiable in hidden and head (both outputs)."""
  return _head_forward(hidden, head, targets, temperature)[0]


head_logprobs.defvjp(_head_forward, _head_backward)


def token_logprobs(model: Qwen2, tokens: jax.Array, positions: jax.Array,
                   segment_ids: jax.Array, targets: jax.Array, *,
                   chunk: int = 0, temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """(log pi(targets[b, j] | tokens[b, :j+1]), entropy of that distribution), [rows, T] each.

  `chunk`: tokens per chunk of the logits computation (0, or at least rows * T: all at
  once). The result does not depend on it beyond float rounding. `temperature`: pi is
  softmax(logits / temperature), the distribution a sampler at that temperature draws from
  (before any top-k / top-p cut), with the float32 logits divided as the sampler divides them
  (scaling bfloat16 hidden states instead would round the temperature and every state).
  """
  hidden, _ = model.hidden_states(tokens, positions, segment_ids=segment_ids)
  rows, t, e = hidden.shape
  per_row = max(1, chunk // rows) if chunk else t
  if per_row >= t:
    return head_logprobs(hidden, model.head_weight(), targets, temperature)
  n = -(-t // per_row)
  pad = n * per_row - t
  if pad:  # padded positions are computed and dropped
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
  h = hidden.reshape(rows, n, per_row, e).swapaxes(0, 1)
  y = targets.reshape(rows, n, per_row).swapaxes(0, 1)

  @jax.checkpoint
  def one(h_c, y_c):
    return head_logprobs(h_c, model.head_weight(), y_c, temperature)

  def body(_, xs):
    return None, one(*xs)

  _, (lp, ent) = jax.lax.scan(body, None, (h, y))
  lp = lp.swapaxes(0, 1).reshape(rows, n * per_row)[:, :t]
  ent = ent.swapaxes(0, 1).reshape(rows, n * per_row)[:, :t]
  return lp, ent
