"""Low-rank adapters (LoRA) on the decoder's projections.

A targeted projection computes x . W^T + (alpha / rank) * (x . A^T) . B^T with the base W
frozen and only A [rank, in] and B [out, rank] trained, so gradients and AdamW moments cover
rank x (in + out) numbers per projection instead of in x out: 0.4% of Qwen2.5-32B at rank 16.
B starts at zero, so a freshly adapted model computes exactly what its base does.

Adapters are `LoraParam`s, a subclass of `nnx.Param`: `nnx.split(model, LoraParam, ...)`
separates the trainable part from the frozen base (`train.state.split_trainable`).

The sampler reads merged weights wherever it has a copy of its own, unmerged adapters where it
shares the trainer's arrays. Per decode step of B tokens, a projection in -> out reads in x
out base weights and does 2 B in x out FLOPs; unmerged adapters add r (in + out) to both,
0.6% for the 32B's 5120 x 5120 projections and 0.4% for its MLP at rank 16, plus two thin
matmuls per projection (bench/decode_layouts.py, CPU: 6-10% of a batch-8 decode step, 24-27%
at batch 1; launch overhead on GPUs). Merged weights save that, and cost a pass over every
targeted base matrix at each weight sync. Where the sync writes a sampling copy anyway
(another dtype, another sharding, several processes: `multihost.WeightSync`), it folds the
adapters into that copy (`fold_adapters`) at no memory cost; where the sampler would share
the trainer's arrays, merging would need a second copy of every targeted matrix (the
trainer's stay unmerged): 62 GB for the 32B in bfloat16, memory the KV cache uses, so the
adapters stay unmerged there, unless `sampler_mesh.merge_lora="always"` asks for that copy
(or `sampler_mesh.fuse_projections="always"` makes one; "never": unmerged everywhere).
Merging (`merge`) also serves export.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

# The projections a Qwen2 decoder layer has, by their HF module names.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraParam(nnx.Param):
  """A trainable adapter factor; with adapters present, every other parameter is frozen."""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """rank: adapter rank (0 = no adapters, full fine-tuning). alpha: the update is scaled by
  alpha / rank. targets: which projections (of `PROJECTIONS`) get adapters."""

  rank: int = 0
  alpha: float = 32.0
  targets: tuple[str, ...] = PROJECTIONS

  def __post_init__(self):
    if not isinstance(self.rank, int) or self.rank < 0:
      raise ValueError(f"lora_rank={self.rank!r}; expected 0 (off) or a positive integer")
    if self.rank and self.alpha <= 0:
      raise ValueError(f"lora_alpha={self.alpha!r}; expected a positive number")
    unknown = sorted(set(self.targets) - set(PROJECTIONS))
    if unknown or not self.targets and self.rank:
      raise ValueError(f"lora_targets={tuple(self.targets)!r}: expected a non-empty subset of "
                       f"{PROJECTIONS}")
    defaults = LoraConfig.__dataclass_fields__
    if not self.rank and (self.alpha != defaults["alpha"].default
                          or tuple(self.targets) != defaults["targets"].default):
      raise ValueError(f"lora_alpha={self.alpha!r}, lora_targets={tuple(self.targets)!r} with "
                       "lora_rank=0, which adds no adapters: set lora_rank to train them")

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


class Adapter(nnx.Module):
  """The low-rank update of one projection with kernel [out..., in...] (`n_in` input axes)."""

  def __init__(self, kernel: nnx.Param, n_in: int, config: LoraConfig, rngs: nnx.Rngs):
    out_shape, in_shape = kernel.shape[:kernel.ndim - n_in], kernel.shape[kernel.ndim - n_in:]
    axes = tuple(kernel.get_metadata()["logical_axes"])
    fan_in = math.prod(in_shape)
    # A ~ U(-1/sqrt(in), 1/sqrt(in)) like torch's Linear default (PEFT's choice), B = 0.
    bound = 1.0 / math.sqrt(fan_in)
    self.a = LoraParam(jax.random.uniform(rngs.params(), (config.rank, fan_in), jnp.float32,
                                          -bound, bound),
                       logical_axes=(None,) + (axes[-1] if n_in == 1 else None,))
    self.b = LoraParam(jnp.zeros((math.prod(out_shape), config.rank), jnp.float32),
                       logical_axes=(axes[0] if len(out_shape) == 1 else None, None))
    self.scale = config.scale

  def __call__(self, x: jax.Array, project) -> jax.Array:
    """The update for x [..., in] (flattened inputs) as [..., out] in x's dtype."""
    h = project(x, self.a[...].astype(x.dtype))
    return project(h, (self.scale * self.b[...]).astype(x.dtype))


def add_adapters(model: nnx.Module, config: LoraConfig,
                 rngs: nnx.Rngs | None = None) -> nnx.Module:
  """Gives every targeted projection of `model` (a `Qwen2`) an adapter, in place, and records
  `config` in the model's config. Weights loaded before stay as they are. The A factors are
  drawn from `rngs` (default `nnx.Rngs(0)`)."""
  if not config.enabled:
    return model
  if model.config.lora.enabled:
    raise ValueError("the model already has LoRA adapters")
  rngs = nnx.Rngs(0) if rngs is None else rngs
  for layer in model.layers:
    for parent in (layer.self_attn, layer.mlp):
      for name in config.targets:
        linear = getattr(parent, name, None)
        if linear is not None:
          linear.lora = Adapter(linear.kernel, linear.n_in, config, rngs)
  model.config = model.config.replace(lora=config)
  return model


def adapters_by_kernel(model: nnx.Module) -> dict[tuple, Adapter]:
  """Path of each adapted kernel (as `nnx.to_flat_state` names it) -> its adapter."""
  return {path + ("kernel",): node.lora for path, node in nnx.iter_graph(model)
          if getattr(node, "lora", None) is not None and hasattr(node, "kernel")}


def merge(kernel: jax.Array, a: jax.Array, b: jax.Array, scale: float, dtype=None) -> jax.Array:
  """kernel + scale * B . A (an adapter's factors, [out, in] flattened) in the kernel's shape,
  summed in float32 and rounded once to `dtype` (default: the kernel's; an export in float32
  of a bfloat16 base keeps the sum)."""
  delta = scale * (b.astype(jnp.float32) @ a.astype(jnp.float32))
  return (kernel.astype(jnp.float32) + delta.reshape(kernel.shape)).astype(dtype or kernel.dtype)


def fold_adapters(state: nnx.State, scale: float, dtype=None) -> nnx.State:
  """`state` (a model's parameters, adapters included) with each adapter folded into its
  kernel, kernel + scale * B . A summed in float32 and rounded once to `dtype` (default: the
  kernel's), and the adapters left out: the parameters of the same model without LoRA
  (`qwen2.abstract_model` of its config with `lora` off). A pure function of the arrays, for
  jit."""
  flat = dict(nnx.to_flat_state(state))
  folded = []
  for path, var in flat.items():
    if isinstance(var, LoraParam):
      continue
    a, b = flat.get(path[:-1] + ("lora", "a")), flat.get(path[:-1] + ("lora", "b"))
    if path[-1] == "kernel" and a is not None and b is not None:
      var = var.replace(merge(var.get_value(), a.get_value(), b.get_value(), scale, dtype))
    folded.append((path, var))
  return nnx.from_flat_state(folded)

