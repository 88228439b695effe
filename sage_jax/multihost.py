"""Multi-controller JAX: joining a run, host-local sampling meshes, and the few collectives
that every process runs in the same order.

Sampling is host-local and training is global (DESIGN.md, principle 6). Each process samples
with its own copy of the weights on a mesh over its own devices, so continuous batching and
AppWorld timing never make processes wait for each other; the cross-process steps are
(0) at startup, connecting the device groups (`initialize`, `connect`), (1) the weight sync
after an update (`WeightSync`), (2) the global train batch (`make_global`, with the layout
agreed through `allgather`), (3) gathers of episode metrics and evaluation records
(`allgather_objects`), (4) the stop decision after each step (`any_process`), (5) process 0's
listing of the checkpoint steps, at a resume whether a damaged one is moved aside, before
each save whether its step is there already, and its reads of the workdir files that decide
which stages and evaluations run (`from_lead`, `allgather_objects`), and (6) at the end,
leaving the run together (`finish`). Each is a collective: every process calls it, in
the same order. A stop asked on one process during an evaluation reaches the others without
one (`asked_anywhere`): through the coordination service's key-value store, which each
process reads when it next checks, whatever it is doing.

With one process every function here is the identity or a local device-to-device copy, so
single-host runs pay nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import glob
import itertools
import logging
import math
import os
import pickle
import signal
import sys
import threading
import time
import warnings
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax._src import distributed  # the coordination service's client (as orbax reads it)
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sage_jax import sharding as shd
from sage_jax import storage
from sage_jax.configurable import ConfigError
from sage_jax.model import fused_projections, lora
from sage_jax.model.qwen2 import abstract_model
from sage_jax.weights import loader

# Environment our launchers (launch/local.py, launch/multinode.sh, launch/slurm.sbatch)
# export for every process of a run.
COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"
NUM_PROCESSES_ENV = "JAX_NUM_PROCESSES"
PROCESS_ID_ENV = "JAX_PROCESS_ID"
# launch/tpu_pod.py sets it on every worker of a Cloud TPU slice, whose hosts JAX finds
# through the VM metadata (TPU_WORKER_HOSTNAMES is GKE's).
TPU_POD_ENV = "SAGE_JAX_JOIN_TPU_POD"


def initialize() -> None:
  """Joins a multi-process run when the environment describes one; a no-op otherwise.

  - our launchers: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID; each process
    drives every device of its host (JAX_LOCAL_DEVICE_IDS, when set, chooses);
  - Cloud TPU slices (launch/tpu_pod.py's SAGE_JAX_JOIN_TPU_POD=1, GKE's
    TPU_WORKER_HOSTNAMES with several hosts, or Megascale) and the tasks of an srun step:
    JAX's own detection, except that a SLURM task alone on its node, or given GPUs of its
    own, drives every GPU it sees (JAX would give it GPU <SLURM_LOCALID>, for one task per
    GPU of a node whose GPUs every task sees);
  - on CPU (simulated devices, one machine), collectives go over gloo.
  Every entry point calls this first; a single process runs exactly as before.
  """
  if jax.distributed.is_initialized():
    return
  coordinator = os.environ.get(COORDINATOR_ENV)
  tpu_hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  slurm_tasks = int(os.environ.get("SLURM_NTASKS", "1") or 1)
  # The tasks of an srun step join; a batch script's own shell (sbatch, salloc) has the
  # allocation's SLURM_NTASKS too, but no step: what it runs directly is one process.
  slurm_step = slurm_tasks > 1 and "SLURM_STEP_NODELIST" in os.environ
  if coordinator:
    num_processes = int(os.environ[NUM_PROCESSES_ENV])
    if num_processes <= 1:
      return
    _use_cpu_collectives_if_cpu()
    # All three given: no cluster detection, whose SLURM rule would hide all GPUs but one.
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=int(os.environ[PROCESS_ID_ENV]),
                               cluster_detection_method="deactivate")
  elif (os.environ.get(TPU_POD_ENV) == "1" or "," in tpu_hosts
        or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS") or slurm_step):
    _use_cpu_collectives_if_cpu()
    jax.distributed.initialize(local_device_ids=_slurm_task_gpus())
  else:
    if slurm_tasks > 1:
      logging.warning("SLURM_NTASKS=%d but no srun step: running as one process (start the "
                      "command with srun, or launch/slurm.sbatch, for every task to join)",
                      slurm_tasks)
    return
  # jax.distributed's own SIGTERM handler only records a preemption notice for the step loops
  # to meet at a sync point: outside them (setup, expert plays, evaluations) the signal went
  # unheeded, and a resumed loop never met the notice's step and trained on. A signal stops a
  # process as in a single-process run: at once outside the loops, within them after the
  # step, with a checkpoint (their `PreemptionGuard`), every process together. That handler is
  # the only source of JAX's preemption notices, so the loops watch their guard alone.
  if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
  # Gloo (CPU collectives) connects a group of devices at its first collective and gives up
  # when a peer is 30 s late there. Right after joining, processes are seconds apart: the
  # groups of JAX's host gathers (over the processes x local devices grid of
  # `multihost_utils.process_allgather`) are connected now, not at a job's first gather,
  # after a setup (loading weights, compiling) whose time differs between hosts.
  connect(Mesh(np.asarray(jax.devices()).reshape(jax.process_count(), -1),
               ("processes", "local_devices")))
  logging.info("process %d of %d: %d local devices, %d in all", jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count())


def finish() -> None:
  """Leaves a multi-process run whose work this process has done (every entry point calls it
  on success, after its last collective): JAX's shutdown, a barrier of every process and then
  the coordination service's end, while the runtime is whole. Left to JAX's exit hook, it runs
  in the interpreter's teardown after the backends are cleared, where a process of a run that
  had succeeded was seen to abort (SIGABRT) in the coordination service's shutdown. A failing
  process skips it (its peers would wait for it at that barrier); JAX's hook ends its part as
  before. A no-op for one process."""
  if jax.distributed.is_initialized():
    jax.distributed.shutdown()


def _slurm_task_gpus() -> list[int] | None:
  """Every GPU the SLURM task sees (CUDA_VISIBLE_DEVICES, else the node's /dev/nvidia<N>) when
  it has a node of its own, or when SLURM gave each task GPUs of its own (it sees
  --gpus-per-task of them, or fewer than JAX's choice, GPU <SLURM_LOCALID>, needs:
  --gpu-bind); None otherwise (JAX's choice, for tasks that share their node's GPUs)."""
  if os.environ.get("JAX_LOCAL_DEVICE_IDS"):
    return None
  visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
  count = (len(visible.split(",")) if visible.strip()
           else len(glob.glob("/dev/nvidia[0-9]*")))
  # The step's counts (what JAX's detection reads), else the allocation's.
  nodes = int(os.environ.get("SLURM_STEP_NUM_NODES") or os.environ.get("SLURM_NNODES") or 0)
  alone = nodes and int(os.environ.get("SLURM_NTASKS") or 0) == nodes
  per_task = os.environ.get("SLURM_GPUS_PER_TASK", "")
  bound = ((per_task.isdigit() and int(per_task) == count)
           or int(os.environ.get("SLURM_LOCALID") or 0) >= count)
  return list(range(count)) if count and (alone or bound) else None


def _use_cpu_collectives_if_cpu() -> None:
  if os.environ.get("JAX_PLATFORMS", "") == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def is_lead() -> bool:
  """Whether this process writes the run's files (metrics, reports, exports)."""
  return jax.process_index() == 0


def share(n: int, index: int | None = None, count: int | None = None) -> slice:
  """The contiguous part of `n` items that process `index` (default: this one) handles."""
  index = jax.process_index() if index is None else index
  count = jax.process_count() if count is None else count
  bounds = np.linspace(0, n, count + 1).round().astype(int)
  return slice(int(bounds[index]), int(bounds[index + 1]))


def pool_config(pool: Any, appworld_root: str, workdir: storage.PathLike) -> Any:
  """`pool` (an EnvPoolConfig) as this process runs it on `appworld_root`. Its outputs: with
  one process, `pool.outputs_root`, else the run's default (<workdir>/appworld, when the
  workdir is on this host); with several, `pool.outputs_root`/process_<i> when set, else None
  (the pool's own temporary directory on this host), so that hosts never share an experiment
  directory. Its worker logs: `pool.log_dir`, per process like the outputs."""
  if jax.process_count() == 1:
    outputs = pool.outputs_root or storage.local_subdir(workdir, "appworld")
  else:
    outputs = process_subdir(pool.outputs_root)
  return dataclasses.replace(pool, appworld_root=appworld_root, outputs_root=outputs,
                             log_dir=process_subdir(pool.log_dir))


def process_subdir(path: str | None) -> str | None:
  """For files that each process writes on its own (AppWorld outputs, worker logs):
  `path`/process_<i> with several processes, `path` with one; None stays None."""
  if not path or jax.process_count() == 1:
    return path or None
  return os.path.join(path, f"process_{jax.process_index()}")


# --- Collectives ----------------------------------------------------------------------------


def allgather(values: np.ndarray) -> np.ndarray:
  """[P, *shape]: `values` (same shape and dtype on every process) of every process."""
  values = np.asarray(values)
  if jax.process_count() == 1:
    return values[None]
  return np.asarray(multihost_utils.process_allgather(values, tiled=False))


def any_process(flag: bool) -> bool:
  """True on every process when `flag` is true on any (e.g. a SIGTERM on one host)."""
  return bool(allgather(np.asarray([int(bool(flag))], np.int32)).any())


def allgather_objects(value: Any) -> list[Any]:
  """Every process's picklable `value`, in process order (two small collectives)."""
  if jax.process_count() == 1:
    return [value]
  data = np.frombuffer(pickle.dumps(value), np.uint8)
  sizes = allgather(np.asarray([data.size], np.int64))[:, 0]
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:data.size] = data
  gathered = allgather(padded)
  return [pickle.loads(gathered[i, :sizes[i]].tobytes()) for i in range(len(sizes))]


