"""Per-sequence sampling parameters and the on-device token sampler.

Every row of a batch samples with its own repetition penalty, temperature, top-k, top-p,
min-p and random stream, applied in transformers' order. The random number of a token
depends only on the sequence's seed and the token's position, so a run is reproducible
whatever slot a sequence lands in and whatever shares its batch.
The sampler avoids sorting the vocabulary (slow on CPU): greedy is a max and an index,
sampling is an inverse CDF over blocks, top-k / top-p / min-p thresholds come from a small
`lax.top_k` with an exact bisection for the rare nucleus that needs more candidates. Each
processing step runs only when some row of the batch asks for it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

_F32 = jnp.float32
_CDF_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one sequence samples; `temperature=0` is greedy.

  `repetition_penalty` (transformers' RepetitionPenaltyLogitsProcessor, greedy included)
  divides the positive logits of every id the sequence holds by the penalty and multiplies the
  negative ones. `min_p` drops tokens less likely than min_p times the most likely one.
  `max_new_tokens` bounds each turn; `max_context` bounds the whole sequence (prompt,
  generations and appended tokens), default the engine's cache length. `stop_strings` end
  a turn at the token that completes one of them (checked on the host, after decoding).
  """

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  min_p: float = 0.0
  repetition_penalty: float = 1.0
  max_new_tokens: int = 256
  max_context: int | None = None
  stop_strings: tuple[str, ...] = ()

  def __post_init__(self):
    if not 0 <= self.temperature < math.inf:  # NaN too
      raise ValueError(f"temperature={self.temperature} must be a finite number >= 0")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
    if self.top_k < 0:
      raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = off)")
    if not 0 <= self.min_p <= 1:
      raise ValueError(f"min_p={self.min_p} must be in [0, 1] (0 = off)")
    if not 0 < self.repetition_penalty < math.inf:
      raise ValueError(f"repetition_penalty={self.repetition_penalty} must be a finite number "
                       "> 0 (1 = off)")
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
    if self.max_context is not None and self.max_context < 2:
      raise ValueError(f"max_context={self.max_context} must be >= 2")
    if isinstance(self.stop_strings, str) or not all(self.stop_strings):
      raise ValueError(f"stop_strings={self.stop_strings!r} must be a tuple of non-empty strings")
    object.__setattr__(self, "stop_strings", tuple(self.stop_strings))


GREEDY = SamplingParams(temperature=0.0)


def _first_argmax(x: jax.Array) -> jax.Array:
  """argmax over the last axis (first index of the max, or of the first NaN, as
  `jnp.argmax` and torch's give): two plain reductions, which XLA CPU runs several times
  faster than its variadic argmax reduction."""
  top = jnp.max(x, axis=-1, keepdims=True)  # NaN when the row holds one
  idx = jnp.arange(x.shape[-1], dtype=jnp.int32)
  return jnp.min(jnp.where((x == top) | jnp.isnan(x), idx, x.shape[-1]), axis=-1)


def _take(x: jax.Array, idx: jax.Array) -> jax.Array:
  return jnp.take_along_axis(x, idx[:, None], axis=-1)[:, 0]


def _last_positive(x: jax.Array) -> jax.Array:
  """Index of each row's last positive entry (0 if none)."""
  idx = jnp.arange(x.shape[-1], dtype=jnp.int32)
  return jnp.max(jnp.where(x > 0, idx, 0), axis=-1)


def _inverse_cdf(probs: jax.Array, u: jax.Array) -> jax.Array:
  """Index i of each row with cdf[i-1] < u * total <= cdf[i]. Cumulative sums run over
  blocks, then inside one block; where their rounding puts u * total past the end of a block
  or of the row (u = 1), the last positive entry before it is taken, so a zero-probability
  (filtered-out) token is never chosen."""
  rows, vocab = probs.shape
  padded = -(-vocab // _CDF_BLOCK) * _CDF_BLOCK
  blocks = jnp.pad(probs, ((0, 0), (0, padded - vocab))).reshape(rows, -1, _CDF_BLOCK)
  block_sums = blocks.sum(-1)
  block_cdf = jnp.cumsum(block_sums, axis=-1)
  target = u * block_cdf[:, -1]
  block = jnp.minimum(jnp.sum(block_cdf < target[:, None], axis=-1), _last_positive(block_sums))
  before = jnp.where(block > 0, _take(block_cdf, jnp.maximum(block - 1, 0)), 0.0)
  inner = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]
  inner_cdf = jnp.cumsum(inner, axis=-1) + before[:, None]
  offset = jnp.minimum(jnp.sum(inner_cdf < target[:, None], axis=-1), _last_positive(inner))
  return (block * _CDF_BLOCK + offset).astype(jnp.int32)


