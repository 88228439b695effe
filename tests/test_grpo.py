"""GRPO loss against hand-computed values: clipping sides, clip-higher, dual clip, TIS, KL,
and every aggregation mode."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.rl import batch as B
from sage_jax.rl import grpo

E = math.exp


def _batch(old, adv, mask=None, sampler=None, ref=None, weights=None):
  """A one-row TrainBatch [1, T] from per-token lists."""
  t = len(old)
  mask = np.ones(t, np.float32) if mask is None else np.asarray(mask, np.float32)
  row = lambda x: jnp.asarray(np.asarray(x, np.float32)[None])
  zeros = np.zeros(t, np.float32)
  return B.TrainBatch(
      tokens=jnp.zeros((1, t), jnp.int32), positions=jnp.zeros((1, t), jnp.int32),
      segment_ids=jnp.ones((1, t), jnp.int32), targets=jnp.zeros((1, t), jnp.int32),
      loss_mask=row(mask), weights=row(mask / mask.sum() if weights is None else weights),
      advantages=row(np.asarray(adv) * mask), old_logprobs=row(old),
      sampler_logprobs=row(old if sampler is None else sampler),
      ref_logprobs=row(zeros if ref is None else ref))


# Four tokens, log-ratios +0.5, -0.5, +0.1, +1.5 with advantages +1, -1, +1, -2.
OLD = [-1.0, -1.0, -1.0, -1.0]
NEW = [-0.5, -1.5, -0.9, 0.5]
ADV = [1.0, -1.0, 1.0, -2.0]


def _loss_tokens(config, **kw):
  batch = _batch(OLD, ADV, **kw)
  loss, stats = grpo.per_token_loss(config, jnp.asarray([NEW]), batch)
  return np.asarray(loss[0]), {k: np.asarray(v[0]) for k, v in stats.items()}


def test_symmetric_clip_both_sides():
  loss, stats = _loss_tokens(grpo.GRPOConfig(clip_eps_low=0.2, clip_eps_high=0.2))
  expected = [
      -1.2,  # A > 0, ratio e^0.5 = 1.65 > 1.2: clipped at the high side, -A * 1.2
      0.8,  # A < 0, ratio e^-0.5 = 0.61 < 0.8: clipped at the low side, -A * 0.8
      -E(0.1),  # inside the range: -A * ratio
      2 * E(1.5),  # A < 0, ratio above the range: max() keeps the unclipped 2 * 4.48
  ]
  np.testing.assert_allclose(loss, expected, rtol=1e-6)
  np.testing.assert_array_equal(stats["clip_frac"], [1, 1, 0, 0])
  np.testing.assert_array_equal(stats["clip_frac_high"], [1, 0, 0, 0])
  np.testing.assert_array_equal(stats["clip_frac_low"], [0, 1, 0, 0])


def test_clip_higher():
  loss, _ = _loss_tokens(grpo.GRPOConfig(clip_eps_low=0.2, clip_eps_high=0.28))
  np.testing.assert_allclose(loss, [-1.28, 0.8, -E(0.1), 2 * E(1.5)], rtol=1e-6)
  loss, _ = _loss_tokens(grpo.GRPOConfig(clip_eps_low=0.1, clip_eps_high=0.7))
  # Low side now 0.9; high side 1.7 leaves e^0.5 = 1.65 unclipped.
  np.testing.assert_allclose(loss, [-E(0.5), 0.9, -E(0.1), 2 * E(1.5)], rtol=1e-6)


def test_dual_clip_bounds_negative_advantages_only():
  loss, stats = _loss_tokens(grpo.GRPOConfig(dual_clip_c=3.0))
  # Token 3: min(2 * e^1.5 = 8.96, -A * c = 6) = 6. Others unchanged (token 1's 0.8 < 3).
  np.testing.assert_allclose(loss, [-1.2, 0.8, -E(0.1), 6.0], rtol=1e-6)
  np.testing.assert_array_equal(stats["dual_clip_frac"], [0, 0, 0, 1])
  # A large positive-advantage ratio is never dual-clipped.
  batch = _batch([-1.0], [1.0])
  loss, _ = grpo.per_token_loss(grpo.GRPOConfig(dual_clip_c=1.5, clip_eps_high=10.0),
                                jnp.asarray([[1.0]]), batch)
  np.testing.assert_allclose(np.asarray(loss), [[-E(2.0)]], rtol=1e-6)


def test_negative_weight_scales_negative_advantages_only():
  base = [-1.2, 0.8, -E(0.1), 2 * E(1.5)]  # the symmetric clip's losses, above
  for weight in (0.0, 0.25):
    loss, _ = _loss_tokens(grpo.GRPOConfig(negative_weight=weight))
    np.testing.assert_allclose(loss, [base[0], weight * base[1], base[2], weight * base[3]],
                               rtol=1e-6)
  # At 0 a negative-advantage token has no gradient; a positive one keeps GRPO's.
  batch = _batch(OLD, ADV)
  grad = lambda config: np.asarray(jax.grad(lambda lp: jnp.sum(grpo.per_token_loss(
      config, lp, batch)[0]))(jnp.asarray([NEW], jnp.float32))[0])
  full, positive = grad(grpo.GRPOConfig()), grad(grpo.GRPOConfig(negative_weight=0.0))
  np.testing.assert_array_equal(positive[[1, 3]], 0.0)
  np.testing.assert_allclose(positive[[0, 2]], full[[0, 2]])
  assert np.all(full[[3]] != 0)
  with pytest.raises(ValueError, match="negative_weight"):
    grpo.GRPOConfig(negative_weight=-1.0)


def test_truncated_importance_weight():
  sampler = [-1.5, -0.5, -1.0, -3.0]  # pi_old / pi_sampler = e^0.5, e^-0.5, 1, e^2
  loss, stats = _loss_tokens(grpo.GRPOConfig(tis_cap=2.0), sampler=sampler)
  w = [min(E(0.5), 2.0), E(-0.5), 1.0, 2.0]
  base = [-1.2, 0.8, -E(0.1), 2 * E(1.5)]
  np.testing.assert_allclose(stats["tis_weight"], w, rtol=1e-6)
  np.testing.assert_allclose(loss, np.multiply(base, w), rtol=1e-6)


def test_kl_k3_and_other_estimators():
  ref = [-1.0, -1.0, -1.0, -1.0]  # ref - new = -0.5, +0.5, -0.1, -1.5
  d = np.subtract(ref, NEW)
  k3 = np.exp(d) - d - 1
  np.testing.assert_allclose(k3[1], E(0.5) - 1.5, rtol=1e-7)  # hand value of token 1
  loss, stats = _loss_tokens(grpo.GRPOConfig(kl_coef=0.1), ref=ref)
  base = np.asarray([-1.2, 0.8, -E(0.1), 2 * E(1.5)])
  np.testing.assert_allclose(stats["kl"], k3, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(loss, base + 0.1 * k3, rtol=1e-6, atol=1e-7)
  assert (k3 >= 0).all()
  new, r = jnp.asarray(NEW), jnp.asarray(ref)
  np.testing.assert_allclose(grpo.kl_penalty(new, r, "k1"), -d, rtol=1e-6)
  np.testing.assert_allclose(grpo.kl_penalty(new, r, "k2"), 0.5 * d ** 2, rtol=1e-6)
  # KL off: no reference term at all.
  loss, stats = _loss_tokens(grpo.GRPOConfig(), ref=ref)
  assert "kl" not in stats
  np.testing.assert_allclose(loss, base, rtol=1e-6)


def _grad(config, new, batch):
  return np.asarray(jax.grad(lambda lp: jnp.sum(grpo.per_token_loss(config, lp, batch)[0]))(
      jnp.asarray([new], jnp.float32))[0])


def test_off_mask_prompt_tokens_cannot_overflow_the_k3_gradient():
  # Token 1 is a prompt token (off the mask, reference logprob 0) that the policy finds very
  # unlikely: exp(0 - (-100)) overflows float32, and its gradient would be 0 * inf = NaN.
  new = [-0.5, -100.0]
  batch = _batch([-1.0, 0.0], [1.0, 0.0], mask=[1, 0], ref=[-1.0, 0.0])
  config = grpo.GRPOConfig(kl_coef=0.1)
  grad = _grad(config, new, batch)
  assert np.isfinite(grad).all() and grad[1] == 0.0
  d = -1.0 - (-0.5)
  loss, _ = grpo.per_token_loss(config, jnp.asarray([new]), batch)
  np.testing.assert_allclose(np.asarray(loss[0]), [-1.2 + 0.1 * (E(d) - d - 1), 0.0],
                             rtol=1e-6)


@pytest.mark.parametrize("level", grpo.RATIO_LEVELS)
def test_a_huge_ratio_is_clamped_not_infinite(level):
  # A negative-advantage token whose ratio is e^100: at negative_weight 0 its loss is 0 and
  # so is its gradient (0 * inf would be NaN and spread to every weight).
  batch = _batch([-101.0, -1.0], [-1.0, 1.0])
  config = grpo.GRPOConfig(negative_weight=0.0, ratio_level=level)
  loss, stats = grpo.per_token_loss(config, jnp.asarray([[-1.0, -1.0]]), batch)
  assert np.isfinite(np.asarray(loss)).all() and np.isfinite(_grad(config, [-1.0, -1.0],
                                                                   batch)).all()
  if level == "token":
    assert float(loss[0, 0]) == 0.0 and float(stats["max/ratio"].max()) == pytest.approx(
        E(grpo.MAX_LOG_RATIO), rel=1e-5)
  loss, _ = grpo.per_token_loss(grpo.GRPOConfig(), jnp.asarray([[-1.0, -1.0]]), batch)
  assert np.isfinite(np.asarray(loss)).all()  # weight 1: large, still a number


def test_masked_tokens_contribute_nothing():
  mask = [1, 0, 1, 0]
  loss, stats = _loss_tokens(grpo.GRPOConfig(), mask=mask)
  np.testing.assert_allclose(loss, [-1.2, 0.0, -E(0.1), 0.0], rtol=1e-6)
  assert stats["clip_frac"].tolist() == [1, 0, 0, 0]


# --- Aggregation ---------------------------------------------------------------------------

# Two sequences: A has 3 model tokens with losses a1..a3, B has 1 with loss b1. Each token's
# loss is -A * ratio with ratio 1 (new == old), so a token's loss is minus its advantage.
def _two_sequences(aggregation, norm_constant=None):
  # Sequence A: tokens [s, m, m, m] (s = not masked), advantage 2; B: [s, s, m], advantage -1.
  recs = [
      dict(tokens=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1], model_logprobs=[0, -1, -1, -1],
           advantage=2.0),
      dict(tokens=[1, 2, 3], loss_mask=[0, 0, 1], model_logprobs=[0, 0, -2], advantage=-1.0),
  ]
  batch, _ = B.make_batch(recs, B.BatchConfig(length_buckets=(8,)), aggregation=aggregation,
                          norm_constant=norm_constant)
  micro = jax.tree.map(jnp.asarray, B.micro_batches(batch)[0])
  loss, stats = grpo.batch_loss(grpo.GRPOConfig(), micro.old_logprobs, micro)  # ratio 1
  return float(loss), stats


def test_aggregation_token_mean():
  loss, _ = _two_sequences("token-mean")
  # (-2 - 2 - 2 + 1) / 4 tokens
  assert loss == pytest.approx((-2 - 2 - 2 + 1) / 4, rel=1e-6)


def test_aggregation_seq_mean_token_mean():
  loss, _ = _two_sequences("seq-mean-token-mean")
  # (mean(-2, -2, -2) + mean(+1)) / 2 sequences
  assert loss == pytest.approx((-2 + 1) / 2, rel=1e-6)


def test_aggregation_seq_mean_token_sum():
  loss, _ = _two_sequences("seq-mean-token-sum")
  # (sum(-2, -2, -2) + sum(+1)) / 2 sequences
  assert loss == pytest.approx((-6 + 1) / 2, rel=1e-6)


def test_aggregation_dr_grpo_constant_normaliser():
  loss, _ = _two_sequences("seq-mean-token-sum-norm", norm_constant=10)
  # (sum(-2, -2, -2) + sum(+1)) / 10, whatever the number of sequences (verl's agg_loss)
  assert loss == pytest.approx((-6 + 1) / 10, rel=1e-6)


def test_loss_weights_direct():
  masks = [np.array([1, 1, 0, 1]), np.array([0, 1]), np.array([0, 0])]
  w = B.loss_weights(masks, "token-mean")
  np.testing.assert_allclose(np.concatenate(w), [.25, .25, 0, .25, 0, .25, 0, 0])
  # The sequence means count the sequences that hold a masked token (verl's and tunix's
  # agg_loss): the third, all masked out, is not one of them.
  w = B.loss_weights(masks, "seq-mean-token-mean")
  np.testing.assert_allclose(np.concatenate(w), [1 / 6, 1 / 6, 0, 1 / 6, 0, 1 / 2, 0, 0])
  w = B.loss_weights(masks, "seq-mean-token-sum", norm_constant=4)
  np.testing.assert_allclose(np.concatenate(w), [1 / 2, 1 / 2, 0, 1 / 2, 0, 1 / 2, 0, 0])
  w = B.loss_weights(masks, "seq-mean-token-sum-norm", norm_constant=4)
  np.testing.assert_allclose(np.concatenate(w), [1 / 4, 1 / 4, 0, 1 / 4, 0, 1 / 4, 0, 0])
  # No sequence holds a trained token: every weight is 0 (no NaN reaches the update).
  for mode in B.AGGREGATIONS:
    w = B.loss_weights([np.zeros(3), np.zeros(2)], mode, norm_constant=4)
    np.testing.assert_array_equal(np.concatenate(w), 0.0)
  with pytest.raises(ValueError, match="norm_constant"):
    B.loss_weights(masks, "seq-mean-token-sum-norm")
  with pytest.raises(ValueError, match="unknown aggregation"):
    B.loss_weights(masks, "sum")


def test_config_validation():
  with pytest.raises(ValueError, match="dual_clip_c"):
    grpo.GRPOConfig(dual_clip_c=0.5)
  with pytest.raises(ValueError, match="norm_constant"):
    grpo.GRPOConfig(loss_aggregation="seq-mean-token-sum-norm")
  with pytest.raises(ValueError, match="loss_aggregation"):
    grpo.GRPOConfig(loss_aggregation="mean")
  assert not grpo.GRPOConfig().use_kl  # the paper's default: no KL


# --- GSPO, KL clamp ------------------------------------------------------------------------

def _gspo_batch():
  """Two sequences packed in one row: A (3 model tokens, advantage 2) and B (2 model tokens,
  advantage -1), with seq-mean-token-mean weights, and new logprobs for them."""
  recs = [dict(tokens=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1], model_logprobs=[0, -1, -1, -1],
               advantage=2.0),
          dict(tokens=[1, 2, 3], loss_mask=[0, 1, 1], model_logprobs=[0, -2, -2],
               advantage=-1.0)]
  batch, _ = B.make_batch(recs, B.BatchConfig(micro_batch_tokens=8, length_buckets=(8,)),
                          aggregation="seq-mean-token-mean")
  micro = jax.tree.map(jnp.asarray, B.micro_batches(batch)[0])
  assert micro.segment_ids.tolist() == [[1, 1, 1, 2, 2, 0, 0, 0]]  # both in one row
  # log-ratios: A +0.1, +0.2, -0.15 (mean 0.05); B -0.3, -0.5 (mean -0.4: clipped)
  delta = np.zeros(micro.old_logprobs.shape, np.float32)
  delta[0, :5] = [0.1, 0.2, -0.15, -0.3, -0.5]
  return micro, micro.old_logprobs + jnp.asarray(delta)


def test_gspo_sequence_ratio_equals_the_papers_objective():
  micro, new = _gspo_batch()
  eps = 0.2
  config = grpo.GRPOConfig(ratio_level="sequence", clip_eps_low=eps, clip_eps_high=eps)
  loss, _ = grpo.batch_loss(config, new, micro)
  s_a, s_b = E(0.05), E(-0.4)
  # J = 1/G sum_i min(s_i A_i, clip(s_i) A_i); the loss is -J.
  reference = -(min(s_a * 2, min(max(s_a, 1 - eps), 1 + eps) * 2)
                + min(s_b * -1, min(max(s_b, 1 - eps), 1 + eps) * -1)) / 2
  assert float(loss) == pytest.approx(reference, rel=1e-5)
  # GSPO-token has the same value and, with one advantage per sequence, the same gradient:
  # d loss / d logp_t = -A_i s_i / (G |y_i|) where unclipped (A), 0 where clipped (B).
  grads = {}
  for level in ("sequence", "sequence-token"):
    c = dataclasses.replace(config, ratio_level=level)
    value, grads[level] = jax.value_and_grad(
        lambda lp: grpo.batch_loss(c, lp, micro)[0])(new)
    assert float(value) == pytest.approx(reference, rel=1e-5)
  np.testing.assert_allclose(grads["sequence"], grads["sequence-token"], atol=1e-6)
  np.testing.assert_allclose(np.asarray(grads["sequence"])[0, :5],
                             [-2 * s_a / 6] * 3 + [0.0, 0.0], atol=1e-6)


def test_gspo_sequence_log_ratio_is_clamped_at_10_as_verl_does():
  """A sequence whose mean log-ratio is 15 and advantage negative: its ratio is e^10 (verl's
  compute_policy_loss_gspo clamps there), with no gradient beyond the clamp; a token-level
  log-ratio of 15 stays unclamped (verl clamps those at 20)."""
  recs = [dict(tokens=[1, 2, 3, 4, 5], loss_mask=[0, 1, 1, 1, 1], model_logprobs=[0] + [-20] * 4,
               advantage=-1.0)]
  batch, _ = B.make_batch(recs, B.BatchConfig(micro_batch_tokens=8, length_buckets=(8,)),
                          aggregation="seq-mean-token-mean")
  micro = jax.tree.map(jnp.asarray, B.micro_batches(batch)[0])
  new = micro.old_logprobs + 15.0 * micro.loss_mask
  for level, ratio in (("sequence", E(10.0)), ("sequence-token", E(10.0)), ("token", E(15.0))):
    config = grpo.GRPOConfig(ratio_level=level, loss_aggregation="seq-mean-token-mean")
    loss, grad = jax.value_and_grad(lambda lp: grpo.batch_loss(config, lp, micro)[0])(new)
    assert float(loss) == pytest.approx(ratio, rel=1e-5)  # -A * r, the larger of pg's two
    if level != "token":
      np.testing.assert_array_equal(np.asarray(grad), 0.0)


def test_kl_clamp():
  ref = [3.0, -1.0, -1.0, -1.0]  # a large log-ratio on token 0
  config = grpo.GRPOConfig(kl_coef=1.0, kl_clamp=2.0)
  _, stats = _loss_tokens(config, ref=ref)
  log_ratio = np.asarray(ref) - np.asarray(NEW)
  k3 = np.exp(log_ratio) - log_ratio - 1
  np.testing.assert_allclose(stats["kl"], np.minimum(k3, 2.0), rtol=1e-5)
  assert k3[0] > 2.0
  # k3 clips its log-ratio before the exp: a token 94 nats likelier under the reference gives
  # a finite estimate and gradient (unclipped: inf, and NaN under the clamp).
  new, far = jnp.asarray([-95.0, -1.0]), jnp.asarray([-1.0, -95.0])
  for clamp in (None, 10.0):
    kl, grad = jax.value_and_grad(lambda lp: jnp.sum(jnp.clip(
        grpo.kl_penalty(lp, far), -(clamp or jnp.inf), clamp or jnp.inf)))(new)
    assert np.isfinite(float(kl)) and np.isfinite(np.asarray(grad)).all()
  np.testing.assert_allclose(grpo.kl_penalty(new, far), [np.exp(20) - 21, np.exp(-20) + 19],
                             rtol=1e-6)
  with pytest.raises(ValueError, match="kl_clamp"):
    grpo.GRPOConfig(kl_clamp=0.0)
  with pytest.raises(ValueError, match="ratio_level"):
    grpo.GRPOConfig(ratio_level="segment")


# --- Advantage estimators ------------------------------------------------------------------

def test_advantage_estimators_equal_their_formulas():
  from sage_jax.rl import advantages as A
  r = np.asarray([1.0, 0.0, 2.0, 2.0])
  eps = 1e-6
  pop = A.group_advantages(r, A.AdvantageConfig())
  np.testing.assert_allclose(pop, (r - r.mean()) / (np.sqrt(((r - r.mean()) ** 2).mean()) + eps))
  unbiased = A.group_advantages(r, A.AdvantageConfig(std="unbiased"))
  np.testing.assert_allclose(
      unbiased, (r - r.mean()) / (np.sqrt(((r - r.mean()) ** 2).sum() / 3) + eps))
  rloo = A.group_advantages(r, A.AdvantageConfig(estimator="rloo"))
  np.testing.assert_allclose(rloo, [r[i] - np.delete(r, i).mean() for i in range(4)])
  assert A.group_advantages([1.0], A.AdvantageConfig(estimator="rloo")).tolist() == [0.0]
  with pytest.raises(ValueError, match="std"):
    A.AdvantageConfig(std="sample")
