"""The sampler's weight layout: each layer's q/k/v projections as one matmul, gate/up as one.

A decode step multiplies a few rows by every weight matrix, so it is bound by reading the
weights, and each of its matmuls also pays a fixed cost (thread hand-off on CPU, a kernel
launch on accelerators). Two products over the same input cost more than one over both
matrices side by side: on the 2-core CPU a decode step of the 0.5B ran 1.01-1.05x faster
fused (bench/decode_layouts.py, BENCHMARKS.md). Training keeps HF's separate projections
(the name table, LoRA targets, export); a sampling copy of the weights that
`multihost.WeightSync` writes is in this layout (`sampler_mesh.fuse_projections`).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from sage_jax.model.config import Qwen2Config
from sage_jax.model.qwen2 import abstract_model


def fuse(state: nnx.State, config: Qwen2Config) -> nnx.State:
  """The parameters `state` of a model with `config` (separate projections, no adapters) in
  the fused layout: those of `qwen2.abstract_model(config.replace(fused_projections=True))`.
  `state` may be any part of the parameters that holds each projection it has with its
  siblings (one layer, say): the result is that part in the fused layout. A pure function of
  the arrays, for jit; values are concatenated, not changed."""
  if config.lora.enabled or config.fused_projections:
    raise ValueError("fuse takes the parameters of a model with separate projections and no "
                     "adapters (fold LoRA adapters first)")
  source = dict(nnx.to_flat_state(state))
  kv = config.num_key_value_heads
  group = config.num_attention_heads // kv

  def fused_value(path):
    parent, proj, leaf = path[:-2], path[-2:-1], path[-1]
    get = lambda name: source[(*parent, name, leaf)].get_value()
    if proj == ("qkv_proj",):
      q = get("q_proj")
      q = q.reshape((kv, group) + q.shape[1:])  # [kv, group, d, (embed)]
      return jnp.concatenate([q, get("k_proj")[:, None], get("v_proj")[:, None]], axis=1)
    if proj == ("gate_up_proj",):
      return jnp.stack([get("gate_proj"), get("up_proj")])
    return source[path].get_value()

  def present(path):  # in the part of the parameters `state` holds
    fused_from = {"qkv_proj": "q_proj", "gate_up_proj": "gate_proj"}
    if len(path) > 1 and path[-2] in fused_from:
      path = (*path[:-2], fused_from[path[-2]], path[-1])
    return path in source

  target = nnx.state(abstract_model(config.replace(fused_projections=True)))
  return nnx.from_flat_state([(path, var.replace(fused_value(path)))
                              for path, var in nnx.to_flat_state(target) if present(path)])
