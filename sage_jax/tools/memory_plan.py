"""Per-device memory of a run, computed from shapes alone.

`jax.eval_shape` builds the abstract model and AdamW state, the sharding rules give every
array's PartitionSpec on an abstract mesh of the requested shape, and the bytes each device
holds follow; nothing is allocated, so a 72B plan runs on a laptop.

  python -m sage_jax.tools.memory_plan --preset=qwen2.5-32b --mesh=1,64,1 --param_dtype=bfloat16
  python -m sage_jax.tools.memory_plan --config=configs/sage.py:qwen2.5-32b --hosts=8 \
      --devices_per_host=4 --device_memory_gib=95

With --config, the plan covers the whole run on the named hardware: the train state (params,
gradients, AdamW moments; with LoRA, gradients and moments of the adapters only) on the
training mesh over every device, the frozen KL reference when KL is on (a copy of the
trainable params: with LoRA the adapters, sharing the frozen base with the trainer), the
activations of one micro-batch (an estimate, see `activation_bytes`), and on each host the
sampler's copy of the weights and its KV cache (slots x max_len), which live on the same
devices as the train state. The weight sync between steps needs no term of its own: it writes
the new copy into the old one's memory part by part (`multihost.LayerwiseProgram`), with one
part's temporaries, fewer than a train step's activations in every preset
(bench/weight_sync_memory.py). With --device_memory_gib, a run that does not fit exits with
status 1 after its plan, naming the keys that shrink each part.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx
from jax.sharding import AbstractMesh

from sage_jax import config_file
from sage_jax import sharding as shd
from sage_jax.configurable import ConfigError
from sage_jax.model import attention_kernels
from sage_jax.model.config import PRESETS, Qwen2Config, get_preset
from sage_jax.model.qwen2 import abstract_model
from sage_jax.train.state import split_trainable


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  num_params: int
  num_trainable: int
  mesh: dict[str, int]
  params_bytes_per_device: int
  trainable_params_bytes_per_device: int  # of params; all of them without LoRA
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
  spec = rules.param_spec(axes, shape, mesh)
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


@functools.lru_cache(maxsize=8)
def _abstract_params(cfg: Qwen2Config):
  """Shapes and logical axes of the model's parameters, all and trainable ones. Cached: a run's
  plan asks for a model more than once."""
  model = abstract_model(cfg)
  params = nnx.state(model, nnx.Param)
  trainable = split_trainable(params)[0]
  is_var = lambda x: isinstance(x, nnx.Variable)
  values = jax.tree.map(lambda v: v.get_value(), params, is_leaf=is_var)
  axes = jax.tree.map(shd.logical_axes_of, params, is_leaf=is_var)
  train_values = jax.tree.map(lambda v: v.get_value(), trainable, is_leaf=is_var)
  train_axes = jax.tree.map(shd.logical_axes_of, trainable, is_leaf=is_var)
  return values, axes, train_values, train_axes


def plan(cfg: Qwen2Config, mesh_shape: tuple[int, int, int],
         rules: shd.ShardingRules = shd.ShardingRules(), mu_dtype: str | None = None,
         grad_dtype: str | None = None) -> MemoryPlan:
  """Bytes per device of params, gradients and AdamW moments for `cfg` on a mesh. With LoRA
  (`cfg.lora`), params include the adapters and the frozen base; gradients and moments cover
  the adapters only."""
  mesh = AbstractMesh(tuple(mesh_shape), shd.MESH_AXES)
  values, axes, train_values, train_axes = _abstract_params(cfg)
  tx = optax.adamw(1e-5, mu_dtype=mu_dtype and jnp.dtype(mu_dtype))
  opt_state = jax.eval_shape(tx.init, train_values)
  # AdamW's moments mirror the trainable tree (and so its sharding); scalars are negligible.
  moments = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(
      x, optax.ScaleByAdamState)) if isinstance(s, optax.ScaleByAdamState)]
  opt_bytes = sum(_tree_bytes(m.mu, train_axes, mesh, rules)
                  + _tree_bytes(m.nu, train_axes, mesh, rules) for m in moments)
  grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, grad_dtype or x.dtype),
                       train_values)
  return MemoryPlan(
      num_params=sum(math.prod(x.shape) for x in jax.tree.leaves(values)),
      num_trainable=sum(math.prod(x.shape) for x in jax.tree.leaves(train_values)),
      mesh=dict(zip(shd.MESH_AXES, mesh_shape)),
      params_bytes_per_device=_tree_bytes(values, axes, mesh, rules),
      trainable_params_bytes_per_device=_tree_bytes(train_values, train_axes, mesh, rules),
      grads_bytes_per_device=_tree_bytes(grads, train_axes, mesh, rules),
      optimizer_bytes_per_device=opt_bytes)


@dataclasses.dataclass(frozen=True)
class RunPlan:
  """Bytes per device of a whole run (training and host-local sampling)."""

  train: MemoryPlan
  reference_bytes_per_device: int
  activation_bytes_per_device: int
  sampler_copy_bytes_per_device: int
  kv_cache_bytes_per_device: int
  device_memory_bytes: int | None

  @property
  def total_bytes_per_device(self) -> int:
    return (self.train.total_bytes_per_device + self.reference_bytes_per_device
            + self.activation_bytes_per_device + self.sampler_copy_bytes_per_device
            + self.kv_cache_bytes_per_device)

  @property
  def fits(self) -> bool | None:
    if self.device_memory_bytes is None:
      return None
    return self.total_bytes_per_device <= self.device_memory_bytes

  def as_dict(self) -> dict:
    gib = lambda b: round(b / 2**30, 2)
    return {
        "num_params": self.train.num_params, "num_trainable": self.train.num_trainable,
        "mesh": self.train.mesh,
        "gib_per_device": {
            "params": gib(self.train.params_bytes_per_device),
            "grads": gib(self.train.grads_bytes_per_device),
            "optimizer": gib(self.train.optimizer_bytes_per_device),
            "kl_reference": gib(self.reference_bytes_per_device),
            "activations": gib(self.activation_bytes_per_device),
            "sampler_weights": gib(self.sampler_copy_bytes_per_device),
            "kv_cache": gib(self.kv_cache_bytes_per_device),
            "total": gib(self.total_bytes_per_device)},
        "device_memory_gib": None if self.device_memory_bytes is None
        else gib(self.device_memory_bytes),
        "fits": self.fits}


def _shard(n: int, ways: int) -> int:
  """Elements of a dimension of `n` per device when split `ways` ways (replicated if it does
  not divide, as the sharding rules do)."""
  return n // ways if ways > 1 and n % ways == 0 else n


def kv_cache_bytes(cfg: Qwen2Config, num_slots: int, max_len: int, data: int,
                   tensor: int) -> int:
  """The sampler's KV cache per device, slots over `data`, KV heads over `tensor`, with the
  slots' presence rows (a byte per vocabulary id, for the repetition penalty)."""
  per_token = 2 * cfg.num_hidden_layers * _shard(cfg.num_key_value_heads, tensor) * cfg.head_dim
  slots = _shard(num_slots, data)
  return slots * max_len * per_token * np.dtype(cfg.jnp_dtype).itemsize + slots * cfg.vocab_size


