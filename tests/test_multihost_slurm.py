"""Joining a run under SLURM, as launch/slurm.sbatch starts it (our JAX_* variables) and as a
bare `srun` does (JAX's SLURM detection): with one task per node, each process drives every
GPU of its node, not GPU <SLURM_LOCALID> alone. Two CPU processes on this machine stand for
two nodes; the GPUs a process would drive are JAX's `jax_cuda_visible_devices`."""

import os
import random
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """
import jax
from jax._src import xla_bridge
from sage_jax import multihost
multihost.initialize()
print("visible", jax.process_index(), jax.process_count(), xla_bridge.CUDA_VISIBLE_DEVICES.value)
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run(per_process_env):
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("SLURM_", "JAX_", "TPU_", "MEGASCALE_", "CUDA_"))}
  env.pop("XLA_FLAGS", None)
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  procs = [subprocess.Popen([sys.executable, "-c", CHILD], env={**env, **extra}, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for extra in per_process_env]
  outputs = [p.communicate(timeout=300)[0] for p in procs]
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]
  return sorted(line.split()[1:] for out in outputs for line in out.splitlines()
                if line.startswith("visible "))


def _slurm(task: int, job_id: int, visible: str = "0,1,2,3") -> dict[str, str]:
  """What `srun -N2 --ntasks-per-node=1` sets in task `task`, inside a 4-node allocation."""
  return {"SLURM_JOB_ID": str(job_id), "SLURM_STEP_NODELIST": "localhost",
          "SLURM_JOB_NODELIST": "localhost", "SLURM_NTASKS": "2", "SLURM_NNODES": "2",
          "SLURM_STEP_NUM_NODES": "2", "SLURM_JOB_NUM_NODES": "4", "SLURM_PROCID": str(task),
          "SLURM_LOCALID": "0", "SLURM_NODEID": str(task), "CUDA_VISIBLE_DEVICES": visible}


def test_slurm_sbatch_tasks_drive_every_gpu_of_their_node():
  port = _free_port()
  job = random.randrange(10_000, 1_000_000)
  ours = [{**_slurm(i, job), "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
           "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)} for i in (0, 1)]
  # The launcher's variables name every process; JAX's default then shows every device.
  assert _run(ours) == [["0", "2", "all"], ["1", "2", "all"]]


@pytest.mark.parametrize("visible", ["0,1,2,3", "4,5"])
def test_bare_srun_tasks_alone_on_their_node_drive_every_gpu_of_it(visible):
  # JAX's SLURM detection takes the coordinator port from the job id.
  job = random.randrange(10_000, 1_000_000)
  count = len(visible.split(","))
  expected = ",".join(map(str, range(count)))
  assert _run([_slurm(i, job, visible) for i in (0, 1)]) == [
      ["0", "2", expected], ["1", "2", expected]]


def _one_node(task: int, job_id: int, visible: str) -> dict[str, str]:
  """What `srun -N1 --ntasks=2` sets in task `task` (both on one node)."""
  return {**_slurm(task, job_id, visible), "SLURM_NNODES": "1", "SLURM_STEP_NUM_NODES": "1",
          "SLURM_NODEID": "0", "SLURM_LOCALID": str(task)}


def test_tasks_sharing_a_node_take_one_gpu_each_or_the_gpus_slurm_gave_them():
  job = random.randrange(10_000, 1_000_000)
  # Every task sees the node's GPUs: JAX's choice, GPU <SLURM_LOCALID>.
  assert _run([_one_node(i, job, "0,1") for i in (0, 1)]) == [["0", "2", "0"], ["1", "2", "1"]]
  # --gpus-per-task=1 (or --gpu-bind): each sees its own GPU alone, as device 0.
  job = random.randrange(10_000, 1_000_000)
  assert _run([_one_node(i, job, str(4 + i)) for i in (0, 1)]) == [
      ["0", "2", "0"], ["1", "2", "0"]]
  job = random.randrange(10_000, 1_000_000)
  bound = [{**_one_node(i, job, ("0,1", "2,3")[i]), "SLURM_GPUS_PER_TASK": "2"} for i in (0, 1)]
  assert _run(bound) == [["0", "2", "0,1"], ["1", "2", "0,1"]]
  # --gpus-per-task with --gpu-bind=none: every task sees the node's GPUs, JAX's choice.
  job = random.randrange(10_000, 1_000_000)
  shared = [{**_one_node(i, job, "0,1,2,3"), "SLURM_GPUS_PER_TASK": "2"} for i in (0, 1)]
  assert _run(shared) == [["0", "2", "0"], ["1", "2", "1"]]


def test_a_batch_scripts_own_shell_runs_one_process():
  """sbatch's shell holds the allocation's SLURM_NTASKS but no srun step: a command it runs
  directly is one process, not a task waiting for peers that never start."""
  shell = {k: v for k, v in _slurm(0, random.randrange(10_000, 1_000_000)).items()
           if not k.startswith("SLURM_STEP_")}
  assert _run([shell]) == [["0", "1", "all"]]
