"""Shared fixtures of the AppWorld tests: one cached mini world per session."""

import json
import os
import subprocess
import sys

import pytest

from sage_jax.envs import appworld


@pytest.fixture(scope="session")
def mini_root() -> str:
  return appworld.ensure_mini_world()


def task_dir(root: str, task_id: str) -> str:
  return os.path.join(root, "data", "tasks", task_id)


def gold_solution(root: str, task_id: str) -> str:
  with open(os.path.join(task_dir(root, task_id), "ground_truth", "solution.py")) as f:
    return f.read()


def ground_truth_answer(root: str, task_id: str):
  with open(os.path.join(task_dir(root, task_id), "ground_truth", "answer.json")) as f:
    return json.load(f)


def all_task_ids(root: str) -> list[str]:
  return [t for split in ("train", "dev", "test") for t in appworld.read_split(root, split)]


def pool_config(root: str, outputs: str, **overrides) -> appworld.EnvPoolConfig:
  """Limits that hold for gold solutions on a busy 2-core CPU (CI runs other jobs too)."""
  values = dict(num_workers=2, appworld_root=root, outputs_root=outputs, timeout_seconds=10,
                call_timeout_s=30.0, start_timeout_s=120.0, memory_limit_mb=1536,
                max_interactions=20, max_output_chars=5000)
  return appworld.EnvPoolConfig(**(values | overrides))


def appworld_metrics(outputs_root: str, experiment: str, task_ids: list[str]) -> dict:
  """AppWorld's own TGC/SGC of an experiment, computed in a separate process."""
  code = (
    "import json, sys\n"
    "from appworld.evaluator import evaluate_tasks\n"
    "m = evaluate_tasks(json.loads(sys.argv[1]), experiment_name=sys.argv[2],"
    " include_details=True, save_reports=False)\n"
    "sys.__stdout__.write('METRICS' + json.dumps(m['aggregate']))\n")
  done = subprocess.run([sys.executable, "-c", code, json.dumps(task_ids), experiment],
                        capture_output=True, text=True, check=True,
                        env=dict(os.environ, APPWORLD_ROOT=outputs_root))
  return json.loads(done.stdout.rpartition("METRICS")[2])
