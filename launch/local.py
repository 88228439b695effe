"""Launch on this machine: one process on its local devices, or N processes that form one
multi-process JAX run (how to try a multi-host run on one machine).

  python launch/local.py --config=configs/sage.py:demo --workdir=runs/demo [--cpu_devices=8]
      [--gpus=0,1] [--override=grpo.group_size=4 ...] [--module=sage_jax.evaluate]
      [--dry_run]
  python launch/local.py --num_processes=2 --module=sage_jax.export --workdir=runs/demo \
      --flag=out=runs/demo_hf        # an entry point's own flags: --flag=NAME=VALUE
  python launch/local.py --num_processes=2 --cpu_devices=2 --config=configs/sage.py:demo \\
      --workdir=runs/demo2
  python launch/local.py --num_processes=2 --cpu_devices=2 -- python -m sage_jax.generate ...

With --num_processes=N, process i gets JAX_COORDINATOR_ADDRESS (127.0.0.1 and a free port),
JAX_NUM_PROCESSES=N and JAX_PROCESS_ID=i, which `multihost.initialize()` in every entry
point reads; with --cpu_devices=D each simulates D CPU devices and collectives go over gloo.
With --gpus=0,1,2,3 each process gets its own contiguous share (CUDA_VISIBLE_DEVICES=0,1 and
2,3 for N=2); without it, N processes share out the GPUs this launcher sees (those
CUDA_VISIBLE_DEVICES lists, else every GPU that nvidia-smi lists), since each would otherwise
drive them all.
Process 0 prints to this terminal, process i > 0 to <workdir>/logs/process_<i>.log (./logs/
for a remote workdir such as gs://bucket/run). A
SIGTERM or SIGINT here (Ctrl-C) is passed to every process once (they save one checkpoint
and stop together; a second Ctrl-C stops them at once); a hangup is passed on too. When one
process fails, the others are stopped and its exit code is returned.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app, flags

FLAGS = flags.FLAGS

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch import common  # noqa: E402
from sage_jax import storage  # noqa: E402

# Seconds the other processes get to exit on their own after one has failed.
FAILURE_GRACE_S = 30.0


def build(config, workdir, overrides, module="sage_jax.train", cpu_devices=0, gpus=None,
          entry_flags=()):
  """(environment additions, argv) for one local run; `entry_flags`: the entry point's own."""
  return device_env(cpu_devices, gpus), common.entry_command(
      config, workdir, overrides, module=module, python=sys.executable,
      entry_flags=entry_flags)


def device_env(cpu_devices: int = 0, gpus: str | None = None) -> dict[str, str]:
  env = {}
  if cpu_devices:
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={cpu_devices}"
    env["JAX_PLATFORMS"] = "cpu"
  if gpus is not None:
    env["CUDA_VISIBLE_DEVICES"] = gpus
  return env


def process_envs(num_processes: int, port: int, base: dict[str, str],
                 machine_gpus: tuple[str, str] | None = None) -> list[dict[str, str]]:
  """The environment additions of each process of a multi-process run. The GPUs listed in
  `base` (CUDA_VISIBLE_DEVICES, from --gpus), else `machine_gpus` (where that list came from,
  the list), are split into contiguous shares, one per process: each process drives every GPU
  it sees, and jax.distributed takes the processes' devices to be disjoint."""
  if "CUDA_VISIBLE_DEVICES" in base:
    gpus = gpu_shares(base["CUDA_VISIBLE_DEVICES"], num_processes)
  else:
    gpus = gpu_shares(machine_gpus[1], num_processes, machine_gpus[0]) if machine_gpus else None
  return [{**base, **({"CUDA_VISIBLE_DEVICES": gpus[i]} if gpus else {}),
           "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
           "JAX_NUM_PROCESSES": str(num_processes), "JAX_PROCESS_ID": str(i)}
          for i in range(num_processes)]


def gpu_shares(gpus: str | None, num_processes: int,
               source: str = "--gpus") -> list[str] | None:
  """The GPUs "0,1,2,3" over 2 processes: ["0,1", "2,3"]; None when none is listed. Raises
  ValueError when the GPUs do not split evenly (the processes' shards would differ), naming
  where the list came from (`source`)."""
  ids = [g.strip() for g in (gpus or "").split(",") if g.strip()]
  if not ids:
    return None
  if len(ids) % num_processes:
    raise ValueError(f"{source}={gpus}: {len(ids)} GPUs do not split evenly over "
                     f"--num_processes={num_processes}"
                     + ("" if source == "--gpus" else "; list the ones to use with --gpus"))
  per_process = len(ids) // num_processes
  return [",".join(ids[i * per_process:(i + 1) * per_process]) for i in range(num_processes)]


def machine_gpus() -> tuple[str, str] | None:
  """(where the list came from, "0,1,...") for the GPUs a process started here would see:
  CUDA_VISIBLE_DEVICES's, else nvidia-smi's; None without either."""
  listed = os.environ.get("CUDA_VISIBLE_DEVICES")
  if listed is not None:
    return "CUDA_VISIBLE_DEVICES", listed
  try:
    found = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=60, check=True).stdout
  except (OSError, subprocess.SubprocessError):  # no NVIDIA driver here
    return None
  ids = [line.strip() for line in found.splitlines() if line.strip()]
  return ("the GPUs nvidia-smi lists", ",".join(ids)) if ids else None


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def exit_status(returncode: int) -> int:
  """A process's status as a shell reports it: 128 + N for one that signal N ended."""
  return 128 - returncode if returncode < 0 else returncode