def _nucleus_by_bisection(probs: jax.Array, target: jax.Array) -> jax.Array:
  """Largest p* with sum(probs[probs >= p*]) >= target, exactly: a bisection over the bit
  patterns of non-negative float32 values, which order like the values."""
  bits = jax.lax.bitcast_convert_type(probs, jnp.int32)

  def body(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo + 1) // 2
    ok = jnp.sum(jnp.where(bits >= mid[:, None], probs, 0.0), axis=-1) >= target
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

  lo = jnp.zeros(probs.shape[:1], jnp.int32)
  hi = jnp.full(probs.shape[:1], 0x3F800000, jnp.int32)  # bits of 1.0
  lo, _ = jax.lax.fori_loop(0, 31, body, (lo, hi))
  return jax.lax.bitcast_convert_type(lo, _F32)


def _filter_threshold(probs: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
                      candidates: int) -> jax.Array:
  """Per-row probability threshold: tokens with p >= threshold survive top-k, then top-p
  on the renormalised top-k distribution, then min-p (HF's order); tokens tied with the last
  one kept are kept too. min-p is relative to the most likely token, which the others always
  keep, so it needs no renormalisation. top_k must be <= candidates."""
  c = min(candidates, probs.shape[-1])
  vals = jax.lax.top_k(probs, c)[0]  # [rows, c], descending
  csum = jnp.cumsum(vals, axis=-1)
  use_k = top_k > 0
  k_idx = jnp.clip(top_k - 1, 0, c - 1)
  t_k = jnp.where(use_k, _take(vals, k_idx), 0.0)
  target = top_p * jnp.where(use_k, _take(csum, k_idx), jnp.sum(probs, axis=-1))
  size = jnp.sum(csum < target[:, None], axis=-1)  # nucleus = the top size + 1 candidates
  found = size < c
  t_p = _take(vals, jnp.minimum(size, c - 1))
  use_p = top_p < 1
  t_p = jax.lax.cond(jnp.any(use_p & ~found),
                     lambda: jnp.where(found, t_p, _nucleus_by_bisection(probs, target)),
                     lambda: t_p)
  return jnp.maximum(jnp.maximum(t_k, jnp.where(use_p, t_p, 0.0)), min_p * vals[:, 0])


def _penalize(logits: jax.Array, seen: jax.Array, penalty: jax.Array) -> jax.Array:
  """transformers' repetition penalty: the logit of every seen id is divided by the row's
  penalty when positive, multiplied by it when negative (a penalty of 1 changes nothing)."""
  p = penalty[:, None]
  return jnp.where(seen, jnp.where(logits < 0, logits * p, logits / p), logits)


def sample(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array,
           seeds: jax.Array, positions: jax.Array, *, min_p: jax.Array,
           repetition_penalty: jax.Array, seen: jax.Array,
           candidates: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Samples one token per row of `logits` [rows, vocab].

  Returns (tokens, logprobs under the sampling distribution, logprobs under the model's own
  distribution), each [rows]. The sampling distribution of a greedy row is a point mass
  (logprob 0). `seen` [rows, vocab] (bool) marks the ids each row's sequence holds, for the
  repetition penalty. `positions` are the positions the new tokens will take; with `seeds`
  they pick each row's random number.
  """
  logits = logits.astype(_F32)
  penalized = jax.lax.cond(jnp.any(repetition_penalty != 1),
                           lambda: _penalize(logits, seen, repetition_penalty),
                           lambda: logits)
  greedy = temperature <= 0
  greedy_tokens = _first_argmax(penalized)

  def stochastic():
    # The max is taken out before the division: at a tiny temperature, logits / T rounds at
    # magnitudes where XLA's fused recomputations of it disagree by more than exp's range.
    shifted = penalized - jnp.max(penalized, axis=-1, keepdims=True)
    scaled = shifted / jnp.where(greedy, 1.0, temperature)[:, None]
    probs = jax.nn.softmax(scaled, axis=-1)
    threshold = jax.lax.cond(jnp.any((top_k > 0) | (top_p < 1) | (min_p > 0)),
                             lambda: _filter_threshold(probs, top_k, top_p, min_p, candidates),
                             lambda: jnp.zeros_like(top_p))
    keep = probs >= threshold[:, None]
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)
    u = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, dtype=_F32))(keys)  # (0, 1]
    tokens = _inverse_cdf(jnp.where(keep, probs, 0.0), u)
    kept = jnp.where(keep, scaled, -jnp.inf)
    return tokens, _take(scaled, tokens) - jax.nn.logsumexp(kept, axis=-1)

  sampled, sample_lp = jax.lax.cond(
      jnp.any(~greedy), stochastic,
      lambda: (greedy_tokens, jnp.zeros(logits.shape[:1], _F32)))
  tokens = jnp.where(greedy, greedy_tokens, sampled)
  sample_lp = jnp.where(greedy, 0.0, sample_lp)
  model_lp = _take(logits, tokens) - jax.nn.logsumexp(logits, axis=-1)
  return tokens, sample_lp, model_lp