def check_same(value: Any, what: str) -> None:
  """Raises ValueError on every process unless `value` (picklable, compared with ==) is the
  same on all: input that each process reads for itself (a host-local copy of a file) and
  that all must share. The message shows each differing process's value beside process 0's."""
  values = allgather_objects(value)
  differ = [i for i, v in enumerate(values) if v != values[0]]
  if differ:
    raise ValueError(f"{what} differs between processes: process 0 has {values[0]}; "
                     + "; ".join(f"process {i} has {values[i]}" for i in differ))


# The coordination service's key that a process sets when a stop was asked of it.
_STOP_KEY = "sage_jax/stop_asked"


def asked_anywhere(asked: Callable[[], bool], every_s: float = 1.0) -> Callable[[], bool]:
  """A predicate that is true once `asked()` is true on this process or on any other that
  polls its own: a process whose `asked()` turns true sets a key in the coordination
  service's key-value store, which the others read at most every `every_s` seconds. So a
  SIGTERM to one host ends every host's share of an evaluation (`sage_jax.stopping`), not
  only its own while the others run theirs to the end. A stop is the run's last act, so the
  key is never cleared. With one process, `asked` itself."""
  client = distributed.global_state.client
  if jax.process_count() == 1 or client is None:
    return asked
  told, seen, last = False, False, -math.inf

  def anywhere() -> bool:
    nonlocal told, seen, last
    if asked():
      if not told:
        client.key_value_set(_STOP_KEY, str(jax.process_index()), allow_overwrite=True)
        told = True
      return True
    if not seen and time.monotonic() - last >= every_s:
      last = time.monotonic()
      try:
        client.key_value_try_get(_STOP_KEY)
        seen = True
      except jax.errors.JaxRuntimeError as e:  # NOT_FOUND: no process was asked
        if "NOT_FOUND" not in str(e):
          raise
    return seen

  return anywhere