def run_processes(cmd: list[str], envs: list[dict[str, str]], log_dir: str) -> int:
  """Starts one process per environment and waits for all; returns the exit status
  (`exit_status`) of the process that failed first, 0 if all succeed. The others get
  `FAILURE_GRACE_S` to fail or finish on their own (a collective with the failed one raises
  in them), then the launcher kills them. Which process failed first is the order in which
  they ended: a thread waits on each."""
  procs = []
  for i, env in enumerate(envs):
    if i:
      os.makedirs(log_dir, exist_ok=True)
    out = None if i == 0 else open(os.path.join(log_dir, f"process_{i}.log"), "w")
    # Each in its own process group: a terminal's Ctrl-C reaches the processes only through
    # `forward`, once (also delivered directly, it would be the second signal, which gives up
    # the graceful stop).
    procs.append(subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out,
                                  stderr=subprocess.STDOUT if out else None, process_group=0))
    print(f"launch: process {i} pid {procs[-1].pid}", flush=True)
  ended: queue.SimpleQueue[int] = queue.SimpleQueue()  # process indices, as they end
  for i, p in enumerate(procs):
    threading.Thread(target=lambda i=i, p=p: (p.wait(), ended.put(i)), daemon=True,
                     name=f"launch-wait-{i}").start()

  def forward(signum, frame):
    del frame
    for p in procs:
      if p.returncode is None:
        p.send_signal(signum)

  previous = {s: signal.signal(s, forward)
              for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
  first_failed, failed_at, killed, running = None, 0.0, set(), len(procs)
  try:
    while running:
      try:
        i = ended.get(timeout=0.2)
        running -= 1
        if first_failed is None and procs[i].returncode:
          first_failed, failed_at = i, time.monotonic()
      except queue.Empty:
        pass
      if first_failed is not None and time.monotonic() - failed_at > FAILURE_GRACE_S:
        for i, p in enumerate(procs):
          if p.returncode is None and i not in killed:
            p.kill()
            killed.add(i)
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  for i, p in enumerate(procs):
    if not p.returncode:
      continue
    if i in killed:
      how = (f"was stopped by the launcher, {FAILURE_GRACE_S:.0f} s after process "
             f"{first_failed} failed")
    else:
      how = (f"exited with {exit_status(p.returncode)}"
             + (f" (signal {-p.returncode})" if p.returncode < 0 else "")
             + (", the first to fail" if i == first_failed and len(procs) > 1 else ""))
    print(f"launch: process {i} {how}"
          + (f" (log: {os.path.join(log_dir, f'process_{i}.log')})" if i else ""),
          file=sys.stderr)
  return 0 if first_failed is None else exit_status(procs[first_failed].returncode)


def main(argv):
  command = argv[1:]
  env = device_env(FLAGS.cpu_devices, FLAGS.gpus)
  if command:
    cmd = command
  else:
    try:
      cmd = common.entry_command(FLAGS.config, FLAGS.workdir,
                                 common.parse_overrides(FLAGS.override), FLAGS.module,
                                 python=sys.executable,
                                 entry_flags=common.parse_entry_flags(FLAGS.flag))
    except ValueError as e:
      raise app.UsageError(f"{e} (or give a whole command after --)") from None
    common.check_or_exit(FLAGS.module, cmd[3:])
  if FLAGS.num_processes < 1:
    raise app.UsageError(f"--num_processes must be >= 1, got {FLAGS.num_processes}")
  try:
    envs = ([env] if FLAGS.num_processes == 1 else
            process_envs(FLAGS.num_processes, FLAGS.port or free_port(), env,
                         None if FLAGS.cpu_devices or FLAGS.gpus else machine_gpus()))
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  if FLAGS.dry_run:
    print(common.show([(["env", *(f"{k}={v}" for k, v in e.items())] if e else []) + cmd
                       for e in envs]))
    return
  log_dir = storage.local_subdir(FLAGS.workdir or ".", "logs") or "logs"
  raise SystemExit(run_processes(cmd, envs, log_dir))


def define_flags():
  flags.DEFINE_string("config", None, "configs/<file>.py:<preset>")
  flags.DEFINE_string("workdir", None, "Run directory.")
  flags.DEFINE_string("module", "sage_jax.train", "Entry point module.")
  flags.DEFINE_multi_string("override", [], "KEY=VALUE config overrides.")
  flags.DEFINE_multi_string("flag", [], "NAME=VALUE: a flag of the entry point's own "
                            "(export's out, evaluate's run and step).")
  flags.DEFINE_integer("num_processes", 1, "JAX processes to start on this machine.")
  flags.DEFINE_integer("port", 0, "Coordinator port of a multi-process run (0: a free one).")
  flags.DEFINE_integer("cpu_devices", 0, "Simulate this many CPU devices (per process).")
  flags.DEFINE_string("gpus", None, "Comma-separated visible GPU ids, split evenly over the "
                      "processes (default: the GPUs this launcher sees).")
  flags.DEFINE_bool("dry_run", False, "Print the command(s) instead of running them.")


if __name__ == "__main__":
  define_flags()
  app.run(main)
