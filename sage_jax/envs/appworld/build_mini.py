r"""Builds the mini AppWorld: a small dataset in AppWorld's exact on-disk format.

  python -m sage_jax.envs.appworld.build_mini --out=DIR [--seed=0]

DIR becomes an APPWORLD_ROOT: DIR/data/{base_dbs,api_docs,tasks,datasets}. Every task's
gold solution is run through AppWorld and must pass all tests, and a no-op must fail, or
the build fails; the two runs also label the tests (test_data.json), as AppWorld does.
Offline and deterministic for a given seed.
"""

import concurrent.futures
import contextlib
import io
import json
import logging
import multiprocessing
import os
import re
import shutil
import sys

import freezegun
from absl import app
from absl import flags
from appworld import AppWorld
from appworld.apps import get_all_apps
from appworld.collections.models import ModelCollection
from appworld.common.constants import DB_VERSION
from appworld.evaluator import TestTracker

from sage_jax.envs.appworld import mini_world
from sage_jax.envs.appworld.mini import content
from sage_jax.envs.appworld.mini import populate
from sage_jax.envs.appworld.mini import scenarios

_OUT = flags.DEFINE_string("out", None, "Directory to build into (must not exist or be empty).")
_SEED = flags.DEFINE_integer("seed", mini_world.DEFAULT_SEED,
                             "Seed that decides who owns what in the world.")

DB_VERSION_KEY = "db_version"


def _write_json(path: str, value) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(value, f, indent=2)


def _write_text(path: str, text: str) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write(text)


def _build_base(data_dir: str, world, all_apps) -> None:
  base = os.path.join(data_dir, "base_dbs")
  os.makedirs(base)
  with freezegun.freeze_time(content.BASE_TIME):
    models = ModelCollection.load(to_db_home_path=base, from_db_home_path=base,
                                  load_apps=all_apps, create_db=True)
    populate.write_api_docs(models, data_dir)
    populate.populate(models, world)
    models.close()


def _write_task(data_dir: str, task_id: str, scenario, variant, all_apps, db_version) -> None:
  task_dir = os.path.join(data_dir, "tasks", task_id)
  s = variant.supervisor
  instruction = scenario.instruction.format(**variant.params)
  with freezegun.freeze_time(content.TASK_TIME):
    models = ModelCollection.load(to_db_home_path=f":memory:build-{task_id}",
                                  from_db_home_path=os.path.join(data_dir, "base_dbs"),
                                  load_apps=all_apps)
    populate.add_supervisor(models, s, instruction)
    models.save(db_home_path=os.path.join(task_dir, "dbs"), format="changes",
                app_names=all_apps, delete_if_exists=True, save_model_hashes=True)
    models.close()
  _write_json(os.path.join(task_dir, "specs.json"), {
    "instruction": instruction,
    "supervisor": {"first_name": s.first_name, "last_name": s.last_name, "email": s.email,
                   "phone_number": s.phone_number},
    "datetime": content.TASK_TIME.isoformat(),
    DB_VERSION_KEY: db_version,
  })
  gt = os.path.join(task_dir, "ground_truth")
  solution = scenario.solution(variant)
  _write_text(os.path.join(gt, "solution.py"), solution)
  _write_text(os.path.join(gt, "evaluation.py"), scenario.evaluation)
  _write_json(os.path.join(gt, "required_apps.json"), list(scenario.apps))
  _write_json(os.path.join(gt, "public_data.json"), {})
  _write_json(os.path.join(gt, "private_data.json"), variant.private_data)
  _write_json(os.path.join(gt, "answer.json"), variant.answer)
  _write_json(os.path.join(gt, "test_data.json"), None)  # labelled below
  _write_json(os.path.join(gt, "metadata.json"), {
    "mode": "full",
    "difficulty": scenario.difficulty,
    "num_apps": len(scenario.apps),
    "num_apis": len(set(re.findall(r"apis\.(\w+\.\w+)", solution))),
    "num_solution_code_lines": len([l for l in solution.splitlines() if l.strip()]),
    "scenario_name": scenario.name,
  })