class ProcessFailed(RuntimeError):
  """A process's part of an `all_succeed` raised; every process raises this, naming it."""


def all_succeed(compute: Callable[[], Any]) -> Any:
  """`compute()`, this process's part of work that every process does before its next
  collective (its share of rollouts, of an evaluation): if it raises on any process, every
  process raises ProcessFailed naming that error (the failed process's raised from it) at
  once. The others would otherwise wait in their next collective until the runtime gave up
  on the failed process, minutes later, with an error that names neither."""
  if jax.process_count() == 1:
    return compute()
  value, failure, error = None, None, None
  try:
    value = compute()
  except ProcessFailed:  # every process raised it already
    raise
  except Exception as e:  # noqa: BLE001 - whatever it is, every process must hear of it
    failure, error = e, f"{type(e).__name__}: {e}"
  failed = [(i, e) for i, e in enumerate(allgather_objects(error)) if e is not None]
  if failed:
    raise ProcessFailed("; ".join(f"process {i} failed: {e}" for i, e in failed)) from failure
  return value


class LeadFailed(ProcessFailed):
  """Process 0's part of a `from_lead` raised; every process raises this, with its message."""


def from_lead(compute: Callable[[], Any]) -> Any:
  """`compute()`, run on process 0 alone, returned on every process: a decision that all must
  take alike (which checkpoint step to resume from). A collective, so also a barrier: no
  process returns before process 0 has computed it. If it raises there, every process raises
  LeadFailed naming that error (process 0's raised from it) at once: the others would
  otherwise wait in the gather until the runtime noticed that process 0 had gone (a run of
  one process gets the error itself)."""
  if jax.process_count() == 1:
    return compute()
  outcome, failure = None, None
  if is_lead():
    try:
      outcome = (compute(), None)
    except Exception as e:  # noqa: BLE001 - whatever it is, every process must hear of it
      failure, outcome = e, (None, f"{type(e).__name__}: {e}")
  value, error = allgather_objects(outcome)[0]
  if error is not None:
    raise LeadFailed(f"process 0 failed: {error}") from failure
  return value


