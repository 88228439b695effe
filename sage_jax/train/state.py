"""The train state: parameters, optimiser state, step and RNG, sharded like the model.

Parameters are the model's `nnx.State` (what `nnx.split(model)` returns), stored in the model
config's `param_dtype` (float32 master weights while `dtype` runs the matmuls in bfloat16, if
so configured). The optimiser covers the trainable part (`split_trainable`: the LoRA adapters
of a model that has them, else everything); its moments take each parameter's sharding, its
counters are replicated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sage_jax import sharding as shd
from sage_jax.model.lora import LoraParam


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
  """params: the model's nnx.State; opt_state: optax state; step: updates done (int32);
  rng: raw key data (uint32) of the state's random stream, advanced by every update."""

  params: nnx.State
  opt_state: Any
  step: jax.Array
  rng: jax.Array

  def replace(self, **changes) -> "TrainState":
    return dataclasses.replace(self, **changes)


def split_trainable(params: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(trainable, frozen) parts of a model's state: the LoRA adapters and the frozen base when
  the model has adapters, else every parameter and nothing. Only the trainable part gets
  gradients and optimiser moments."""
  flat = nnx.to_flat_state(params)
  if not any(isinstance(v, LoraParam) for _, v in flat):
    return params, nnx.State({})
  trainable, frozen = nnx.split_state(params, LoraParam, ...)
  return trainable, frozen


def merge_trainable(trainable: nnx.State, frozen: nnx.State) -> nnx.State:
  """The inverse of `split_trainable`."""
  return nnx.merge_state(trainable, frozen)


def state_shardings(params: nnx.State, tx: optax.GradientTransformation, mesh: Mesh,
                    rules: shd.ShardingRules = shd.ShardingRules()) -> TrainState:
  """NamedShardings for every leaf of the TrainState built from `params` (real or abstract)."""
  param_sh = shd.state_shardings(params, mesh, rules)
  replicated = NamedSharding(mesh, PartitionSpec())
  abstract_opt = jax.eval_shape(tx.init, split_trainable(params)[0])
  opt_sh = optax.tree_map_params(tx, lambda _, s: s, abstract_opt,
                                 split_trainable(param_sh)[0],
                                 transform_non_params=lambda _: replicated)
  return TrainState(params=param_sh, opt_state=opt_sh, step=replicated, rng=replicated)


def create_train_state(params: nnx.State, tx: optax.GradientTransformation, *, seed: int,
                       shardings: TrainState | None = None) -> TrainState:
  """A fresh state at step 0 that holds `params` themselves, not a copy (placed first when
  they are not in `shardings` yet): a trainer and its model share one set of arrays."""

  def init(params):
    return (tx.init(split_trainable(params)[0]), jnp.zeros((), jnp.int32),
            jax.random.key_data(jax.random.key(seed)))

  if shardings is None:
    opt_state, step, rng = jax.jit(init)(params)
  else:
    params = jax.device_put(params, shardings.params)
    opt_state, step, rng = jax.jit(init, out_shardings=(
        shardings.opt_state, shardings.step, shardings.rng))(params)
  return TrainState(params=params, opt_state=opt_state, step=step, rng=rng)


def abstract_train_state(params: nnx.State, tx: optax.GradientTransformation, *, seed: int = 0,
                         shardings: TrainState | None = None) -> TrainState:
  """Shapes, dtypes and shardings of the train state, for restoring a checkpoint."""
  abstract = jax.eval_shape(
      lambda p: create_train_state(p, tx, seed=seed), params)
  if shardings is None:
    return abstract
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract, shardings)


def abstract_like(arrays: Any) -> Any:
  """Shapes, dtypes and shardings of a tree of arrays, for restoring a checkpoint into."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      arrays)
