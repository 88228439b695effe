"""The one place that maps logical axis names to mesh axes.

Model code names the logical axes of every parameter (``logical_axes`` metadata on each
``nnx.Param``) and of the activations it constrains (``constrain``). This module owns the
table that turns those names into ``PartitionSpec`` entries over the mesh axes
``data``, ``fsdp`` and ``tensor``, builds the mesh, and places parameters.

The same model code therefore runs on one CPU, on 8 simulated CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``), on a GPU and on a multi-host TPU
pod (after ``multihost.initialize()``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

MeshAxes = str | tuple[str, ...] | None

# Parameters shard their model dimension over `fsdp` and their head / MLP / vocab dimension
# over `tensor`; activations shard batch over (data, fsdp) and heads / MLP over `tensor`.
DEFAULT_RULES: tuple[tuple[str, MeshAxes], ...] = (
    # Parameters.
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    # Activations.
    ("act_batch", ("data", "fsdp")),
    ("act_len", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    # KV cache.
    ("cache_batch", ("data", "fsdp")),
    ("cache_len", None),
    ("cache_kv_heads", "tensor"),
)
# A layer's KV cache, [batch, len, kv_heads, head_dim].
CACHE_AXES = ("cache_batch", "cache_len", "cache_kv_heads", None)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """Logical axis name -> mesh axes (a name, a tuple of names, or None = replicated)."""

  rules: tuple[tuple[str, MeshAxes], ...] = DEFAULT_RULES

  def __post_init__(self):
    for name, axes in self.rules:
      for a in (axes,) if isinstance(axes, str) else (axes or ()):
        if a not in MESH_AXES:
          raise ValueError(f"sharding rule {name!r} -> {axes!r}: unknown mesh axis {a!r}; "
                           f"mesh axes are {MESH_AXES}")

  def with_overrides(self, overrides: dict[str, MeshAxes]) -> "ShardingRules":
    table = dict(self.rules)
    table.update(overrides)
    return ShardingRules(tuple(table.items()))

  def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
    if logical is None:
      return ()
    table = dict(self.rules)
    if logical not in table:
      raise KeyError(f"logical axis {logical!r} has no sharding rule; known: {sorted(table)}")
    axes = table[logical]
    return (axes,) if isinstance(axes, str) else tuple(axes or ())

  def spec(self, logical_axes: Sequence[str | None], shape: Sequence[int],
           mesh: Mesh) -> PartitionSpec:
    """PartitionSpec for an array of `shape` whose dims are named `logical_axes`.

    A mesh axis is used at most once per array and only where it divides the dimension
    (e.g. 14 attention heads on tensor=4 stay replicated), so every preset runs on every
    mesh; the divisibility fallback is logged once per (shape, axes).
    """
    return self._spec(logical_axes, shape, mesh, relocate=())

  def param_spec(self, logical_axes: Sequence[str | None], shape: Sequence[int],
                 mesh: Mesh) -> PartitionSpec:
    """`spec` for a parameter. `fsdp` only stores parameters (each is gathered whole where it
    is used), so where it divides none of the dimensions its rules name, it shards the largest
    unsharded dimension it divides: Qwen2.5-32B's model dimension (5120) does not split 12
    ways, its MLP (27648) and vocabulary (152064) do, and without this each of 12 devices
    would hold every one of those weights, gradients and AdamW moments whole."""
    return self._spec(logical_axes, shape, mesh, relocate=("fsdp",))

  def _spec(self, logical_axes, shape, mesh, relocate: tuple[str, ...]) -> PartitionSpec:
    if len(logical_axes) != len(shape):
      raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    entries = []
    for name, dim in zip(logical_axes, shape):
      chosen = []
      size = 1
      for axis in self.mesh_axes(name):
        n = mesh.shape[axis]
        if axis in used or n == 1:
          continue
        if dim % (size * n):
          _log_fallback(name, axis, dim, n)
          continue
        chosen.append(axis)
        size *= n
      used.update(chosen)
      entries.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    for axis in relocate:
      named = any(axis in self.mesh_axes(name) for name in logical_axes)
      free = [i for i, entry in enumerate(entries)
              if entry is None and shape[i] % mesh.shape[axis] == 0]
      if named and axis not in used and mesh.shape[axis] > 1 and free:
        entries[max(free, key=lambda i: shape[i])] = axis
    return PartitionSpec(*entries)


_FALLBACKS_LOGGED: set[tuple] = set()


def _log_fallback(name, axis, dim, n):
  key = (name, axis, dim, n)
  if key not in _FALLBACKS_LOGGED:
    _FALLBACKS_LOGGED.add(key)
    logging.info("logical axis %r (size %d) not sharded over %r (size %d): not divisible",
                 name, dim, axis, n)


# --- Mesh ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh shape; one axis may be -1 to take all remaining devices."""

  data: int = 1
  fsdp: int = -1
  tensor: int = 1

  def resolve(self, num_devices: int) -> tuple[int, int, int]:
    shape = [self.data, self.fsdp, self.tensor]
    if shape.count(-1) > 1:
      raise ValueError(f"mesh {self}: at most one axis may be -1")
    if any(s == 0 or s < -1 for s in shape):
      raise ValueError(f"mesh {self}: axis sizes must be positive or -1")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
      if num_devices % known:
        raise ValueError(f"mesh {self}: {num_devices} devices are not divisible by {known}")
      shape[shape.index(-1)] = num_devices // known
    if math.prod(shape) != num_devices:
      raise ValueError(f"mesh {self} has {math.prod(shape)} devices, but {num_devices} "
                       "are available")
    return tuple(shape)