def connect(mesh: Mesh) -> None:
  """Runs one small sum over each subset of `mesh`'s axes, so that the device groups that a
  program on the mesh communicates in are connected now, while processes are in step, not
  at that program's first run (after a compilation whose time differs between hosts; see
  `initialize`). It waits for every device's sum, so no connection is still being made (and
  reported by gloo on stdout) when it returns."""
  if jax.process_count() == 1:
    return
  spec = PartitionSpec(*mesh.axis_names)
  ones = jax.make_array_from_callback(mesh.devices.shape, NamedSharding(mesh, spec),
                                      lambda index: np.ones((1,) * mesh.devices.ndim))
  axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
  groups = [g for size in range(1, len(axes) + 1) for g in itertools.combinations(axes, size)]
  with _stdout_to_stderr():
    for group in groups:
      total = jax.shard_map(functools.partial(jax.lax.psum, axis_name=group), mesh=mesh,
                            in_specs=spec, out_specs=spec)
      jax.jit(total)(ones).block_until_ready()


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
  """Gloo reports each connected group on the process's stdout, which entry points keep for
  their own output (e.g. `generate`'s text): while connecting, file descriptor 1 is stderr."""
  sys.stdout.flush()
  saved = os.dup(1)
  os.dup2(2, 1)
  try:
    yield
  finally:
    ctypes.CDLL(None).fflush(None)  # what C's stdio still buffers goes to stderr too
    os.dup2(saved, 1)
    os.close(saved)


def sync_barrier(name: str) -> None:
  """All processes reach this point before any goes on (e.g. before reading a file that
  process 0 wrote)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


# --- Meshes ---------------------------------------------------------------------------------


def _process_devices(index: int) -> list[jax.Device]:
  return sorted((d for d in jax.devices() if d.process_index == index), key=lambda d: d.id)


def host_grids(config: shd.MeshConfig) -> np.ndarray:
  """[P, data, fsdp, tensor]: process p's devices laid out as its sampling mesh."""
  grids = []
  for p in range(jax.process_count()):
    devices = _process_devices(p)
    grids.append(np.asarray(devices, dtype=object).reshape(config.resolve(len(devices))))
  return np.stack(grids)


