r"""Benchmarks the AppWorld environment pool on the mini world; prints JSON.

  python bench/envpool.py [--calls=200] [--repeats=2] [--only_calls]

Measures, in one run: gold-solution episodes per second (start, execute, evaluate, close)
with 1 and 2 workers; the CPU time of a gold episode through the pool (user and system time
of the workers and the processes they fork) against the same start, execute and evaluate on
an in-process AppWorld; the start of a pool of 1 and of --start_workers workers (wall time,
and CPU time of all its processes: the template's spawn, imports, data check and warm-up
world, then one fork per worker); and the per-call cost of `execute` through the pool
against the same call made directly on an in-process AppWorld (in a child process, since
this one must not import appworld). --only_calls times that per-call cost alone: a 1-worker
pool's calls, then the direct calls right after, so that two commits can be alternated.
"""

import asyncio
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

from sage_jax.envs import appworld

_CALLS = flags.DEFINE_integer("calls", 200, "execute calls timed for the per-call overhead.")
_REPEATS = flags.DEFINE_integer("repeats", 2, "passes over all tasks per worker count.")
_ONLY_CALLS = flags.DEFINE_bool("only_calls", False, "time the per-call cost of execute alone.")
_START_WORKERS = flags.DEFINE_integer("start_workers", 8, "workers of the larger pool whose "
                                      "start is timed against a 1-worker pool's.")

CALL_CODE = "x = 1"

# Times `calls` executions on a direct in-process AppWorld. AppWorld freezes time.time,
# perf_counter and monotonic while a world is open; clock_gettime is left alone.
DIRECT = """
import json, sys, time
from appworld import AppWorld
task_id, calls, code = sys.argv[1], int(sys.argv[2]), sys.argv[3]
clock = lambda: time.clock_gettime(time.CLOCK_MONOTONIC)
samples = []
with AppWorld(task_id=task_id, experiment_name="bench_direct", max_interactions=calls + 10) as w:
    w.execute(code)
    for _ in range(calls):
        start = clock()
        w.execute(code)
        samples.append(clock() - start)
sys.__stdout__.write("DIRECT" + json.dumps(samples))
"""

# CPU seconds (user, system) per gold episode on a direct in-process AppWorld: each task's
# world opened, its gold solution executed, the world evaluated; after one pass over the
# tasks that warms the process, as a pool's workers are warm.
DIRECT_EPISODES = """
import contextlib, io, json, os, resource, sys
from appworld import AppWorld
root, task_ids = sys.argv[1], sys.argv[2:]
def gold(t):
    with open(os.path.join(root, "data", "tasks", t, "ground_truth", "solution.py")) as f:
        return f.read()
def play(experiment):
    for t in task_ids:
        with contextlib.redirect_stdout(io.StringIO()):
            world = AppWorld(task_id=t, experiment_name=experiment)
            world.execute(gold(t))
            world.close()
            if not world.evaluate(suppress_errors=True).success:
                raise RuntimeError(t + ": the gold solution failed")
play("bench_direct_warm")
before = resource.getrusage(resource.RUSAGE_SELF)
play("bench_direct")
after = resource.getrusage(resource.RUSAGE_SELF)
n = len(task_ids)
sys.__stdout__.write("DIRECT" + json.dumps([(after.ru_utime - before.ru_utime) / n,
                                            (after.ru_stime - before.ru_stime) / n]))
"""


def _config(root: str, outputs: str, workers: int, calls: int) -> appworld.EnvPoolConfig:
  return appworld.EnvPoolConfig(num_workers=workers, appworld_root=root, outputs_root=outputs,
                                max_interactions=calls + 10, keep_outputs=False)


def _gold(root: str, task_id: str) -> str:
  with open(os.path.join(root, "data", "tasks", task_id, "ground_truth", "solution.py")) as f:
    return f.read()


def _episodes_per_second(pool, root: str, task_ids: list[str], repeats: int) -> dict:
  async def one(task_id: str, experiment: str):
    async with pool.episode(task_id, experiment) as ep:
      await ep.execute(_gold(root, task_id))
      await ep.evaluate()
    return ep.result

  async def run(experiment: str):
    return await asyncio.gather(*(one(t, experiment) for t in task_ids))

  start = time.perf_counter()
  results = [r for i in range(repeats) for r in asyncio.run(run(f"bench_{i}"))]
  elapsed = time.perf_counter() - start
  if not all(r.success for r in results):
    raise RuntimeError(f"gold episodes failed: {[r for r in results if not r.success]}")
  return {"episodes": len(results), "seconds": round(elapsed, 2),
          "episodes_per_s": round(len(results) / elapsed, 2)}


