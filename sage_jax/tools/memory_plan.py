"""Per-device memory of a full fine-tuning state, computed from shapes alone.

`jax.eval_shape` builds the abstract model and AdamW state, the sharding rules give every
array's PartitionSpec on an abstract mesh of the requested shape, and the bytes each device
holds follow; nothing is allocated, so a 72B plan runs on a laptop.

  python -m sage_jax.tools.memory_plan --preset=qwen2.5-32b --mesh=1,64,1 --param_dtype=bfloat16
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx
from jax.sharding import AbstractMesh

from sage_jax import sharding as shd
from sage_jax.model.config import Qwen2Config, get_preset
from sage_jax.model.qwen2 import Qwen2


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  num_params: int
  mesh: dict[str, int]
  params_bytes_per_device: int
  grads_bytes_per_device: int
  optimizer_bytes_per_device: int

  @property
  def total_bytes_per_device(self) -> int:
    return (self.params_bytes_per_device + self.grads_bytes_per_device +
            self.optimizer_bytes_per_device)

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["total_bytes_per_device"] = self.total_bytes_per_device
    d["total_gib_per_device"] = round(self.total_bytes_per_device / 2**30, 3)
    return d


def _per_device_bytes(shape, dtype, axes, mesh, rules) -> int:
  spec = rules.spec(axes, shape, mesh)
  local = list(shape)
  for i, entry in enumerate(spec):
    for axis in (entry,) if isinstance(entry, str) else (entry or ()):
      local[i] //= mesh.shape[axis]
  return math.prod(local) * np.dtype(dtype).itemsize


def _tree_bytes(abstract_tree, axes_tree, mesh, rules) -> int:
  leaves = jax.tree.leaves(abstract_tree)
  axes = jax.tree.leaves(axes_tree, is_leaf=lambda x: isinstance(x, tuple))
  if len(leaves) != len(axes):
    raise AssertionError("state and logical-axes trees differ")
  return sum(_per_device_bytes(x.shape, x.dtype, a, mesh, rules) for x, a in zip(leaves, axes))


def plan(cfg: Qwen2Config, mesh_shape: tuple[int, int, int],
         rules: shd.ShardingRules = shd.ShardingRules(), mu_dtype: str | None = None,
         grad_dtype: str | None = None) -> MemoryPlan:
  """Bytes per device of params, gradients and AdamW moments for `cfg` on a mesh."""
  mesh = AbstractMesh(tuple(mesh_shape), shd.MESH_AXES)
  model = nnx.eval_shape(lambda: Qwen2(cfg, rngs=nnx.Rngs(0)))
  params = nnx.state(model, nnx.Param)
  values = jax.tree.map(lambda v: v.get_value(), params,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))
  axes = jax.tree.map(shd.logical_axes_of, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
  tx = optax.adamw(1e-5, mu_dtype=mu_dtype and jnp.dtype(mu_dtype))
  opt_state = jax.eval_shape(tx.init, values)
  # AdamW's moments mirror the params tree (and so its sharding); scalars are negligible.
  moments = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(
      x, optax.ScaleByAdamState)) if isinstance(s, optax.ScaleByAdamState)]
  opt_bytes = sum(_tree_bytes(m.mu, axes, mesh, rules) + _tree_bytes(m.nu, axes, mesh, rules)
                  for m in moments)
  grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, grad_dtype or x.dtype), values)
  return MemoryPlan(
      num_params=sum(math.prod(x.shape) for x in jax.tree.leaves(values)),
      mesh=dict(zip(shd.MESH_AXES, mesh_shape)),
      params_bytes_per_device=_tree_bytes(values, axes, mesh, rules),
      grads_bytes_per_device=_tree_bytes(grads, axes, mesh, rules),
      optimizer_bytes_per_device=opt_bytes)


_PRESET = flags.DEFINE_string("preset", "qwen2.5-0.5b", "Model preset name.")
_MESH = flags.DEFINE_string("mesh", "1,8,1", "Mesh shape data,fsdp,tensor.")
_PARAM_DTYPE = flags.DEFINE_string("param_dtype", "float32", "Parameter (master) dtype.")
_MU_DTYPE = flags.DEFINE_string("mu_dtype", None, "AdamW first-moment dtype (default: params').")


def main(argv):
  del argv
  mesh_shape = tuple(int(x) for x in _MESH.value.split(","))
  if len(mesh_shape) != 3:
    raise app.UsageError(f"--mesh={_MESH.value!r}: expected data,fsdp,tensor")
  cfg = get_preset(_PRESET.value, param_dtype=_PARAM_DTYPE.value)
  result = plan(cfg, mesh_shape, mu_dtype=_MU_DTYPE.value).as_dict()
  result.update(preset=_PRESET.value, param_dtype=_PARAM_DTYPE.value)
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  app.run(main)