def local_mesh(config: shd.MeshConfig) -> Mesh:
  """This process's sampling mesh: its own devices only, so nothing it runs is a
  cross-process collective."""
  grid = host_grids(config)[jax.process_index()]
  return Mesh(grid, shd.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


SAMPLING_DTYPES = ("auto", "float32", "bfloat16")
# When the sampling copy is written fused (`fuse_projections`) or merged (`merge_lora`).
COPY_CHOICES = ("auto", "always", "never")


@dataclasses.dataclass(frozen=True)
class SamplerMeshConfig:
  """Where each process keeps its sampling copy of the weights. tensor: the tensor-parallel
  size of the copy within one host (the host's other devices split the sampler's slots).
  param_dtype: "auto" (bfloat16 on accelerators, the training dtype on CPU), "float32" or
  "bfloat16". fuse_projections: "auto" writes each layer's q/k/v and gate/up projections as
  one matmul each (`model.fused_projections`), which the sampler reads faster, wherever the
  sync makes a copy (another dtype or sharding, several processes, merged adapters) and
  leaves them separate where the sampler shares the trainer's arrays; "always" makes a fused
  copy even there (a second copy of the weights, for a faster decode step); "never" keeps
  them separate. merge_lora (a model with LoRA adapters): the same choices for folding the
  adapters into the copy; unmerged adapters keep the projections separate, each with its
  adapter."""

  tensor: int = 1
  param_dtype: str = "auto"
  fuse_projections: str = "auto"
  merge_lora: str = "auto"

  def __post_init__(self):
    if self.tensor < 1:
      raise ValueError(f"tensor must be >= 1, got {self.tensor}")
    if self.param_dtype not in SAMPLING_DTYPES:
      raise ValueError(f"param_dtype={self.param_dtype!r}; expected one of {SAMPLING_DTYPES}")
    for key in ("fuse_projections", "merge_lora"):
      if getattr(self, key) not in COPY_CHOICES:
        raise ValueError(f"{key}={getattr(self, key)!r}; expected one of {COPY_CHOICES}")

  def mesh(self) -> shd.MeshConfig:
    return shd.MeshConfig(data=-1, fsdp=1, tensor=self.tensor)

  def check_host(self, local_devices: int, num_slots: int) -> None:
    """Raises ConfigError unless this mesh and a sampler of `num_slots` slots fit a host of
    `local_devices` devices."""
    if local_devices % self.tensor:
      raise ConfigError(f"config.sampler_mesh.tensor: {self.tensor} does not divide the "
                        f"{local_devices} devices of a host (the sampler's mesh is host-local)")
    slots_split = local_devices // self.tensor
    if num_slots % slots_split and num_slots > slots_split:
      raise ConfigError(f"config.engine.num_slots: {num_slots} slots do not split over the "
                        f"sampler's data axis ({slots_split} = a host's devices / "
                        f"sampler_mesh.tensor)")


# --- Weight sync ----------------------------------------------------------------------------


def sampling_dtype(name: str) -> jnp.dtype | None:
  """The sampling copy's dtype: "auto" is bfloat16 on accelerators and the training dtype on
  CPU (XLA:CPU has no fast bf16 matmul); "float32" / "bfloat16" force it."""
  if name == "auto":
    return None if jax.default_backend() == "cpu" else jnp.bfloat16
  return jnp.dtype(name)


class LayerwiseProgram:
  """`fn`, a pure function of a model's parameters that maps each decoder layer and each other
  top-level entry (the embedding, the final norm, the head) on its own (a cast, folded
  adapters, fused projections), run part by part as jitted programs whose outputs take
  `out_shardings`' shardings. A reshard of the whole model in one program gathers it at once:
  XLA planned 24 GiB of temporaries per device for the 7B's sync beside its 14 GiB copy
  (BENCHMARKS.md, "The weight sync, layer by layer"); part by part, the temporaries are one
  part's. Every layer runs one compiled program: inside it, each is layer 0.
  `donate`: each part's input buffers are given to its program (a copy that replaces them)."""

  def __init__(self, fn: Callable[[nnx.State], nnx.State], out_shardings: nnx.State,
               donate: bool = False):
    self._fn, self._out_shardings = fn, out_shardings
    by_kind = {key: shardings for key, _, shardings in _parts(out_shardings)}
    self._programs = {key: jax.jit(fn, out_shardings=shardings,
                                   donate_argnums=(0,) if donate else ())
                      for key, shardings in by_kind.items()}
    # The same, also given the part of the result's predecessor, whose buffers it takes.
    self._replacing = {key: jax.jit(lambda part, replaced: fn(part), out_shardings=shardings,
                                    donate_argnums=(1,), keep_unused=True)
                       for key, shardings in by_kind.items()}

  def __call__(self, state: nnx.State, replacing: nnx.State | None = None) -> nnx.State:
    """`fn(state)`. `replacing`: arrays laid out as the result (the copy it replaces), given
    up part by part to the part that replaces them, so that the two are never both whole in
    memory; they are deleted."""
    old = {} if replacing is None else {where: part for _, where, part in _parts(replacing)}
    done = []
    with warnings.catch_warnings():
      # A donated array that no output can reuse (q/k/v, fused into one) is freed all the same.
      warnings.filterwarnings("ignore", "Some donated buffers were not usable")
      for key, where, part in _parts(state):
        out = (self._programs[key](part) if replacing is None
               else self._replacing[key](part, old.pop(where)))
        done += _moved(nnx.to_flat_state(out), key, where)
    return nnx.from_flat_state(done)

  def lower(self, state: Any, whole: bool = False, replacing: Any = None) -> dict[str, Any]:
    """The lowered program of each kind of part of `state` (abstract arrays do), by the
    part's path ("layers/0"), for `memory_analysis()`, as `__call__` runs them with
    `replacing`; `whole`: `fn` as one program over all of `state` instead ("all"), what the
    split avoids (bench/weight_sync_memory.py)."""
    if whole:
      return {"all": jax.jit(self._fn, out_shardings=self._out_shardings).lower(state)}
    parts = {key: part for key, _, part in _parts(state)}  # one of each kind
    old = {} if replacing is None else {key: part for key, _, part in _parts(replacing)}
    return {"/".join(map(str, key)): (self._programs[key].lower(part) if replacing is None
                                      else self._replacing[key].lower(part, old[key]))
            for key, part in parts.items()}


def _parts(state: nnx.State) -> list[tuple[tuple, tuple, nnx.State]]:
  """`state` split into its layers and other top-level entries, in order: (the key of the
  part's program, where the part lives, the part). A layer's program key is ("layers", 0), and
  its part is moved there: every layer has the first one's structure."""
  groups: dict[tuple, list] = {}
  for path, var in nnx.to_flat_state(state):
    groups.setdefault(tuple(path[:2]) if path[0] == "layers" else tuple(path[:1]), []).append(
        (path, var))
  parts = []
  for where, flat in groups.items():
    key = ("layers", 0) if where[0] == "layers" else where
    parts.append((key, where, nnx.from_flat_state(_moved(flat, where, key))))
  return parts


def _moved(flat, old: tuple, new: tuple) -> list:
  """`flat`'s (path, value) pairs, their path prefix `old` replaced by `new`."""
  return [((*new, *path[len(old):]), var) for path, var in flat]


class WeightSync:
  """Turns the trainer's parameters (float, sharded over every process's devices) into this
  process's sampling copy (sampling dtype, sharded over its local mesh).

  A jitted reshard onto a mesh of shape [processes, *local mesh] whose spec leaves the
  process axis out: XLA gathers what each host lacks, in collective steps that every process
  runs (one per layer and per other part of the model: `LayerwiseProgram`), and each process
  keeps the shards that live on its own devices. With one process, a matching sharding and
  dtype, the parameters are handed over as they are (unless `config` asks for a merged or
  fused copy there too).

  LoRA: a merged copy holds the adapters folded into their kernels (`lora.fold_adapters`,
  rounded once to the sampling dtype), which the sampler reads faster than unmerged adapters;
  `config.merge_lora` says when (see `model.lora`). Fused projections
  (`config.fuse_projections`) are written after folding. `sampling_model` gives the sampler's
  model, whatever its copy's layout.
  """

  def __init__(self, model: nnx.Module, config: SamplerMeshConfig = SamplerMeshConfig(),
               rules: shd.ShardingRules = shd.ShardingRules()):
    mesh_config = config.mesh()
    local = jax.local_device_count()
    if local % config.tensor:
      raise ValueError(f"sampler_mesh.tensor={config.tensor} does not divide this host's "
                       f"{local} devices")
    self.mesh = local_mesh(mesh_config)
    self.dtype = sampling_dtype(config.param_dtype)
    params, lora_config = nnx.state(model), model.config.lora
    self.local_shardings = shd.state_shardings(params, self.mesh, rules)
    copies = jax.process_count() > 1 or not self._is_local_copy(params)
    wants = lambda choice, copied: choice == "always" or choice == "auto" and copied
    self.folds_adapters = lora_config.enabled and wants(
        config.merge_lora, copies or config.fuse_projections == "always")
    # Unmerged adapters act on each projection by itself.
    self.fuses = (not lora_config.enabled or self.folds_adapters) and wants(
        config.fuse_projections, copies or self.folds_adapters)
    self._sampling_config = model.config.replace(
        lora=lora.LoraConfig() if self.folds_adapters else lora_config,
        fused_projections=self.fuses)
    self._fold = functools.partial(lora.fold_adapters, scale=lora_config.scale,
                                   dtype=self.dtype) if self.folds_adapters else None
    self._copy = jax.eval_shape(self._cast, params)  # the copy's structure, shapes, dtypes
    if self.folds_adapters or self.fuses:
      self.local_shardings = shd.state_shardings(self._copy, self.mesh, rules)
    grids = host_grids(mesh_config)
    self._sync_mesh = Mesh(grids, ("process", *shd.MESH_AXES),
                           axis_types=(jax.sharding.AxisType.Auto,) * 4)
    self._sync_shardings = jax.tree.map(
        lambda s: NamedSharding(self._sync_mesh, PartitionSpec(*s.spec)),
        self.local_shardings)
    self.reshard = LayerwiseProgram(self._cast, self._sync_shardings)

  def _cast(self, params: nnx.State) -> nnx.State:
    if self.folds_adapters:
      params = self._fold(params)
    if self.dtype is not None:
      params = jax.tree.map(lambda x: x.astype(self.dtype)
                            if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    if self.fuses:
      params = fused_projections.fuse(params, self._sampling_config.replace(
          fused_projections=False))
    return params

  def __call__(self, params: nnx.State, replacing: nnx.State | None = None) -> nnx.State:
    """This process's copy of `params`. `replacing`: the copy it replaces (the sampler's),
    whose memory the new one takes over part by part (`LayerwiseProgram`): its arrays are
    deleted, and a sync never holds two whole copies. Kept where the new copy is `params`
    itself (shared with the trainer) or where it is laid out otherwise."""
    if (not self.folds_adapters and not self.fuses and jax.process_count() == 1
        and self._is_local_copy(params)):
      return params
    if replacing is not None and self._is_copy(replacing, params):
      replacing = jax.tree.map(self._rewrapped, replacing, self._sync_shardings)
    else:
      replacing = None
    synced = self.reshard(params, replacing=replacing)
    return jax.tree.map(self._rewrapped, synced, self.local_shardings)

  def sampling_model(self, model: nnx.Module) -> nnx.Module:
    """The sampler's model: `model` in this copy's layout (adapters folded, projections fused
    where the copy does that) over this process's copy of its weights."""
    graphdef = (nnx.graphdef(abstract_model(self._sampling_config))
                if self.folds_adapters or self.fuses else nnx.graphdef(model))
    return nnx.merge(graphdef, self(nnx.state(model)))

  def _is_local_copy(self, params: nnx.State) -> bool:
    leaves, targets = jax.tree.leaves(params), jax.tree.leaves(self.local_shardings)
    return all((self.dtype is None or x.dtype == self.dtype) and self._placed_as(x, t)
               for x, t in zip(leaves, targets))

  def _is_copy(self, tree: nnx.State, params: nnx.State) -> bool:
    """Whether `tree` is laid out as this sync's copy (structure, shapes, dtypes, shardings)
    and shares no array with `params`."""
    if jax.tree.structure(tree) != jax.tree.structure(self._copy):
      return False
    theirs = {id(x) for x in jax.tree.leaves(params)}
    return all(id(x) not in theirs and (x.shape, x.dtype) == (w.shape, w.dtype)
               and self._placed_as(x, t)
               for x, w, t in zip(jax.tree.leaves(tree), jax.tree.leaves(self._copy),
                                  jax.tree.leaves(self.local_shardings)))

  def _placed_as(self, x: jax.Array, target: NamedSharding) -> bool:
    return (isinstance(x.sharding, NamedSharding) and x.sharding.spec == target.spec
            and x.sharding.mesh.devices.tolist() == self.mesh.devices.tolist())

  @staticmethod
  def _rewrapped(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """The shards of `x` on this process's devices as an array of `sharding`: the local
    mesh's (this process's part of a global array) or the sync mesh's (the reverse)."""
    shards = [s.data for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)

  def check_copies_agree(self, copy: nnx.State) -> None:
    """Raises unless every process's sampling copy holds the same values (a fingerprint of
    each array, gathered), e.g. after the sync of every step."""
    if jax.process_count() == 1:
      return
    fingerprint = np.asarray([float(jnp.sum(x.astype(jnp.float32)))
                              for x in jax.tree.leaves(copy)], np.float64)
    every = allgather(fingerprint)
    if not (every == every[0]).all():
      raise RuntimeError("the processes' sampling copies of the weights differ after the "
                         "weight sync: the processes have diverged")


def load_sampling_model(spec: loader.ModelSpec, config: SamplerMeshConfig, num_slots: int,
                        rules: shd.ShardingRules = shd.ShardingRules()
                        ) -> tuple[nnx.Module, Mesh]:
  """(model, mesh): `spec`'s model (a checkpoint, or a preset initialised) as this process
  samples it where no trainer holds the weights (evaluation, generation). It is loaded
  straight onto a mesh of the process's devices, each tensor sharded over `config.tensor`
  devices as it is read (a model larger than one device loads), in the sampling dtype, with
  its q/k/v and gate/up projections fused unless `config.fuse_projections` is "never" (the
  separate arrays are dropped: no second copy stays). Adapters (`spec.lora_rank`) stay
  unmerged. The mesh holds one copy per slot of the sampler (`num_slots`) at most: a
  generation of one sequence takes `config.tensor` devices, not one copy per device group."""
  devices = _process_devices(jax.process_index())
  config.check_host(len(devices), num_slots)
  data = min(len(devices) // config.tensor, num_slots)
  mesh = shd.make_mesh(shd.MeshConfig(data=data, fsdp=1, tensor=config.tensor),
                       devices[:data * config.tensor])
  dtype = sampling_dtype(config.param_dtype)
  if dtype is not None:
    spec = dataclasses.replace(spec, param_dtype=jnp.dtype(dtype).name)
  model = loader.build_model(spec, mesh=mesh, rules=rules)
  if model.config.lora.enabled or config.fuse_projections == "never":
    return model, mesh
  fuse = functools.partial(fused_projections.fuse, config=model.config)
  graphdef = nnx.graphdef(abstract_model(model.config.replace(fused_projections=True)))
  unfused = nnx.state(model)
  del model
  shardings = shd.state_shardings(jax.eval_shape(fuse, unfused), mesh, rules)
  fused = LayerwiseProgram(fuse, shardings, donate=True)(unfused)
  return nnx.merge(graphdef, fused), mesh


# --- Global batches -------------------------------------------------------------------------


def make_global(local: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """A global array from each process's part of it (rows of the process's devices)."""
  if jax.process_count() == 1:
    return jax.device_put(local, sharding)
  return jax.make_array_from_process_local_data(sharding, local)


def local_part(x: jax.Array) -> np.ndarray:
  """This process's part of a global array, as `make_global` took it (host copy)."""
  if jax.process_count() == 1 or x.is_fully_addressable:
    return np.asarray(x)
  return np.asarray(multihost_utils.global_array_to_host_local_array(
      x, x.sharding.mesh, x.sharding.spec))


def check_batch_split(mesh: Mesh, batch_axes: Sequence[str]) -> None:
  """Each process must own distinct rows of the global batch: the mesh axes that split rows
  must be a multiple of the process count, with processes outermost."""
  count = jax.process_count()
  rows_split = math.prod(mesh.shape[a] for a in batch_axes)
  if count > 1 and rows_split % count:
    raise ValueError(
        f"{count} processes cannot each own rows of the train batch: its rows split over the "
        f"mesh axes {tuple(batch_axes)} of size {rows_split}, which is not a multiple of "
        f"{count}. Put the devices of different hosts on the data or fsdp axis "
        f"(e.g. --config.mesh.tensor=<devices per host or fewer>).")
