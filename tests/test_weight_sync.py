"""The weight sync layer by layer: the copy it writes part by part equals the whole model's
cast and fused at once, every layer runs one program, and a sync that replaces the sampler's
copy writes the new one into the old one's memory (the old arrays are deleted) unless the
sampler shares the trainer's arrays. (The memory it saves: bench/weight_sync_memory.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sage_jax import multihost
from sage_jax import sharding as shd
from sage_jax.model import get_preset, init_model
from sage_jax.model.fused_projections import fuse

CFG = get_preset("tiny-untied").replace(num_hidden_layers=3)
BF16 = multihost.SamplerMeshConfig(param_dtype="bfloat16")


def _trainer_params():
  """A model's parameters as a trainer holds them: float32, over fsdp 4 x tensor 2."""
  model = shd.place(init_model(CFG, seed=0),
                    shd.make_mesh(shd.MeshConfig(data=1, fsdp=4, tensor=2)))
  return model, nnx.state(model)


def _values(state):
  return {jax.tree_util.keystr(p): np.asarray(x.astype(jnp.float32))
          for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def test_the_copy_made_part_by_part_is_the_model_cast_and_fused_at_once():
  model, params = _trainer_params()
  sync = multihost.WeightSync(model, BF16)
  assert sync.fuses
  whole = jax.jit(lambda s: fuse(jax.tree.map(lambda x: x.astype(jnp.bfloat16), s), CFG))(
      nnx.state(model))
  copy = sync(params)
  assert _values(copy).keys() == _values(whole).keys()
  for name, value in _values(whole).items():
    np.testing.assert_array_equal(_values(copy)[name], value, err_msg=name)
  for x, want in zip(jax.tree.leaves(copy), jax.tree.leaves(sync.local_shardings)):
    assert x.dtype == jnp.bfloat16 and x.sharding == want
  # Every layer runs the first layer's program; the other entries have one each.
  assert sorted(sync.reshard.lower(params)) == ["embed_tokens", "layers/0", "lm_head", "norm"]


def test_a_sync_that_replaces_the_samplers_copy_writes_into_its_memory():
  model, params = _trainer_params()
  sync = multihost.WeightSync(model, BF16)
  old = sync(params)
  want = _values(sync(params))
  new = sync(params, replacing=old)
  assert all(x.is_deleted() for x in jax.tree.leaves(old))
  assert _values(new).keys() == want.keys()
  for name, value in want.items():
    np.testing.assert_array_equal(_values(new)[name], value, err_msg=name)
  # XLA writes each part of the new copy into the old one's buffers.
  abstract_old = sync.reshard.lower(params, whole=True)["all"].out_info
  for part, lowered in sync.reshard.lower(params, replacing=abstract_old).items():
    outputs = sum(np.prod(o.sharding.shard_shape(o.shape)) * o.dtype.itemsize
                  for o in jax.tree.leaves(lowered.out_info))
    assert lowered.compile().memory_analysis().alias_size_in_bytes == outputs > 0, part
  # A copy laid out otherwise (float32 here) is not given up.
  other = multihost.WeightSync(model, multihost.SamplerMeshConfig(param_dtype="float32"))(
      params)
  sync(params, replacing=other)
  assert not any(x.is_deleted() for x in jax.tree.leaves(other))


def test_a_sampler_that_shares_the_trainers_arrays_keeps_them():
  model = init_model(CFG, seed=0)
  sync = multihost.WeightSync(model, multihost.SamplerMeshConfig(fuse_projections="never"))
  params = nnx.state(shd.place(model, sync.mesh))
  shared = sync(params)
  assert all(a is b for a, b in zip(jax.tree.leaves(shared), jax.tree.leaves(params)))
  assert sync(params, replacing=shared) is params
  assert not any(x.is_deleted() for x in jax.tree.leaves(params))