def make_mesh(config: MeshConfig = MeshConfig(),
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the (data, fsdp, tensor) mesh over `devices` (default: all devices).

  With several processes, devices are laid out process by process (each process's devices
  are a contiguous block of the leading axes), so that each process owns whole rows of a
  batch split over (data, fsdp) and feeds them from its own host.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = config.resolve(len(devices))
  if len({d.process_index for d in devices}) > 1:
    grid = np.asarray(sorted(devices, key=lambda d: (d.process_index, d.id))).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))
  try:
    from jax.experimental import mesh_utils
    grid = mesh_utils.create_device_mesh(shape, devices=devices)
  except (ValueError, NotImplementedError, AssertionError):
    grid = np.asarray(devices).reshape(shape)
  auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  return Mesh(grid, MESH_AXES, axis_types=auto)


# --- Active context for activation constraints -------------------------------------------

_ACTIVE = threading.local()


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: ShardingRules = ShardingRules()) -> Iterator[None]:
  """Makes `constrain` place activations on `mesh` while tracing inside this block."""
  previous = getattr(_ACTIVE, "value", None)
  _ACTIVE.value = (mesh, rules)
  try:
    yield
  finally:
    _ACTIVE.value = previous


def active() -> tuple[Mesh, ShardingRules] | None:
  return getattr(_ACTIVE, "value", None)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """Sharding constraint by logical names; a no-op outside `use_rules`."""
  ctx = active()
  if ctx is None:
    return x
  mesh, rules = ctx
  return jax.lax.with_sharding_constraint(
      x, NamedSharding(mesh, rules.spec(logical_axes, x.shape, mesh)))


def named_sharding(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                   rules: ShardingRules = ShardingRules()) -> NamedSharding:
  return NamedSharding(mesh, rules.spec(logical_axes, shape, mesh))


def param_sharding(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                   rules: ShardingRules = ShardingRules()) -> NamedSharding:
  return NamedSharding(mesh, rules.param_spec(logical_axes, shape, mesh))


# --- Parameters ---------------------------------------------------------------------------


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def logical_axes_of(variable: nnx.Variable) -> tuple[str | None, ...]:
  axes = variable.get_metadata().get("logical_axes")
  if axes is None:
    raise ValueError(f"variable {variable!r} names no logical axes")
  return tuple(axes)


def state_shardings(state: nnx.State, mesh: Mesh,
                    rules: ShardingRules = ShardingRules()) -> nnx.State:
  """A tree like `state` with a NamedSharding per variable (read from its logical axes)."""

  def one(v):
    value = v.get_value()
    return v.replace(param_sharding(logical_axes_of(v), value.shape, mesh, rules))

  return jax.tree.map(one, state, is_leaf=_is_variable)


def create_sharded(make_module: Callable[[], nnx.Module], mesh: Mesh,
                   rules: ShardingRules = ShardingRules()) -> nnx.Module:
  """Initialises a module with every parameter created directly in its target sharding."""
  abstract = nnx.eval_shape(make_module)
  graphdef, abstract_state = nnx.split(abstract)
  shardings = state_shardings(abstract_state, mesh, rules)

  def init():
    return nnx.state(make_module())

  state = jax.jit(init, out_shardings=shardings)()
  return nnx.merge(graphdef, state)


def place(module: nnx.Module, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> nnx.Module:
  """Moves an existing module's variables into their target sharding (in place)."""
  state = nnx.state(module)
  nnx.update(module, jax.device_put(state, state_shardings(state, mesh, rules)))
  return module
