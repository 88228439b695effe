"""The model on 8 simulated CPU devices equals the single-device model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from sage_jax import sharding as shd
from sage_jax.model import KVCache, get_preset, init_model

CFG = get_preset("tiny").replace(vocab_size=512, num_attention_heads=8, num_key_value_heads=2)


def _forward(model, tokens, cache=None):
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  logits, cache = model(tokens, positions, cache=cache)
  return logits


@pytest.fixture(scope="module")
def reference():
  model = init_model(CFG, seed=3)
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, 512, (8, 16)))
  return nnx.state(model), tokens, np.asarray(_forward(model, tokens))


@pytest.mark.parametrize("mesh_cfg,attention_block", [
    (shd.MeshConfig(data=1, fsdp=4, tensor=2), 0),
    (shd.MeshConfig(data=2, fsdp=2, tensor=2), 0),
    (shd.MeshConfig(data=2, fsdp=2, tensor=2), 4),  # blocked attention, against dense
])
def test_sharded_forward_equals_single_device(reference, mesh_cfg, attention_block):
  assert jax.device_count() == 8
  state, tokens, expected = reference
  mesh = shd.make_mesh(mesh_cfg)
  model = init_model(CFG.replace(attention_block=attention_block))
  nnx.update(model, state)
  shd.place(model, mesh)
  q = model.layers[0].self_attn.q_proj.kernel[...]
  assert q.sharding.spec == P("tensor", None, "fsdp")
  assert len(q.addressable_shards) == 8
  assert q.addressable_shards[0].data.shape == (8 // mesh_cfg.tensor, 16, 64 // mesh_cfg.fsdp)
  graphdef, params = nnx.split(model)
  batch = jax.device_put(tokens, shd.named_sharding(("act_batch", None), tokens.shape, mesh))

  @jax.jit
  def run(params, tokens):
    with shd.use_rules(mesh):
      return _forward(nnx.merge(graphdef, params), tokens)

  got = run(params, batch)
  np.testing.assert_allclose(np.asarray(got), expected, atol=1e-5, rtol=0)


def test_sharded_cached_decode_equals_single_device(reference):
  state, tokens, expected = reference
  mesh = shd.make_mesh(shd.MeshConfig(data=2, fsdp=2, tensor=2))
  model = init_model(CFG)
  nnx.update(model, state)
  shd.place(model, mesh)
  graphdef, params = nnx.split(model)

  @jax.jit
  def prefill(params, tokens):
    with shd.use_rules(mesh):
      cache = KVCache.zeros(CFG, tokens.shape[0], 32)
      return _forward(nnx.merge(graphdef, params), tokens, cache)

  got = prefill(params, tokens)
  np.testing.assert_allclose(np.asarray(got), expected, atol=1e-5, rtol=0)


def test_create_sharded_places_every_parameter():
  mesh = shd.make_mesh(shd.MeshConfig(fsdp=4, tensor=2))
  model = shd.create_sharded(lambda: init_model(CFG, seed=1), mesh)
  for path, var in nnx.to_flat_state(nnx.state(model)):
    value = var.get_value()
    spec = shd.ShardingRules().param_spec(shd.logical_axes_of(var), value.shape, mesh)
    assert value.sharding.spec == spec, path
  plain = init_model(CFG, seed=1)
  # Same random stream as an unsharded init (up to fusion rounding in the jitted init).
  np.testing.assert_allclose(np.asarray(model.embed_tokens[...]),
                             np.asarray(plain.embed_tokens[...]), rtol=1e-6, atol=0)


def test_rules_skip_axes_that_do_not_divide():
  mesh = shd.make_mesh(shd.MeshConfig(fsdp=2, tensor=4))
  rules = shd.ShardingRules()
  # 14 heads (Qwen2.5-0.5B) cannot split 4 ways: replicated; 896 embed splits over fsdp.
  assert rules.spec(("embed", "heads", "head_dim"), (896, 14, 64), mesh) == P("fsdp", None, None)
  assert rules.spec(("act_batch", None), (6, 3), mesh) == P("fsdp", None)
  assert rules.spec(shd.CACHE_AXES, (8, 16, 4, 8), mesh) == P("fsdp", None, "tensor", None)


def test_fsdp_stores_a_parameter_on_another_dimension_where_the_model_dimension_does_not_split():
  """Qwen2.5-32B on 12-way fsdp: 5120 does not split 12 ways, the MLP and vocabulary do."""
  rules = shd.ShardingRules()
  mesh = shd.make_mesh(shd.MeshConfig(fsdp=3), jax.devices()[:3])
  assert rules.param_spec(("mlp", "embed"), (27648, 5120), mesh) == P("fsdp", None)
  assert rules.param_spec(("vocab", "embed"), (152064, 5120), mesh) == P("fsdp", None)
  assert rules.param_spec(("mlp", "embed"), (27647, 5122), mesh) == P(None, None)  # nowhere
  assert rules.param_spec(("mlp", "embed"), (27648, 5124), mesh) == P(None, "fsdp")
  assert rules.param_spec(("norm",), (5120,), mesh) == P(None)  # its rules name no fsdp
  assert rules.spec(("mlp", "embed"), (27648, 5120), mesh) == P(None, None)  # activations stay
  # `tensor` splits compute, not storage: it stays where its rules put it.
  mesh = shd.make_mesh(shd.MeshConfig(fsdp=3, tensor=2), jax.devices()[:6])
  assert rules.param_spec(("mlp", "embed"), (27648, 5120), mesh) == P("tensor", None)
  assert rules.param_spec(("heads", "head_dim", "embed"), (15, 128, 5122), mesh) == P(
      "fsdp", None, None)
  # Placed that way, the model computes what the unsharded one does, and the plan counts it.
  cfg = CFG.replace(intermediate_size=96, vocab_size=513)  # 64-wide: not a multiple of 3
  model = shd.create_sharded(lambda: init_model(cfg, seed=2), shd.make_mesh(
      shd.MeshConfig(fsdp=3), jax.devices()[:3]))
  assert model.layers[0].mlp.up_proj.kernel[...].sharding.spec == P("fsdp", None)
  tokens = jnp.asarray(np.random.RandomState(1).randint(0, 513, (3, 8)))
  np.testing.assert_allclose(np.asarray(_forward(model, tokens)),
                             np.asarray(_forward(init_model(cfg, seed=2), tokens)),
                             rtol=2e-5, atol=2e-5)
  from sage_jax.tools import memory_plan
  big = get_preset("qwen2.5-32b")
  eight, twelve = (memory_plan.plan(big, (1, n, 1)).params_bytes_per_device for n in (8, 12))
  assert twelve < 2 * eight  # the attention projections (40 x 128) stay whole; all was: 8x


def test_mesh_config_errors():
  with pytest.raises(ValueError, match="16 devices, but 8"):
    shd.MeshConfig(data=2, fsdp=4, tensor=2).resolve(8)
  with pytest.raises(ValueError, match="at most one axis may be -1"):
    shd.MeshConfig(data=-1, fsdp=-1).resolve(8)
  with pytest.raises(ValueError, match="not divisible by 3"):
    shd.MeshConfig(tensor=3).resolve(8)
  with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
    shd.ShardingRules().with_overrides({"mlp": "model"})
  assert shd.MeshConfig(data=2, fsdp=-1, tensor=2).resolve(8) == (2, 2, 2)