def attention_kernel(cfg: Qwen2Config, row_len: int, platform: str | None = None) -> str:
  """The training attention rows of `row_len` run on `platform` ("gpu", "tpu", "cpu"), as
  the model picks it: "cudnn", "splash", or XLA's "blocked" or "dense" path. With no platform
  "auto" is planned as XLA's path, the one that keeps the most."""
  impl = attention_kernels.kernel_for(cfg.attention_impl, cfg.jnp_dtype, cfg.head_dim,
                                      platform or "cpu")
  if impl != "xla":
    return impl
  return "blocked" if 0 < cfg.attention_block < row_len else "dense"


def _attention_bytes(cfg: Qwen2Config, kernel: str, rows: int, row_len: int,
                     tensor: int) -> tuple[int, int]:
  """(bytes of one layer's attention working set, bytes held once for all layers) of
  `kernel` (see `attention_kernel`) on `rows` rows per device, for the backward pass.

  XLA's paths, calibrated against XLA:CPU's memory analysis of the train step (the small
  preset, rows of 512-2048 tokens, no remat: the plan is 1.0-1.2x of XLA's temporaries):
    - dense: four [heads, T, T] float32 arrays per layer: the probabilities kept for the
      backward pass, their gradient, the scores' gradient and its masked copy (XLA keeps
      3.3 per layer).
    - blocked: no [T, T] array; 16 arrays of q's size per layer: the residuals q, k, v, out,
      their block layouts, the output gradient's two layouts, dq / dk / dv accumulated in
      float32 and their transposes (four counted in float32, the rest in the compute dtype);
      and once, four [heads, block, block] float32 scores of the pair of blocks at hand.
  The fused kernels are modelled from their design, not measured (no GPU or TPU here): each
  layer keeps q, k, v, out and the softmax's log-sum-exp per head and token, no [T, T]
  scores. cuDNN also takes the rows' segment mask, which JAX turns into a [rows, 1, T, T]
  bias in the compute dtype (per row, not per head; one for all layers)."""
  item = np.dtype(cfg.jnp_dtype).itemsize
  heads = _shard(cfg.num_attention_heads, tensor)
  q_size = rows * row_len * heads * cfg.head_dim
  if kernel == "dense":
    return 4 * rows * heads * row_len * row_len * 4, 0
  if kernel == "blocked":
    block = cfg.attention_block
    return q_size * (4 * 4 + 12 * item), 4 * rows * heads * block * block * 4
  kv_size = rows * row_len * _shard(cfg.num_key_value_heads, tensor) * cfg.head_dim
  per_layer = 2 * (q_size + kv_size) * item + rows * heads * row_len * 4
  return per_layer, rows * row_len * row_len * item if kernel == "cudnn" else 0


