"""Our Qwen2 against transformers' PyTorch Qwen2 on the same weights."""

import numpy as np
import pytest
import jax.numpy as jnp

from sage_jax.model import KVCache
from sage_jax.weights import hf
from tests.hf_reference import hf_logits, tiny_hf_model


def _tokens(batch=2, length=24, vocab=512, seed=0):
  return np.random.RandomState(seed).randint(0, vocab, (batch, length))


def _positions(tokens):
  return jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)


@pytest.mark.parametrize("heads,kv_heads,tied", [
    (4, 4, True),   # GQA ratio 1
    (4, 2, True),   # ratio 2
    (7, 1, True),   # ratio 7
    (4, 2, False),  # untied head
])
def test_logits_match_transformers(tmp_path, heads, kv_heads, tied):
  ref = tiny_hf_model(str(tmp_path), heads=heads, kv_heads=kv_heads, tied=tied)
  model = hf.load_hf(str(tmp_path))
  tokens = _tokens()
  ours, _ = model(jnp.asarray(tokens), _positions(tokens))
  np.testing.assert_allclose(np.asarray(ours), hf_logits(ref, tokens), atol=1e-4, rtol=0)


def test_cached_prefill_and_decode_match_full_forward(tmp_path):
  tiny_hf_model(str(tmp_path))
  model = hf.load_hf(str(tmp_path))
  tokens = jnp.asarray(_tokens(length=12))
  full, _ = model(tokens, _positions(tokens))
  cache = KVCache.zeros(model.config, batch=2, max_len=16)
  prefix, cache = model(tokens[:, :8], _positions(tokens)[:, :8], cache=cache)
  steps = [prefix]
  for t in range(8, 12):
    step, cache = model(tokens[:, t:t + 1], jnp.full((2, 1), t), cache=cache)
    steps.append(step)
  np.testing.assert_allclose(np.concatenate(steps, axis=1), np.asarray(full), atol=1e-5)


def test_rows_at_different_positions_and_padding(tmp_path):
  """Each cache row keeps its own length; padded tokens (position >= max_len) write nothing."""
  tiny_hf_model(str(tmp_path))
  model = hf.load_hf(str(tmp_path))
  a, b = _tokens(batch=1, length=9, seed=1)[0], _tokens(batch=1, length=5, seed=2)[0]
  max_len = 16
  cache = KVCache.zeros(model.config, batch=2, max_len=max_len)
  tokens = np.zeros((2, 9), np.int64)
  tokens[0], tokens[1, :5] = a, b
  positions = np.stack([np.arange(9), np.r_[np.arange(5), [max_len] * 4]])
  logits, cache = model(jnp.asarray(tokens), jnp.asarray(positions), cache=cache)
  alone, _ = model(jnp.asarray(b[None]), _positions(b[None]))
  np.testing.assert_allclose(np.asarray(logits[1, :5]), np.asarray(alone[0]), atol=1e-5)
  # Next token for row 1 at position 5 sees exactly b's history.
  nxt = np.array([[1], [7]])
  step, _ = model(jnp.asarray(nxt), jnp.asarray([[9], [5]]), cache=cache)
  ref, _ = model(jnp.asarray(np.r_[b, 7][None]), _positions(np.r_[b, 7][None]))
  np.testing.assert_allclose(np.asarray(step[1, 0]), np.asarray(ref[0, -1]), atol=1e-5)


def test_packed_segments_match_separate_sequences(tmp_path):
  tiny_hf_model(str(tmp_path))
  model = hf.load_hf(str(tmp_path))
  a, b = _tokens(batch=1, length=7, seed=3)[0], _tokens(batch=1, length=5, seed=4)[0]
  packed = jnp.asarray(np.r_[a, b][None])
  positions = jnp.asarray(np.r_[np.arange(7), np.arange(5)][None])
  segments = jnp.asarray(np.r_[[1] * 7, [2] * 5][None])
  logits, _ = model(packed, positions, segment_ids=segments)
  for seq, sl in ((a, slice(0, 7)), (b, slice(7, 12))):
    alone, _ = model(jnp.asarray(seq[None]), _positions(seq[None]))
    np.testing.assert_allclose(np.asarray(logits[0, sl]), np.asarray(alone[0]), atol=1e-5)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_keeps_values_and_gradients(tmp_path, remat):
  import jax
  from flax import nnx
  tiny_hf_model(str(tmp_path))
  base = hf.load_hf(str(tmp_path))
  rematted = hf.load_hf(str(tmp_path))
  rematted.config = rematted.config.replace(remat=remat, remat_layers=(1,))
  tokens = jnp.asarray(_tokens(length=8))

  def loss(model):
    logits, _ = model(tokens, _positions(tokens))
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

  g1 = nnx.grad(loss)(base)
  g2 = nnx.grad(loss)(rematted)
  for (p, a), (_, b) in zip(nnx.to_flat_state(g1), nnx.to_flat_state(g2)):
    np.testing.assert_allclose(np.asarray(a.get_value()), np.asarray(b.get_value()),
                               atol=1e-6, err_msg=str(p))
