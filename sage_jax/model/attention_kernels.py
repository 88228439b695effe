"""Fused attention kernels for training rows: cuDNN on GPUs, Pallas splash attention on TPUs.

`Qwen2Config.attention_impl` picks one: "xla" (the plain-JAX dense or `blocked_attention`
path, which runs everywhere), "cudnn", "splash", or "auto": cuDNN on GPU, splash on TPU, XLA
elsewhere. A kernel that does not apply to a model falls back to XLA (`kernel_for` says
why). Both kernels keep packed sequences apart with segment ids and never hold [T, T] scores:
  - cuDNN via `jax.nn.dot_product_attention(implementation="cudnn")`: float16 / bfloat16,
    head_dim a multiple of 8 up to 128 (Qwen2.5's 64 and 128). Packed segments go in as a
    boolean mask [b, 1, T, T] (1 byte per entry, 256 MB for a 16k row), which XLA's path
    would otherwise turn into float32 scores per head.
  - splash: the TPU kernel from `jax.experimental.pallas.ops.tpu.splash_attention`, one
    kernel per KV head with its query group (grouped-query attention as MQA). Off TPU it
    runs in Pallas interpret mode (what the CPU tests check; far too slow for training).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sage_jax import sharding as shd

IMPLEMENTATIONS = ("auto", "xla", "cudnn", "splash")
_AUTO = {"gpu": "cudnn", "tpu": "splash"}
# Splash attention's query / key block (tokens); rows are padded to a multiple of it.
SPLASH_BLOCK = 512


def check_implementation(name: str) -> None:
  if name not in IMPLEMENTATIONS:
    raise ValueError(f"attention_impl={name!r}; expected one of {IMPLEMENTATIONS}")


def resolve(name: str, backend: str | None = None) -> str:
  """The implementation "auto" means on `backend` (default: JAX's default backend)."""
  check_implementation(name)
  if name != "auto":
    return name
  return _AUTO.get(backend or jax.default_backend(), "xla")


def cudnn_unsupported(dtype, head_dim: int) -> str | None:
  """Why cuDNN's fused attention cannot run these shapes, or None when it can."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"cuDNN attention needs float16 or bfloat16, not {jnp.dtype(dtype).name}"
  if head_dim % 8 or head_dim > 128:
    return f"cuDNN attention needs head_dim a multiple of 8 up to 128, not {head_dim}"
  return None


def kernel_for(name: str, dtype, head_dim: int, backend: str | None = None) -> str:
  """The kernel training attention runs on `backend`: `resolve(name, backend)`, or "xla" where
  cuDNN does not apply and was only chosen by "auto" (an explicit "cudnn" that cannot run is
  an error)."""
  impl = resolve(name, backend)
  if impl == "cudnn":
    reason = cudnn_unsupported(dtype, head_dim)
    if reason and name == "cudnn":
      raise ValueError(f"attention_impl='cudnn': {reason}")
    if reason:
      return "xla"
  return impl


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KernelCausal:
  """Stands in for a dense training mask when a fused kernel runs: token i of a row attends
  token j <= i of its segment (`segment_ids` [b, t]; equal ids = same packed sequence)."""

  segment_ids: jax.Array
  kernel: str = dataclasses.field(metadata=dict(static=True))


def kernel_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: KernelCausal
                     ) -> jax.Array:
  """q: [b, t, kv_heads, group, d]; k, v: [b, t, kv_heads, d]. Returns [b, t, kv, group, d]
  in v's dtype, equal to softmax(q k^T / sqrt(d) masked) v."""
  if mask.kernel == "cudnn":
    return _cudnn(q, k, v, mask.segment_ids)
  if mask.kernel == "splash":
    return _per_shard(_splash, q, k, v, mask.segment_ids)
  raise ValueError(f"no fused attention kernel {mask.kernel!r}")


def _cudnn(q, k, v, segment_ids, implementation="cudnn"):
  b, t, kv, g, d = q.shape
  same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
  out = jax.nn.dot_product_attention(q.reshape(b, t, kv * g, d), k, v, mask=same,
                                     is_causal=True, implementation=implementation)
  return out.reshape(b, t, kv, g, d).astype(v.dtype)


def _per_shard(fn, q, k, v, segment_ids):
  """fn on each device's rows and KV heads: a Pallas kernel has no partitioning rule, so
  under a mesh it runs in `shard_map` over the activations' batch and KV-head sharding."""
  ctx = shd.active()
  if ctx is None:
    return fn(q, k, v, segment_ids)
  mesh, rules = ctx
  q_spec = rules.spec(("act_batch", None, "act_kv_heads", None, None), q.shape, mesh)
  kv_spec = rules.spec(("act_batch", None, "act_kv_heads", None), k.shape, mesh)
  seg_spec = rules.spec(("act_batch", None), segment_ids.shape, mesh)
  return jax.shard_map(fn, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec),
                       out_specs=q_spec, check_vma=False)(q, k, v, segment_ids)


def _splash(q, k, v, segment_ids):
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # noqa: PLC0415
      splash_attention_kernel as splash, splash_attention_mask as masks)

  b, t, kv, g, d = q.shape
  block = min(SPLASH_BLOCK, -(-t // 128) * 128)
  pad = -t % block
  # Padding keys sit after every real query, so causality already hides them.
  widths = lambda x: [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
  q, k, v = (jnp.pad(x, widths(x)) for x in (q, k, v))
  segments = jnp.pad(segment_ids.astype(jnp.int32), [(0, 0), (0, pad)], constant_values=-1)
  n = t + pad
  sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                            block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                            block_q_dq=block, block_kv_dq=block)
  kernel = splash.make_splash_mqa_single_device(
      masks.MultiHeadMask([masks.CausalMask((n, n))] * g), block_sizes=sizes,
      interpret=jax.default_backend() != "tpu")
  scale = d ** -0.5

  def one(q_group, k_head, v_head, seg):  # [g, n, d], [n, d], [n, d], [n]
    return kernel((q_group * scale).astype(q_group.dtype), k_head, v_head,
                  segment_ids=splash.SegmentIds(q=seg, kv=seg))

  per_head = jax.vmap(one, in_axes=(0, 0, 0, None))  # over KV heads
  per_row = jax.vmap(per_head)  # over rows
  out = per_row(q.transpose(0, 2, 3, 1, 4), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                segments)  # [b, kv, g, n, d]
  return out.transpose(0, 3, 1, 2, 4)[:, :t].astype(v.dtype)
