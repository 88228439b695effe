"""The GRPO policy loss over the model's own tokens.

Per masked token t with advantage A (the sequence's), ratio r = pi_theta / pi_old:

  pg   = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))   (clip-higher: eps_high > eps_low)
  ratio_level "token" (GRPO): r_t = exp(logp_t - old_t)
              "sequence" (GSPO): r = exp(mean_t (logp_t - old_t)) over the sequence's masked
                tokens, the same on each of them (its loss, with the seq-mean-token-mean
                weights that loss_aggregation "auto" gives it, is GSPO's per-sequence
                objective)
              "sequence-token" (GSPO-token): r_t = sg(r) * pi_theta(t) / sg(pi_theta(t)): the
                sequence ratio's value, each token's own gradient
              the log-ratio clamped first, as verl does: to [-20, 20] per token, to at most
                10 for a sequence's (verl's GSPO loss); r cannot overflow, so a weight of 0
                (negative_weight) never meets an infinite ratio (0 * inf = NaN)
  dual clip (A < 0 only): pg = min(pg, -A * c), c = dual_clip_c > 1
  negative weight (A < 0 only, optional): pg *= negative_weight (0: positive samples only)
  truncated importance weight (optional): pg *= min(pi_old / pi_sampler, tis_cap), no gradient
  KL to a frozen reference (optional, k3): kl = exp(d) - d - 1, d = ref - logp clipped to
    [-20, 20] as verl does (a token 89 nats likelier under the reference overflows the exp
    to inf, and the step is skipped as non-finite), optionally clamped to [-kl_clamp,
    kl_clamp] (verl clamps k3 to [-10, 10]); off the mask it is 0 before the exp, so a very
    unlikely prompt token cannot overflow it (its gradient would be NaN even though the mask
    drops its value)
  loss_t = pg + kl_coef * kl - entropy_coef * entropy

The batch loss is sum_t weight_t * loss_t with weights from `rl.batch.loss_weights` (verl's
aggregation modes: token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm),
computed over the whole batch so that micro-batches add up exactly.

`old_logprobs` are the rollout's `model_logprobs` (the unmodified model at sampling time), so
one update per batch is strictly on-policy: r = 1 at the start of the update, up to numerics.
Rollouts sampled at a temperature T != 1 train softmax(logits / T) (`GRPOConfig.temperature`),
with pi_old recomputed by the trainer at T.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal

import jax
import jax.numpy as jnp

from sage_jax.model.logprobs import token_logprobs
from sage_jax.model.qwen2 import Qwen2
from sage_jax.rl.batch import AGGREGATIONS, Aggregation, TrainBatch

KLEstimator = Literal["k1", "k2", "k3"]
K3_LOG_RATIO_BOUND = 20.0
RATIO_LEVELS = ("token", "sequence", "sequence-token")
MAX_LOG_RATIO = 20.0  # |log pi_theta / pi_old| beyond it is clamped (exp(20) ~ 5e8)
MAX_SEQUENCE_LOG_RATIO = 10.0  # a sequence's mean log-ratio, clamped from above (verl's GSPO)


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """GRPO update hyper-parameters (defaults: the paper's strictly on-policy GRPO, no KL).

  clip_eps_low / clip_eps_high: ratio clip range [1 - low, 1 + high]; high > low is
    "clip-higher" (DAPO uses 0.2 / 0.28).
  dual_clip_c: dual-clip bound c (> 1, e.g. 3.0) on the loss of negative-advantage tokens;
    None = off.
  loss_aggregation: "token-mean" (every token of the batch weighs the same),
    "seq-mean-token-mean", "seq-mean-token-sum", or "seq-mean-token-sum-norm" (Dr.GRPO;
    needs `norm_constant`); see `rl.batch.loss_weights`. "auto" (default): the ratio
    level's own objective, token-mean for GRPO and seq-mean-token-mean for GSPO and
    GSPO-token, whose paper weighs each sequence once (verl's GSPO loss aggregates so
    whatever its mode); `aggregation` is the one in effect.
  norm_constant: the constant normaliser of seq-mean-token-sum-norm, e.g. the generation
    budget in tokens.
  kl_coef: weight of the KL penalty to the frozen reference (0 = off, no reference forward).
  kl_estimator: k3 (Schulman's unbiased, non-negative estimator; default), k1 or k2.
  kl_clamp: clamp each token's KL estimate to [-kl_clamp, kl_clamp]; None = off.
  ratio_level: "token" (GRPO), "sequence" (GSPO) or "sequence-token" (GSPO-token); see the
    module docstring. GSPO's paper uses much tighter clip ranges (e.g. 3e-4 / 4e-4).
  entropy_coef: entropy bonus weight (0 = off; entropy is still reported).
  negative_weight: weight of the policy-gradient loss of tokens whose advantage is negative
    (1 = GRPO). 0 trains on the better-than-average rollouts only: positive sample
    reinforcement, which sharpens the policy (Zhu et al. 2025, "The Surprising Effectiveness
    of Negative Reinforcement in LLM Reasoning", weigh the two sides against each other).
  tis_cap: truncated importance sampling against the sampler's logprobs: tokens are
    weighted by min(pi_old / pi_sampler, tis_cap); None = off. pi_old is the sampler's own
    model logprob unless recomputed by the trainer (`recompute_old_logprobs`, or a sampling
    temperature other than 1), so without a recompute it corrects only what sampling
    changed of the model's distribution (top-p, top-k, the repetition penalty), as verl's
    rollout correction does against the trainer's recomputed logprobs.
  num_mini_batches: optimiser updates per rollout batch (1 = strictly on-policy).
  shuffle_mini_batches: shuffle sequences before splitting them into mini-batches.
  recompute_old_logprobs: recompute pi_old with the trainer's forward before the first
    update instead of using the rollout's model_logprobs (e.g. when sampling in another
    precision).
  logprob_chunk: tokens per chunk of the logits computation (0 = all at once), which bounds
    the memory of [tokens, vocab] logits; see `model.logprobs`.
  temperature: the rollouts' sampling temperature. pi_theta, pi_old and the KL reference
    are softmax(logits / temperature), the policy the episodes were drawn from (verl and
    TRL scale the trainer's logits the same way); at 1.0, pi_old is the sampler's own
    model logprob, otherwise the trainer recomputes it before the update (the sampler's is
    at temperature 1). A run sets it from agent.temperature.
  """

  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.2
  dual_clip_c: float | None = None
  loss_aggregation: str = "auto"
  norm_constant: float | None = None
  kl_coef: float = 0.0
  kl_estimator: KLEstimator = "k3"
  kl_clamp: float | None = None
  ratio_level: str = "token"
  entropy_coef: float = 0.0
  negative_weight: float = 1.0
  tis_cap: float | None = None
  num_mini_batches: int = 1
  shuffle_mini_batches: bool = True
  recompute_old_logprobs: bool = False
  logprob_chunk: int = 2048
  temperature: float = 1.0

  def __post_init__(self):
    if not 0 <= self.clip_eps_low < 1 or self.clip_eps_high < 0:
      raise ValueError(f"clip_eps_low={self.clip_eps_low} must be in [0, 1) and "
                       f"clip_eps_high={self.clip_eps_high} >= 0")
    if self.dual_clip_c is not None and self.dual_clip_c <= 1:
      raise ValueError(f"dual_clip_c={self.dual_clip_c} must be > 1 (or None)")
    if self.loss_aggregation not in ("auto",) + AGGREGATIONS:
      raise ValueError(f"loss_aggregation={self.loss_aggregation!r}; expected 'auto' or one "
                       f"of {AGGREGATIONS}")
    if self.loss_aggregation == "seq-mean-token-sum-norm" and not (
        self.norm_constant and self.norm_constant > 0):
      raise ValueError("loss_aggregation='seq-mean-token-sum-norm' needs norm_constant > 0")
    if self.kl_coef < 0 or self.entropy_coef < 0 or self.negative_weight < 0:
      raise ValueError("kl_coef, entropy_coef and negative_weight must be >= 0")
    if self.kl_estimator not in ("k1", "k2", "k3"):
      raise ValueError(f"kl_estimator={self.kl_estimator!r}; expected k1, k2 or k3")
    if self.kl_clamp is not None and self.kl_clamp <= 0:
      raise ValueError(f"kl_clamp={self.kl_clamp} must be > 0 (or None)")
    if self.ratio_level not in RATIO_LEVELS:
      raise ValueError(f"ratio_level={self.ratio_level!r}; expected one of {RATIO_LEVELS}")
    if self.tis_cap is not None and self.tis_cap <= 0:
      raise ValueError(f"tis_cap={self.tis_cap} must be > 0 (or None)")
    if self.num_mini_batches < 1:
      raise ValueError(f"num_mini_batches={self.num_mini_batches} must be >= 1")
    if self.logprob_chunk < 0:
      raise ValueError(f"logprob_chunk={self.logprob_chunk} must be >= 0")
    if not self.temperature > 0:
      raise ValueError(f"temperature={self.temperature} must be > 0: GRPO trains a sampled "
                       "policy (a greedy one gives a group identical rollouts)")

  @property
  def aggregation(self) -> Aggregation:
    """The loss aggregation in effect (`loss_aggregation`, "auto" resolved)."""
    if self.loss_aggregation != "auto":
      return self.loss_aggregation
    return "token-mean" if self.ratio_level == "token" else "seq-mean-token-mean"

  @property
  def use_kl(self) -> bool:
    return self.kl_coef > 0

  @property
  def recomputes_old_logprobs(self) -> bool:
    """Whether pi_old comes from the trainer rather than the sampler's model logprobs."""
    return self.recompute_old_logprobs or self.temperature != 1.0


def kl_penalty(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: str = "k3") -> jax.Array:
  """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta."""
  log_ratio = ref_logprobs - logprobs
  if estimator == "k1":
    return -log_ratio
  if estimator == "k2":
    return 0.5 * log_ratio ** 2
  if estimator == "k3":
    log_ratio = jnp.clip(log_ratio, -K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    return jnp.exp(log_ratio) - log_ratio - 1.0
  raise ValueError(f"unknown KL estimator {estimator!r}")


def sequence_mean(values: jax.Array, mask: jax.Array, segment_ids: jax.Array) -> jax.Array:
  """Each position's sequence mean of `values` over the sequence's masked positions, for
  rows [R, T] of packed sequences (segment ids 1.., 0 = padding)."""
  rows, length = values.shape
  ids = (jnp.arange(rows)[:, None] * (length + 1) + segment_ids).reshape(-1)
  n = rows * (length + 1)
  sums = jax.ops.segment_sum((values * mask).reshape(-1), ids, num_segments=n)
  counts = jax.ops.segment_sum(mask.reshape(-1), ids, num_segments=n)
  return (sums / jnp.maximum(counts, 1.0))[ids].reshape(rows, length)


def per_token_loss(config: GRPOConfig, logprobs: jax.Array, batch: TrainBatch,
                   entropy: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Per-position loss (0 off the mask) and per-position statistics (sums over the mask give
  the metrics). `logprobs`: log pi_theta of each target."""
  mask = batch.loss_mask
  adv = batch.advantages
  log_ratio = jnp.where(mask > 0, logprobs - batch.old_logprobs, 0.0)
  if config.ratio_level == "sequence":
    log_ratio = sequence_mean(log_ratio, mask, batch.segment_ids)
  elif config.ratio_level == "sequence-token":
    log_ratio = (jax.lax.stop_gradient(sequence_mean(log_ratio, mask, batch.segment_ids))
                 + logprobs - jax.lax.stop_gradient(logprobs))
  top = MAX_LOG_RATIO if config.ratio_level == "token" else MAX_SEQUENCE_LOG_RATIO
  ratio = jnp.exp(jnp.clip(log_ratio, -MAX_LOG_RATIO, top))
  low, high = 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high
  pg_unclipped = -adv * ratio
  pg_clipped = -adv * jnp.clip(ratio, low, high)
  pg = jnp.maximum(pg_unclipped, pg_clipped)
  clipped = pg_clipped > pg_unclipped
  stats = {
      "clip_frac": clipped.astype(jnp.float32),
      "clip_frac_low": (clipped & (ratio < low)).astype(jnp.float32),
      "clip_frac_high": (clipped & (ratio > high)).astype(jnp.float32),
      "ratio_mean": ratio,
      "max/ratio": ratio,
      "max/neg_ratio": -ratio,  # reported as ratio_min
  }
  if config.dual_clip_c is not None:
    bound = -adv * config.dual_clip_c
    dual = (adv < 0) & (pg > bound)
    pg = jnp.where(dual, bound, pg)
    stats["dual_clip_frac"] = dual.astype(jnp.float32)
  if config.negative_weight != 1.0:
    pg = jnp.where(adv < 0, config.negative_weight * pg, pg)
  if config.tis_cap is not None:
    w = jnp.minimum(jnp.exp(batch.old_logprobs - batch.sampler_logprobs), config.tis_cap)
    w = jax.lax.stop_gradient(jnp.where(mask > 0, w, 0.0))
    pg = pg * w
    stats["tis_weight"] = w
  stats["pg_loss"] = pg
  loss = pg
  if config.use_kl:
    on_mask = jnp.where(mask > 0, logprobs, batch.ref_logprobs)  # log-ratio 0 off the mask
    kl = kl_penalty(on_mask, batch.ref_logprobs, config.kl_estimator)
    if config.kl_clamp is not None:
      kl = jnp.clip(kl, -config.kl_clamp, config.kl_clamp)
    loss = loss + config.kl_coef * kl
    stats["kl"] = kl
  if entropy is not None:
    if config.entropy_coef:
      loss = loss - config.entropy_coef * entropy
    stats["entropy"] = entropy
  stats["logprob"] = logprobs
  # KL(sampler || pi_old) from the sampler's own samples (k3): how far sampling (temperature,
  # top-p, numerics) is from the distribution the ratio uses.
  stats["sampler_kl"] = kl_penalty(batch.sampler_logprobs, batch.old_logprobs, "k3")
  loss = jnp.where(mask > 0, loss, 0.0)
  stats = {k: jnp.where(mask > 0, v, 0.0 if not k.startswith("max/") else -jnp.inf)
           for k, v in stats.items()}
  return loss, stats


def batch_loss(config: GRPOConfig, logprobs: jax.Array, batch: TrainBatch,
               entropy: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """sum(weights * per-token loss), and the statistics reduced: sums over masked tokens
  (divide by the token count for means), maxima under "max/" keys, and the weighted
  pg and KL parts under "weighted/"."""
  loss_tok, stats = per_token_loss(config, logprobs, batch, entropy)
  loss = jnp.sum(batch.weights * loss_tok)
  out = {k: (jnp.max(v) if k.startswith("max/") else jnp.sum(v)) for k, v in stats.items()}
  out["weighted/pg_loss"] = jnp.sum(batch.weights * stats["pg_loss"])
  if "kl" in stats:
    out["weighted/kl"] = jnp.sum(batch.weights * stats["kl"])
  return loss, out


def gradient_mask(config: GRPOConfig) -> Callable[[TrainBatch], jax.Array]:
  """The positions whose loss has a gradient: with neither KL nor entropy term, only those
  with a non-zero advantage (a zero advantage makes every form of the policy-gradient term 0,
  clipped, dual-clipped, weighted or not), and only positive ones at negative_weight 0;
  otherwise every loss position."""
  if config.use_kl or config.entropy_coef:
    return lambda batch: batch.loss_mask
  if config.negative_weight == 0:
    return lambda batch: jnp.where(batch.advantages > 0, batch.loss_mask, 0.0)
  return lambda batch: jnp.where(batch.advantages != 0, batch.loss_mask, 0.0)


def make_loss_fn(config: GRPOConfig) -> Callable[[Qwen2, TrainBatch], tuple[jax.Array, dict]]:
  """The train step's loss for one micro-batch [R, T]: (weighted loss sum, statistics)."""

  def loss_fn(model: Qwen2, batch: TrainBatch):
    logprobs, entropy = token_logprobs(model, batch.tokens, batch.positions, batch.segment_ids,
                                       batch.targets, chunk=config.logprob_chunk,
                                       temperature=config.temperature)
    entropy = entropy if config.entropy_coef else jax.lax.stop_gradient(entropy)
    return batch_loss(config, logprobs, batch, entropy)

  return loss_fn