def activation_bytes(cfg: Qwen2Config, rows_per_device: int, row_len: int, tensor: int,
                     logprob_chunk: int, platform: str | None = None) -> int:
  """An estimate of one micro-batch's training activations per device: each layer's input
  [rows, T, hidden] is kept, and its working set (MLP [T, 3 x intermediate / tensor], the
  projections, and attention's, which depends on the kernel on `platform`: see
  `_attention_bytes`) too unless the layer is rematted (`remat_layers`, all when empty): then
  it is live only during the layer's recomputation, one layer at a time. Plus one chunk of
  logits [chunk, vocab / tensor] in float32, with its gradient. XLA:CPU does not free a
  rematted layer's working set early, so on CPU a rematted model needs more than this."""
  item = np.dtype(cfg.jnp_dtype).itemsize
  tokens = rows_per_device * row_len
  kernel = attention_kernel(cfg, row_len, platform)
  attention, once = _attention_bytes(cfg, kernel, rows_per_device, row_len, tensor)
  layer = (tokens * 3 * _shard(cfg.intermediate_size, tensor) * item + attention
           + tokens * 4 * cfg.hidden_size * item)
  kept = tokens * cfg.hidden_size * item
  layers = cfg.num_hidden_layers
  rematted = 0 if cfg.remat == "none" else len(set(cfg.remat_layers)) or layers
  stored = layers * kept + (layers - rematted) * layer + (layer if rematted else 0) + once
  chunk = min(logprob_chunk or tokens, tokens)
  return stored + 2 * chunk * _shard(cfg.vocab_size, tensor) * 4


def run_plan(run, *, hosts: int, devices_per_host: int,
             device_memory_gib: float | None = None, platform: str | None = None) -> RunPlan:
  """The plan of a resolved run config (`run_config.RunConfig`) on `hosts` x
  `devices_per_host` devices of `platform` (which picks the attention kernel, see
  `attention_kernel`): the activations of its largest stage, the KL reference only when RL
  trains with one."""
  cfg = model_config(run.model)
  data, fsdp, tensor = run.mesh.resolve(hosts * devices_per_host)
  train = plan(cfg, (data, fsdp, tensor))
  sampler_tensor = run.sampler_mesh.tensor
  sampler_data = devices_per_host // sampler_tensor
  # On accelerators "auto" samples in bfloat16.
  sampling_dtype = ("bfloat16" if run.sampler_mesh.param_dtype == "auto"
                    else run.sampler_mesh.param_dtype)
  sampler = plan(cfg.replace(param_dtype=sampling_dtype), (sampler_data, 1, sampler_tensor))
  use_kl = run.grpo.use_kl and "rl" in run.pipeline.stages
  return RunPlan(
      train=train,
      reference_bytes_per_device=train.trainable_params_bytes_per_device if use_kl else 0,
      activation_bytes_per_device=max(
          (_stage_activations(run, stage, cfg, data * fsdp, tensor, platform)
           for stage in run.pipeline.stages), default=0),
      sampler_copy_bytes_per_device=sampler.params_bytes_per_device,
      kv_cache_bytes_per_device=kv_cache_bytes(cfg, run.engine.num_slots, run.engine.max_len,
                                               sampler_data, sampler_tensor),
      device_memory_bytes=None if device_memory_gib is None
      else int(device_memory_gib * 2**30))