def _workers_cpu() -> tuple[float, float]:
  """(user, system) CPU seconds of this process's pool templates and their workers, with
  the episode and evaluation processes the workers have reaped."""
  tick = os.sysconf("SC_CLK_TCK")
  stats = {}  # pid -> (parent, user ticks, system ticks) of pool processes
  for name in os.listdir("/proc"):
    try:
      with open(f"/proc/{name}/cmdline", "rb") as f:
        if b"sage_jax.envs.appworld.worker" not in f.read():
          continue
      with open(f"/proc/{name}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    except (OSError, ValueError):
      continue  # not a process, or gone meanwhile
    # ppid; utime + cutime; stime + cstime
    stats[int(name)] = (int(fields[1]), int(fields[11]) + int(fields[13]),
                        int(fields[12]) + int(fields[14]))
  templates = {pid for pid, (parent, _, _) in stats.items() if parent == os.getpid()}
  ours = [v for pid, v in stats.items() if pid in templates or v[0] in templates]
  return sum(v[1] for v in ours) / tick, sum(v[2] for v in ours) / tick


def _episode_cpu(pool, root: str, task_ids: list[str], outputs: str) -> dict:
  """CPU seconds per gold episode through `pool`, whose workers have played the tasks
  already (warm), and on a direct in-process AppWorld (a child process, warmed by a pass of
  its own), user and system time apart."""
  before = _workers_cpu()
  _episodes_per_second(pool, root, task_ids, 1)
  after = _workers_cpu()
  pool_user, pool_system = ((a - b) / len(task_ids) for a, b in zip(after, before))
  done = subprocess.run([sys.executable, "-c", DIRECT_EPISODES, root, *task_ids],
                        capture_output=True, text=True, check=True,
                        env=dict(os.environ, APPWORLD_ROOT=outputs))
  direct_user, direct_system = json.loads(done.stdout.rpartition("DIRECT")[2])
  pool_s, direct_s = pool_user + pool_system, direct_user + direct_system
  return {"episodes": len(task_ids),
          "pool_user_s": round(pool_user, 3), "pool_system_s": round(pool_system, 3),
          "direct_user_s": round(direct_user, 3), "direct_system_s": round(direct_system, 3),
          "pool_over_direct": round(pool_s / direct_s, 2)}


def _pool_start(root: str, outputs: str, workers: int) -> dict:
  """Wall seconds until the pool serves, and CPU seconds of its processes (counted once
  the pool has closed and its processes are reaped)."""
  cpu = lambda: (lambda r: r.ru_utime + r.ru_stime)(resource.getrusage(resource.RUSAGE_CHILDREN))
  cpu_before, start = cpu(), time.perf_counter()
  with appworld.EnvPool(_config(root, outputs, workers, 1)):
    wall = time.perf_counter() - start
  return {"workers": workers, "wall_s": round(wall, 2), "cpu_s": round(cpu() - cpu_before, 2)}


def _pool_call_seconds(pool, task_id: str, calls: int) -> list[float]:
  samples = []
  with pool.episode(task_id, "bench_calls") as ep:
    ep.execute(CALL_CODE).result()
    for _ in range(calls):
      start = time.perf_counter()
      ep.execute(CALL_CODE).result()
      samples.append(time.perf_counter() - start)
  return samples


def _direct_call_seconds(outputs: str, task_id: str, calls: int) -> list[float]:
  done = subprocess.run([sys.executable, "-c", DIRECT, task_id, str(calls), CALL_CODE],
                        capture_output=True, text=True, check=True,
                        env=dict(os.environ, APPWORLD_ROOT=outputs))
  return json.loads(done.stdout.rpartition("DIRECT")[2])


def main(argv) -> None:
  del argv
  root = appworld.ensure_mini_world()
  task_ids = [t for s in ("train", "dev", "test") for t in appworld.read_split(root, s)]
  outputs = tempfile.mkdtemp(prefix="envpool_bench_")
  report = {
    "command": "python bench/envpool.py " + " ".join(sys.argv[1:]),
    "machine": f"{os.cpu_count()}-core CPU, {platform.processor() or platform.machine()}",
    "tasks": len(task_ids),
  }
  try:
    if _ONLY_CALLS.value:
      with appworld.EnvPool(_config(root, outputs, 1, _CALLS.value)) as pool:
        pool_calls = _pool_call_seconds(pool, task_ids[0], _CALLS.value)
      report["execute_call"] = _call_report(pool_calls, outputs, task_ids[0])
    else:
      for workers in (1, 2):
        start = time.perf_counter()
        with appworld.EnvPool(_config(root, outputs, workers, _CALLS.value)) as pool:
          started = time.perf_counter() - start
          entry = _episodes_per_second(pool, root, task_ids, _REPEATS.value)
          entry["pool_start_s"] = round(started, 2)
          if workers == 1:
            pool_calls = _pool_call_seconds(pool, task_ids[0], _CALLS.value)
            report["episode_cpu"] = _episode_cpu(pool, root, task_ids, outputs)
        report[f"workers_{workers}"] = entry
      report["speedup_2_vs_1"] = round(report["workers_2"]["episodes_per_s"]
                                       / report["workers_1"]["episodes_per_s"], 2)
      small, large = (_pool_start(root, outputs, n) for n in (1, _START_WORKERS.value))
      report["pool_start"] = {"small": small, "large": large,
                              "wall_large_over_small": round(large["wall_s"] / small["wall_s"], 2),
                              "cpu_large_over_small": round(large["cpu_s"] / small["cpu_s"], 2)}
      report["execute_call"] = _call_report(pool_calls, outputs, task_ids[0])
  finally:
    report["load_average_1m"] = os.getloadavg()[0]
    shutil.rmtree(outputs, ignore_errors=True)
  print(json.dumps(report, indent=2))


def _call_report(pool_calls: list[float], outputs: str, task_id: str) -> dict:
  """The pool's per-call medians against direct calls timed now."""
  direct_calls = _direct_call_seconds(outputs, task_id, _CALLS.value)
  pool_ms = 1000 * statistics.median(pool_calls)
  direct_ms = 1000 * statistics.median(direct_calls)
  return {"code": CALL_CODE, "calls": _CALLS.value,
          "pool_median_ms": round(pool_ms, 3), "direct_median_ms": round(direct_ms, 3),
          "overhead_ms": round(pool_ms - direct_ms, 3),
          "pool_over_direct": round(pool_ms / direct_ms, 3)}


if __name__ == "__main__":
  app.run(main)
