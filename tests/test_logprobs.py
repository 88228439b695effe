"""The fused LM head (logprobs + entropy with a hand-written gradient) against autodiff of
the plain formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.model.logprobs import head_logprobs


def _plain(hidden, head, targets, temperature=1.0):
  """The sampler's distribution: float32 logits over the temperature."""
  logits = jnp.einsum("rte,ve->rtv", hidden, head.astype(hidden.dtype),
                      preferred_element_type=jnp.float32) / jnp.float32(temperature)
  log_p = jax.nn.log_softmax(logits, axis=-1)
  logprob = jnp.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]
  entropy = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
  return logprob, entropy


def _inputs(dtype, vocab=301, rows=3, t=7, embed=16, scale=2.0):
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.standard_normal((rows, t, embed)), dtype)
  head = jnp.asarray(scale * rng.standard_normal((vocab, embed)) / np.sqrt(embed), jnp.float32)
  targets = jnp.asarray(rng.integers(0, vocab, (rows, t)), jnp.int32)
  weights = (jnp.asarray(rng.standard_normal((rows, t)), jnp.float32),
             jnp.asarray(rng.standard_normal((rows, t)), jnp.float32))
  return hidden, head, targets, weights


@pytest.mark.parametrize("entropy_weight,temperature", [(0.0, 1.0), (0.3, 1.0), (0.3, 0.7)])
def test_values_and_gradients_match_autodiff(entropy_weight, temperature):
  hidden, head, targets, (w_lp, w_ent) = _inputs(jnp.float32)

  def objective(fn):
    def f(h, w):
      lp, ent = fn(h, w, targets, temperature)
      ent = ent if entropy_weight else jax.lax.stop_gradient(ent)
      return jnp.sum(w_lp * lp) + entropy_weight * jnp.sum(w_ent * ent), (lp, ent)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))

  (loss, (lp, ent)), (dh, dw) = objective(head_logprobs)(hidden, head)
  (loss_ref, (lp_ref, ent_ref)), (dh_ref, dw_ref) = objective(_plain)(hidden, head)
  np.testing.assert_allclose(lp, lp_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ent, ent_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
  np.testing.assert_allclose(dh, dh_ref, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(dw, dw_ref, rtol=1e-4, atol=1e-6)
  assert float(jnp.abs(dw).max()) > 0 and float(jnp.abs(dh).max()) > 0


def test_a_full_vocabulary_sums_without_bias():
  """Over Qwen2.5's 151936 entries the log-partition and entropy sums lose no small terms
  (float32 summed one after another put every logprob ~1e-4 high); with the vocabulary split
  over `tensor`, the values are the same."""
  from sage_jax import sharding as shd  # noqa: PLC0415

  hidden, head, targets, _ = _inputs(jnp.float32, vocab=151936, rows=2, t=16, embed=32,
                                     scale=3.5)
  lp, ent = jax.jit(head_logprobs)(hidden, head, targets)
  logits = np.einsum("rte,ve->rtv", np.asarray(hidden, np.float64), np.asarray(head, np.float64))
  top = logits.max(-1, keepdims=True)
  p = np.exp(logits - top)
  lse = np.log(p.sum(-1)) + top[..., 0]
  lp_ref = np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0] - lse
  ent_ref = lse - (p * logits).sum(-1) / p.sum(-1)
  assert abs(float(np.mean(lp - lp_ref))) < 5e-6 and abs(float(np.mean(ent - ent_ref))) < 5e-6
  mesh = shd.make_mesh(shd.MeshConfig(fsdp=1, tensor=8))
  with shd.use_rules(mesh):
    split = jax.jit(head_logprobs)(hidden, head, targets)
  np.testing.assert_allclose(split[0], lp, atol=2e-5)
  np.testing.assert_allclose(split[1], ent, atol=2e-5)


def test_large_logits_stay_finite():
  """The log-sum-exp is taken around the row's maximum: logits of 1e4 do not overflow."""
  hidden, head, targets, _ = _inputs(jnp.float32, scale=3e4)
  lp, ent = head_logprobs(hidden, head, targets)
  lp_ref, ent_ref = _plain(hidden, head, targets)
  assert np.isfinite(lp).all() and np.isfinite(ent).all()
  np.testing.assert_allclose(lp, lp_ref, rtol=1e-5, atol=1e-2)
  grads = jax.grad(lambda h: jnp.sum(head_logprobs(h, head, targets)[0]))(hidden)
  assert np.isfinite(grads).all()


def test_bfloat16_hidden_states_keep_their_dtype_in_the_gradient():
  hidden, head, targets, (w_lp, _) = _inputs(jnp.bfloat16)
  f = lambda fn: jax.grad(lambda h, w: jnp.sum(w_lp * fn(h, w, targets)[0]), argnums=(0, 1))
  dh, dw = f(head_logprobs)(hidden, head)
  dh_ref, dw_ref = f(_plain)(hidden, head)
  assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(dh, np.float32), np.asarray(dh_ref, np.float32),
                             rtol=0.05, atol=0.02)
  np.testing.assert_allclose(dw, dw_ref, rtol=0.05, atol=0.02)


def test_bfloat16_hidden_states_at_a_temperature_give_the_samplers_logprobs():
  """The float32 logits are divided by the temperature, as the sampler divides them: not the
  bfloat16 hidden states multiplied by a bfloat16 1 / temperature (0.7 would become 0.6995,
  every state rounded again)."""
  hidden, head, targets, _ = _inputs(jnp.bfloat16, scale=8.0)
  lp, ent = head_logprobs(hidden, head, targets, 0.7)
  lp_ref, ent_ref = _plain(hidden, head, targets, 0.7)
  np.testing.assert_allclose(lp, lp_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ent, ent_ref, rtol=1e-5, atol=1e-5)
