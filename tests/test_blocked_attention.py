"""Blocked training attention against the dense form it replaces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sage_jax.model.blocked_attention import BlockedCausal, blocked_attention
from sage_jax.weights import hf
from sage_jax.weights.loader import ModelSpec
from tests.hf_reference import tiny_hf_model


def _dense(q, k, v, segments):
  """Reference: [b, t, kv, g, d] queries, full [t, t] causal and same-segment mask."""
  t, d = q.shape[1], q.shape[-1]
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
  allowed = jnp.tril(jnp.ones((t, t), bool))[None] & (segments[:, :, None] == segments[:, None])
  scores = jnp.where(allowed[:, None, None], scores * d ** -0.5, jnp.finfo(jnp.float32).min)
  return jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(scores, -1).astype(v.dtype), v)


def _inputs(b=2, t=37, kv=2, g=3, d=8, dtype=jnp.float32):
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(keys[0], (b, t, kv, g, d)).astype(dtype)
  k = jax.random.normal(keys[1], (b, t, kv, d)).astype(dtype)
  v = jax.random.normal(keys[2], (b, t, kv, d)).astype(dtype)
  weights = jax.random.normal(keys[3], (b, t, kv, g, d))
  # Row 0: two packed sequences then padding (segment 0); row 1: one sequence.
  segments = jnp.asarray([[1] * 10 + [2] * 20 + [0] * (t - 30), [1] * t])
  return q, k, v, weights, segments


# Row 0 packs four sequences and padding, so most blocks below the diagonal are skipped;
# row 1 reuses ids out of order (1 comes back after 2), which only a superset may skip.
_MANY_SEGMENTS = [[1] * 7 + [2] * 9 + [3] * 5 + [4] * 10 + [0] * 6,
                  [1] * 6 + [2] * 6 + [1] * 6 + [3] * 19]


@pytest.mark.parametrize("block", [4, 16, 64])  # 37 tokens: ragged blocks, and one block
@pytest.mark.parametrize("layout", ["two_rows", "many_segments", "one_sequence"])
def test_values_and_gradients_match_dense(block, layout):
  q, k, v, weights, segments = _inputs()
  if layout == "many_segments":
    segments = jnp.asarray(_MANY_SEGMENTS)
  if layout == "one_sequence":  # pairs below the diagonal run without a mask
    segments = jnp.ones_like(segments)
  blocked = lambda q, k, v: blocked_attention(q, k, v, BlockedCausal(segments, block))
  dense = lambda q, k, v: _dense(q, k, v, segments)
  np.testing.assert_allclose(blocked(q, k, v), dense(q, k, v), atol=2e-6)
  grads = [jax.grad(lambda *x: jnp.sum(f(*x) * weights), argnums=(0, 1, 2))(q, k, v)
           for f in (blocked, dense)]
  for name, a, b in zip("qkv", *grads):
    np.testing.assert_allclose(a, b, atol=5e-6, err_msg=f"d{name}")


def test_skips_exactly_the_blocks_whose_queries_and_keys_share_no_segment():
  from sage_jax.model.blocked_attention import _overlap
  block = 4
  # Packed rows (ids in order, padding 0 last or first) and one sequence split at a block.
  segments = np.asarray([[1] * 7 + [2] * 9 + [3] * 5 + [4] * 6 + [0] * 5,
                         [0] * 3 + [1] * 7 + [2] * 9 + [3] * 5 + [4] * 8,
                         [1] * 14 + [2] * 18])
  n = segments.shape[1] // block
  blocks = lambda row, i: set(segments[row, i * block:(i + 1) * block])
  shared = np.asarray([[[bool(blocks(r, i) & blocks(r, j)) for j in range(n)] for i in range(n)]
                       for r in range(len(segments))])
  for r in range(len(segments)):
    np.testing.assert_array_equal(_overlap(jnp.asarray(segments[r:r + 1]), block), shared[r])
    assert not shared[r].all()  # something is skipped in every row
  np.testing.assert_array_equal(_overlap(jnp.asarray(segments), block), shared.any(0))


def test_pairs_below_the_diagonal_within_one_sequence_run_unmasked():
  from sage_jax.model.blocked_attention import _FULL, _MASKED, _SKIP, _pair_kinds
  one = jnp.asarray([[3] * 16, [3] * 16])
  expected = np.where(np.tri(4, k=-1, dtype=bool), _FULL, np.where(np.tri(4, dtype=bool),
                                                                   _MASKED, _SKIP))
  np.testing.assert_array_equal(_pair_kinds(one, 4), expected)
  # Ids change inside block 1 of row 0: its pairs keep the mask; a second id in row 1 only
  # (another row's sequence) masks the pairs of the blocks it touches, in every row.
  mixed = jnp.asarray([[1] * 6 + [2] * 10, [5] * 16])
  kinds = np.asarray(_pair_kinds(mixed, 4))
  assert kinds[1, 0] == _MASKED and kinds[2, 1] == _MASKED and kinds[3, 2] == _FULL
  assert kinds[2, 0] == _MASKED  # row 0 would skip it; row 1 needs it


def test_bfloat16_inputs_keep_their_dtype():
  q, k, v, _, segments = _inputs(dtype=jnp.bfloat16)
  out = blocked_attention(q, k, v, BlockedCausal(segments, 8))
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(out.astype(jnp.float32), _dense(q, k, v, segments).astype(
      jnp.float32), atol=3e-2)
  dq = jax.grad(lambda q: blocked_attention(q, k, v, BlockedCausal(segments, 8)).astype(
      jnp.float32).sum())(q)
  assert dq.dtype == jnp.bfloat16


def test_memory_grows_with_length_times_block_not_length_squared():
  """Compiled temporaries of the gradient at 4096 tokens (compiled, not run)."""
  b, t, kv, g, d = 1, 4096, 2, 4, 16
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  segments = jnp.ones((b, t), jnp.int32)
  temp = {}
  for name, fn in (("dense", lambda q, k, v: _dense(q, k, v, segments)),
                   ("blocked", lambda q, k, v: blocked_attention(
                       q, k, v, BlockedCausal(segments, 256)))):
    grad = jax.jit(jax.grad(lambda *x: fn(*x).sum(), argnums=(0, 1, 2)))
    compiled = grad.lower(spec(b, t, kv, g, d), spec(b, t, kv, d), spec(b, t, kv, d)).compile()
    temp[name] = compiled.memory_analysis().temp_size_in_bytes
  # Dense holds [8 heads, 4096, 4096] float32 scores (512 MB) and more.
  assert temp["dense"] > 5e8
  assert temp["blocked"] < temp["dense"] / 20, temp


@pytest.mark.parametrize("remat", ["none", "full"])
def test_model_logits_and_gradients_match_dense(tmp_path, remat):
  tiny_hf_model(str(tmp_path))
  dense = hf.load_hf(str(tmp_path))
  blocked = hf.load_hf(str(tmp_path))
  blocked.config = blocked.config.replace(attention_block=8, remat=remat)
  rng = np.random.RandomState(0)
  tokens = jnp.asarray(rng.randint(0, 512, (2, 21)))
  positions = jnp.asarray(np.stack([np.r_[np.arange(12), np.arange(9)], np.arange(21)]))
  segments = jnp.asarray(np.stack([[1] * 12 + [2] * 9, [1] * 21]))

  def loss(model):
    logits, _ = model(tokens, positions, segment_ids=segments)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 3]), logits

  (_, ref_logits), ref_grads = nnx.value_and_grad(loss, has_aux=True)(dense)
  (_, logits), grads = nnx.value_and_grad(loss, has_aux=True)(blocked)
  np.testing.assert_allclose(logits, ref_logits, atol=1e-5)
  for (path, a), (_, b) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)):
    np.testing.assert_allclose(a.get_value(), b.get_value(), atol=1e-6, err_msg=str(path))


def test_rows_no_longer_than_a_block_stay_dense(tmp_path):
  """The config's block applies to long rows only; short ones take the dense path."""
  tiny_hf_model(str(tmp_path))
  model = hf.load_hf(str(tmp_path))
  model.config = model.config.replace(attention_block=32)
  tokens = jnp.zeros((1, 32), jnp.int32)
  jaxpr = str(jax.make_jaxpr(lambda t: model(t, jnp.arange(32)[None])[0])(tokens))
  assert "custom_vjp" not in jaxpr
  model.config = model.config.replace(attention_block=16)
  jaxpr = str(jax.make_jaxpr(lambda t: model(t, jnp.arange(32)[None])[0])(tokens))
  assert "custom_vjp" in jaxpr


def test_bad_block_is_named():
  with pytest.raises(ValueError, match=r"attention_block=-1; expected 0 \(dense\)"):
    ModelSpec(preset="tiny", attention_block=-1)
