"""The sampler's fused layout (q/k/v and gate/up as one matmul each) computes what the
trained layout does: same logits, same cache, same sampled tokens, sharded or not."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sage_jax import multihost
from sage_jax.model import get_preset, init_model, lora
from sage_jax.model.fused_projections import fuse
from sage_jax.model.qwen2 import KVCache, abstract_model
from sage_jax.sampler import Engine, EngineConfig, SamplingParams

# Three query heads per KV head (tiny has two), untied head, odd sizes.
CFG = get_preset("tiny-untied").replace(hidden_size=48, intermediate_size=72,
                                        num_attention_heads=6, num_key_value_heads=2,
                                        head_dim=8)


def _model(cfg=CFG, seed=0):
  """A model whose every parameter, biases and norms included, is random and not small."""
  model = init_model(cfg, seed=seed)
  graphdef, state = nnx.split(model)
  keys = iter(jax.random.split(jax.random.key(seed + 1), len(jax.tree.leaves(state))))
  return nnx.merge(graphdef, jax.tree.map(
      lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), state))


def _fused(model):
  state = jax.jit(lambda s: fuse(s, model.config))(nnx.state(model))
  return nnx.merge(nnx.graphdef(abstract_model(model.config.replace(fused_projections=True))),
                   state)


def test_the_fused_layout_computes_the_same_logits_and_cache():
  model = _model()
  fused = _fused(model)
  attn = fused.layers[0].self_attn.qkv_proj
  assert attn.kernel.shape == (2, 3 + 2, 8, 48) and attn.bias.shape == (2, 5, 8)
  assert fused.layers[0].mlp.gate_up_proj.kernel.shape == (2, 72, 48)
  assert not hasattr(fused.layers[0].self_attn, "q_proj")
  tokens = jnp.array([[3, 17, 5, 9, 200, 41], [7, 7, 1, 0, 0, 0]])
  positions = jnp.array([[0, 1, 2, 3, 4, 5], [0, 1, 2, 99, 99, 99]])  # row 2: 3 tokens, padding
  want, _ = model(tokens, positions)
  got, _ = fused(tokens, positions)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
  cache = KVCache.zeros(CFG, 2, 16)
  want, want_cache = model(tokens, positions, cache=cache)
  got, got_cache = fused(tokens, positions, cache=cache)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-5)
  step = jnp.array([[11], [12]]), jnp.array([[6], [3]])  # one decode step over the cache
  want, _ = model(*step, cache=want_cache)
  got, _ = fused(*step, cache=got_cache)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)


def test_fuse_refuses_adapters_and_a_fused_model_cannot_take_them():
  adapted = lora.add_adapters(init_model(CFG), lora.LoraConfig(rank=2))
  with pytest.raises(ValueError, match="fold LoRA adapters first"):
    fuse(nnx.state(adapted), adapted.config)
  with pytest.raises(ValueError, match="fused_projections is the sampler's layout"):
    CFG.replace(fused_projections=True, lora=lora.LoraConfig(rank=2))


def test_the_sampling_copy_is_fused_and_samples_the_trained_layouts_tokens():
  """On a mesh of the host's devices (8 in CI: slots split 4 ways, weights 2 ways), with
  tensor parallelism splitting the fused kernels by whole KV-head groups."""
  model = _model()
  mesh_config = multihost.SamplerMeshConfig(tensor=2)
  sync = multihost.WeightSync(model, mesh_config)
  sampler = sync.sampling_model(model)
  assert sync.fuses and sampler.config.fused_projections
  assert sampler.layers[0].self_attn.qkv_proj.kernel[...].sharding.spec[0] == "tensor"
  separate = multihost.WeightSync(model, dataclasses.replace(mesh_config,
                                                             fuse_projections="never"))
  assert not separate.fuses
  config = EngineConfig(num_slots=4, max_len=32, prefill_buckets=(32,), min_attend=32,
                        max_top_k=16)
  prompts = [list(range(1, 12)), [5, 9, 2], [300, 4], list(range(40, 55))]
  results = {}
  for name, sync_, engine_model in (("fused", sync, sampler),
                                    ("separate", separate, separate.sampling_model(model))):
    engine = Engine(engine_model, config, eos_ids=(), mesh=sync_.mesh)
    results[name] = engine.generate(prompts, SamplingParams(temperature=1.0, top_k=8,
                                                            max_new_tokens=10), seeds=[3, 4, 5, 6])
    # A sync after an update carries the new weights in the same layout.
    engine.update_params(sync_(nnx.state(_model(seed=4))))
    results[name] += engine.generate(prompts, SamplingParams(temperature=0.0,
                                                             max_new_tokens=10))
  for got, want in zip(results["fused"], results["separate"]):
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.model_logprobs, want.model_logprobs, atol=1e-4)


def test_the_fused_copy_is_written_in_the_sampling_dtype():
  model = _model()
  sync = multihost.WeightSync(model, multihost.SamplerMeshConfig(param_dtype="bfloat16"))
  copy = sync(nnx.state(model))
  assert {x.dtype for x in jax.tree.leaves(copy)} == {jnp.dtype(jnp.bfloat16)}
  q = nnx.state(model)["layers"][1]["self_attn"]["q_proj"]["kernel"][...]
  qkv = copy["layers"][1]["self_attn"]["qkv_proj"]["kernel"][...]
  # Query head 4 belongs to KV head 1 (three per group): slot 1 of that group.
  np.testing.assert_array_equal(np.asarray(qkv[1, 1], np.float32),
                                np.asarray(q[4].astype(jnp.bfloat16), np.float32))
  assert all(x.sharding.mesh.devices.tolist() == sync.mesh.devices.tolist()
             for x in jax.tree.leaves(copy))


@pytest.mark.parametrize("fuse_projections", ["auto", "never"])
def test_a_checkpoint_loads_onto_the_sampling_mesh_as_the_sync_writes_it(fuse_projections,
                                                                        tmp_path):
  """What evaluation and generation sample from a checkpoint (`load_sampling_model`: loaded
  straight onto the host's devices: 4 slots, 2 devices per copy here) is the copy a training
  run's sync writes of the same weights: same layout, dtype, sharding and values."""
  from sage_jax.weights import hf, loader  # noqa: PLC0415
  model = _model()
  hf.save_hf(model, str(tmp_path / "ckpt"))
  config = multihost.SamplerMeshConfig(tensor=2, param_dtype="bfloat16",
                                       fuse_projections=fuse_projections)
  loaded, mesh = multihost.load_sampling_model(loader.ModelSpec(spec=str(tmp_path / "ckpt")),
                                               config, num_slots=4)
  assert loaded.config.fused_projections == (fuse_projections == "auto")
  want = multihost.WeightSync(model, dataclasses.replace(config, fuse_projections="always")
                              if fuse_projections == "auto" else config)(nnx.state(model))
  got = nnx.state(loaded)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.dtype == b.dtype == jnp.bfloat16 and a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert mesh.shape == {"data": 4, "fsdp": 1, "tensor": 2}