def _run(task_id: str, experiment: str, code: str):
  """Runs code in a fresh world and evaluates it; returns AppWorld's TestTracker."""
  with contextlib.redirect_stdout(io.StringIO()):
    with AppWorld(task_id=task_id, experiment_name=experiment) as world:
      output = world.execute(code)
    tracker = world.evaluate(suppress_errors=True)
  if output.startswith("Execution failed"):
    raise RuntimeError(f"{task_id}: {experiment} code failed:\n{output}")
  return tracker


def _label(data_dir: str, task_id: str) -> None:
  """Checks gold passes and no-op fails, then writes AppWorld's test labels."""
  gt = os.path.join(data_dir, "tasks", task_id, "ground_truth")
  with open(os.path.join(gt, "solution.py")) as f:
    gold = _run(task_id, "build_gold", f.read())
  noop = _run(task_id, "build_noop", "print('no-op')")
  if not gold.success:
    raise RuntimeError(f"{task_id}: the gold solution fails: {gold.failures}")
  if noop.success:
    raise RuntimeError(f"{task_id}: a no-op passes every test")
  _write_json(os.path.join(gt, "test_data.json"),
              TestTracker.prepare_test_data(gold.passes, noop.passes))


def _label_all(data_dir: str, task_ids: list[str]) -> None:
  """`_label` for every task, in forked processes, one per core: a task's two runs write
  only its own files, and these 2 x N AppWorld runs are most of a build's time. The processes
  end without running exit handlers, so the worlds' IPython shells (each registers one that
  runs a full garbage collection) do not slow the build's exit."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  processes = max(1, min(cores or 1, len(task_ids)))
  with concurrent.futures.ProcessPoolExecutor(
      processes, mp_context=multiprocessing.get_context("fork")) as executor:
    list(executor.map(_label, [data_dir] * len(task_ids), task_ids))  # raises a task's error


def build(out: str, seed: int) -> dict:
  """Builds the whole mini world into `out`; returns its manifest."""
  if os.path.exists(out) and os.listdir(out):
    raise FileExistsError(f"--out={out} exists and is not empty; pick a new directory.")
  os.environ["APPWORLD_ROOT"] = os.path.abspath(out)
  data_dir = os.path.join(out, "data")
  all_apps = get_all_apps()
  world = content.make_world(seed)
  _build_base(data_dir, world, all_apps)
  splits = {"train": [], "dev": [], "test": []}
  for scenario in scenarios.SCENARIOS:
    for n, variant in enumerate(scenario.variants(world), 1):
      task_id = f"{scenario.id}_{n}"
      _write_task(data_dir, task_id, scenario, variant, all_apps, DB_VERSION)
      splits[scenario.split].append(task_id)
  for split, task_ids in splits.items():
    _write_text(os.path.join(data_dir, "datasets", f"{split}.txt"), "\n".join(task_ids) + "\n")
  _label_all(data_dir, [t for task_ids in splits.values() for t in task_ids])
  shutil.rmtree(os.path.join(out, "experiments"), ignore_errors=True)
  manifest = {
    "builder_version": mini_world.BUILDER_VERSION,
    "seed": seed,
    DB_VERSION_KEY: DB_VERSION,
    "scenarios": {s.id: s.name for s in scenarios.SCENARIOS},
    "splits": {k: len(v) for k, v in splits.items()},
  }
  _write_json(os.path.join(out, mini_world.MANIFEST), manifest)
  return manifest


def main(argv) -> None:
  del argv
  if not _OUT.value:
    raise app.UsageError("--out=DIR is required.")
  logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per API call otherwise
  manifest = build(_OUT.value, _SEED.value)
  print(json.dumps(manifest), file=sys.stderr)


if __name__ == "__main__":
  app.run(main)