def _stage_activations(run, stage: str, cfg: Qwen2Config, batch_ways: int, tensor: int,
                       platform: str | None) -> int:
  """One micro-batch's activations per device in `stage`: rows of the length bucket that its
  longest row takes (RL: the longest episode; SFT: the longest example a run loads, which
  `engine.max_len` bounds), the logits in that stage's chunks."""
  longest, chunk = {"rl": (run.agent.max_episode_tokens, run.grpo.logprob_chunk),
                    "sft": (run.engine.max_len, run.sft.logprob_chunk)}[stage]
  longest -= 1  # positions: a row's last token is only a target
  row_len = min((b for b in run.batch.length_buckets if b >= longest),
                default=run.batch.length_buckets[-1])
  rows = run.batch.rows_per_micro_batch(row_len)
  return activation_bytes(cfg, -(-rows // batch_ways), row_len, tensor, chunk, platform)


def check_fits(run, device: jax.Device) -> RunPlan | None:
  """Fails a run at start when its plan does not fit this process's devices (where the
  device reports its memory; CPUs do not), naming what to change."""
  stats = device.memory_stats() or {}
  if "bytes_limit" not in stats:
    return None
  result = run_plan(run, hosts=jax.process_count(), devices_per_host=jax.local_device_count(),
                    device_memory_gib=stats["bytes_limit"] / 2**30, platform=device.platform)
  if not result.fits:
    raise MemoryError(shortfall(run, result, device.device_kind, jax.local_device_count()))
  return result


def shortfall(run, result: RunPlan, device_kind: str, devices_per_host: int) -> str:
  """What a plan that does not fit needs, and the config keys that shrink each part."""
  d = result.as_dict()
  gib = d["gib_per_device"]
  return (f"the run needs {gib['total']} GiB per device, more than the "
          f"{d['device_memory_gib']} GiB of {device_kind}: {gib}. The "
          f"sampler's weights ({gib['sampler_weights']} GiB) and KV cache ({gib['kv_cache']} "
          f"GiB) live on each host: raise config.sampler_mesh.tensor (now "
          f"{run.sampler_mesh.tensor}, at most the host's {devices_per_host} devices) "
          f"or lower config.engine.num_slots / config.engine.max_len; the train state shrinks "
          f"with more hosts (config.mesh), the activations with config.batch.micro_batch_tokens.")


def model_config(spec) -> Qwen2Config:
  """The architecture a run's model section names (`loader.architecture`), with its numerics."""
  from sage_jax.weights import loader  # noqa: PLC0415

  dtypes = {k: v for k, v in (("param_dtype", spec.param_dtype), ("dtype", spec.dtype)) if v}
  return loader.architecture(spec).replace(remat=spec.remat, remat_layers=spec.remat_layers,
                                           attention_block=spec.attention_block,
                                           attention_impl=spec.attention_impl,
                                           lora=spec.lora_config, **dtypes)


def main(argv):
  del argv
  f = flags.FLAGS
  if f.hosts < 1 or f.devices_per_host < 1:
    raise app.UsageError(f"--hosts={f.hosts} --devices_per_host={f.devices_per_host}: each "
                         "must be at least 1")
  if f.config is not None:
    from sage_jax import run_config  # noqa: PLC0415

    ignored = [name for name in ("preset", "mesh", "param_dtype", "mu_dtype")
               if f[name].present]
    if ignored:
      raise app.UsageError(
          f"--{', --'.join(ignored)} with --config: the plan follows the run's config (its "
          "model, mesh and optimizer, whose moments take the params' dtype); override it there "
          "(e.g. --config.mesh.fsdp=8 --config.model.param_dtype=bfloat16)")
    run_config.resolve(f.config)  # the config's own errors, before those of the hardware
    try:
      run = run_config.resolve(f.config, f.hosts * f.devices_per_host, f.devices_per_host)
    except ConfigError as e:
      raise ConfigError(f"{e}; planned on --hosts={f.hosts} x --devices_per_host="
                        f"{f.devices_per_host}: pass the hardware the run is for") from e
    plan_ = run_plan(run, hosts=f.hosts, devices_per_host=f.devices_per_host,
                     device_memory_gib=f.device_memory_gib)
    result = plan_.as_dict()
    result.update(hosts=f.hosts, devices_per_host=f.devices_per_host)
    print(json.dumps(result, indent=2))
    if plan_.fits is False:
      sys.exit(f"does not fit: {shortfall(run, plan_, 'the device', f.devices_per_host)}")
    return
  try:
    mesh_shape = tuple(int(x) for x in f.mesh.split(","))
  except ValueError:
    mesh_shape = ()
  if len(mesh_shape) != 3 or min(mesh_shape) < 1:
    raise app.UsageError(f"--mesh={f.mesh!r}: expected data,fsdp,tensor, three sizes of at "
                         "least 1 (no -1: a plan has no device count to fill it from)")
  cfg = get_preset(f.preset, param_dtype=f.param_dtype)
  result = plan(cfg, mesh_shape, mu_dtype=f.mu_dtype).as_dict()
  result.update(preset=f.preset, param_dtype=f.param_dtype)
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  flags.DEFINE_enum("preset", "qwen2.5-0.5b", sorted(PRESETS),
                    "Model preset (without --config).")
  flags.DEFINE_string("mesh", "1,8,1", "Mesh shape data,fsdp,tensor (without --config).")
  flags.DEFINE_string("param_dtype", "float32", "Parameter (master) dtype (without --config).")
  flags.DEFINE_string("mu_dtype", None, "AdamW first-moment dtype (default: params').")
  config_file.define_flag("config", "configs/<file>.py:<preset>: plan the run.")
  flags.DEFINE_integer("hosts", 1, "Hosts of the run (with --config).")
  flags.DEFINE_integer("devices_per_host", 1, "Accelerators per host (with --config).")
  flags.DEFINE_float("device_memory_gib", None, "Memory of one accelerator (with --config).")
  config_file.run(main)
