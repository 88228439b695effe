r"""Benchmarks multi-process runs on one machine; prints JSON.

  python bench/multihost.py [--devices=4] [--rl_steps=4] [--sync_repeats=5]

Two measurements, each taken as 1 process x D devices and as 2 processes x D/2 devices
(`launch/local.py`, CPU collectives over gloo) in the same run, with their ratio:

- the demo's SAGE step time (`time/step_s` of the steps after the first, which compiles),
  on the same global work: the same chains, group size and batch, split over the processes;
- the weight sync of the Qwen2.5-0.5B architecture (random float32 weights, fsdp over every
  device) into each process's bfloat16 sampling copy, timed after one warm-up call.

On one machine both processes share the same cores, so the 2-process times measure the
protocol's overhead (collectives over loopback, the agreed batch layout), not a speed-up.
"""

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

_DEVICES = flags.DEFINE_integer("devices", 4, "Simulated CPU devices in all.")
_RL_STEPS = flags.DEFINE_integer("rl_steps", 4, "SAGE steps of each demo run.")
_SYNC_REPEATS = flags.DEFINE_integer("sync_repeats", 5, "Timed weight syncs.")
_SYNC_CHILD = flags.DEFINE_string("sync_child", "", "Internal: time the sync, write to FILE.")


def _launch(processes: int, devices: int, workdir: str, command: list[str]) -> None:
  argv = [sys.executable, os.path.join(REPO, "launch", "local.py"),
          f"--num_processes={processes}", f"--cpu_devices={devices // processes}",
          f"--workdir={workdir}", "--", *command]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = REPO
  done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
  if done.returncode:
    raise RuntimeError(f"{argv} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def demo_step(processes: int, devices: int) -> dict:
  workdir = tempfile.mkdtemp(prefix="bench_multihost_")
  _launch(processes, devices, workdir, [
      sys.executable, "-m", "sage_jax.train", "--config=configs/sage.py:demo",
      f"--workdir={workdir}", "--config.sft.total_steps=1",
      f"--config.rl.total_steps={_RL_STEPS.value}", "--config.grpo.max_redraws=0",
      "--config.pipeline.eval_before=False",
      "--config.pipeline.eval_after=False", "--config.pipeline.export=False",
      "--config.pipeline.plot=False"])
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f][1:]
  return {"step_s": statistics.mean(r["time/step_s"] for r in rows),
          "sync_s": statistics.mean(r["time/sync_s"] for r in rows),
          "episodes_per_step": rows[0]["episodes"], "steps_timed": len(rows)}


def weight_sync(processes: int, devices: int) -> dict:
  out = tempfile.mktemp(prefix="bench_sync_", suffix=".json")
  _launch(processes, devices, tempfile.mkdtemp(prefix="bench_sync_"),
          [sys.executable, os.path.abspath(__file__), f"--sync_child={out}",
           f"--sync_repeats={_SYNC_REPEATS.value}"])
  with open(out) as f:
    return json.load(f)


def _time_sync(out: str) -> None:
  """Runs in each launched process: one warm-up sync, then the timed ones."""
  from sage_jax import multihost  # noqa: PLC0415

  multihost.initialize()
  import jax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from sage_jax import sharding as shd  # noqa: PLC0415
  from sage_jax.weights.loader import init_model  # noqa: PLC0415
  from sage_jax.model.config import get_preset  # noqa: PLC0415

  mesh = shd.make_mesh(shd.MeshConfig(data=1, fsdp=-1, tensor=1))
  cfg = get_preset("qwen2.5-0.5b", param_dtype="float32")
  model = shd.create_sharded(lambda: init_model(cfg, seed=0), mesh)
  params = nnx.state(model)
  sync = multihost.WeightSync(model, multihost.SamplerMeshConfig(param_dtype="bfloat16"))
  jax.block_until_ready(sync(params))
  times = []
  for _ in range(_SYNC_REPEATS.value):
    t0 = time.perf_counter()
    jax.block_until_ready(sync(params))
    times.append(time.perf_counter() - t0)
  slowest = max(multihost.allgather_objects(statistics.median(times)))
  if multihost.is_lead():
    with open(out, "w") as f:
      json.dump({"sync_s": slowest, "num_params": cfg.num_params()}, f)


def main(argv):
  del argv
  if _SYNC_CHILD.value:
    _time_sync(_SYNC_CHILD.value)
    return
  d = _DEVICES.value
  demo = {p: demo_step(p, d) for p in (1, 2)}
  sync = {p: weight_sync(p, d) for p in (1, 2)}
  print(json.dumps({
      "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
      "devices": d,
      "demo": {"1_process": demo[1], "2_processes": demo[2],
               "step_time_ratio_2_over_1": demo[2]["step_s"] / demo[1]["step_s"]},
      "weight_sync_0p5b": {"1_process": sync[1], "2_processes": sync[2],
                           "ratio_2_over_1": sync[2]["sync_s"] / sync[1]["sync_s"]},
  }, indent=2))


if __name__ == "__main__":
  app.run(main)
