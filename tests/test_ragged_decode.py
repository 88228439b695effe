"""The sampler's ragged Pallas decode kernel against the XLA decode path.

Off TPU the kernel runs in Pallas' TPU interpret mode (its own code, interpreted). That it
lowers to a Mosaic TPU kernel at the real models' shapes is checked by lowering it for the
TPU platform on this CPU; Mosaic's compiler itself (inside libtpu) is not run here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sage_jax.model import get_preset, init_model
from sage_jax.model import ragged_decode as rd
from sage_jax.model.qwen2 import _decode_attention
from sage_jax.sampler import Engine, EngineConfig, SamplingParams, steps


def _qkv(b, s, kv, g, d, dtype, seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=shape), dtype)
          for shape in ((b, kv * g, d), (b, s, kv, d), (b, s, kv, d)))


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
def test_kernel_equals_the_xla_decode_path_on_ragged_lengths(dtype, atol):
  # One position, a partial block, exactly one block, a block and one, the whole cache.
  lengths = jnp.asarray([1, 100, 256, 257, 512])
  q, k, v = _qkv(5, 512, 2, 3, 16, dtype)
  out = jax.jit(rd.ragged_decode_attention)(q, k, v, lengths)
  ref = _decode_attention(q, k, v, jnp.arange(512)[None, :] < lengths[:, None])
  assert out.shape == ref.shape == (5, 1, 6, 16) and out.dtype == dtype
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             atol=atol)


def test_kernel_never_reads_past_a_sequence_length():
  """Cache positions at and after a sequence's length hold NaN: any read of them would show."""
  q, k, v = _qkv(3, 512, 2, 2, 16, jnp.float32, seed=1)
  lengths = jnp.asarray([3, 260, 512])
  past = jnp.arange(512)[None, :, None, None] >= lengths[:, None, None, None]
  poisoned_k, poisoned_v = (jnp.where(past, jnp.nan, x) for x in (k, v))
  out = rd.ragged_decode_attention(q, poisoned_k, poisoned_v, lengths)
  ref = _decode_attention(q, k, v, jnp.arange(512)[None, :] < lengths[:, None])
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6)


def test_a_sequence_with_no_keys_gets_zeros():
  q, k, v = _qkv(2, 256, 1, 2, 8, jnp.float32)
  out = rd.ragged_decode_attention(q, k, v, jnp.asarray([0, 7]))
  assert np.all(np.asarray(out[0]) == 0) and np.all(np.isfinite(np.asarray(out)))


def test_engine_generates_the_same_tokens_with_the_kernel_as_with_xla():
  """Greedy decoding of the tiny model through the engine (prefill, then decode steps over
  slots of different lengths) gives the same tokens and near-equal logprobs either way; with
  the kernel, decode compiles once (no attention windows), XLA once per window it needs."""
  prompts = [[5, 9, 200, 3000, 17], [88] * 40, list(range(100, 400, 7))]
  sampling = SamplingParams(temperature=0.0, max_new_tokens=40)
  config = EngineConfig(num_slots=4, max_len=512, prefill_buckets=(64,), min_attend=64)
  results, compiled = {}, {}
  for impl in ("xla", "ragged"):
    model = init_model(get_preset("tiny", decode_attention_impl=impl), seed=3)
    before = steps.decode._cache_size()
    results[impl] = Engine(model, config, eos_ids=()).generate(prompts, sampling)
    compiled[impl] = steps.decode._cache_size() - before
  assert compiled == {"xla": 2, "ragged": 1}  # xla: windows of 64 and 128 positions
  for a, b in zip(results["xla"], results["ragged"]):
    assert a.tokens == b.tokens
    np.testing.assert_allclose(a.model_logprobs, b.model_logprobs, atol=1e-5)


def test_kernel_under_a_mesh_runs_per_shard():
  """Sequences over the data axes, KV heads over the tensor axis (the sampler's cache
  sharding), each device's share through its own kernel."""
  from sage_jax import sharding as shd  # noqa: PLC0415

  mesh = shd.make_mesh(shd.MeshConfig(data=2, fsdp=2, tensor=2))
  q, k, v = _qkv(4, 512, 2, 3, 16, jnp.float32, seed=2)
  lengths = jnp.asarray([1, 300, 512, 77])
  with shd.use_rules(mesh):
    out = jax.jit(rd.ragged_decode_attention)(q, k, v, lengths)
  ref = _decode_attention(q, k, v, jnp.arange(512)[None, :] < lengths[:, None])
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6)


@pytest.mark.parametrize("preset", ["qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-32b"])
def test_kernel_lowers_to_a_mosaic_tpu_kernel_at_the_real_shapes(preset):
  cfg = get_preset(preset)
  b, s, kv = 8, 4096, cfg.num_key_value_heads
  width = kv * cfg.head_dim
  call = rd._kernel_call(b, cfg.num_attention_heads, width, s, rd.BLOCK, False)
  shapes = ((b,), jnp.int32), ((b, cfg.num_attention_heads, width), jnp.bfloat16), \
      ((b, s, width), jnp.bfloat16), ((b, s, width), jnp.bfloat16)
  lowered = jax.jit(call).trace(*(jax.ShapeDtypeStruct(*x) for x in shapes)).lower(
      lowering_platforms=("tpu",))
  assert "tpu_custom_call" in lowered.as_text()


def test_auto_is_the_kernel_on_tpu_only_and_needs_whole_blocks():
  assert rd.decode_kernel_for("auto", 4096, "tpu") == "ragged"
  assert rd.decode_kernel_for("auto", 4096, "cpu") == "xla"
  assert rd.decode_kernel_for("auto", 4096, "gpu") == "xla"
  assert rd.decode_kernel_for("ragged", 4096, "cpu") == "ragged"
  assert rd.decode_kernel_for("auto", 128, "tpu") == "ragged"  # one block of the whole cache
  assert rd.decode_kernel_for("auto", 1000, "tpu") == "xla"
  with pytest.raises(ValueError, match="not a multiple of 256"):
    rd.decode_kernel_for("ragged", 1000, "cpu")
  with pytest.raises(ValueError, match="decode_attention_impl='paged'"):
    get_preset("tiny", decode_attention_impl="paged")
