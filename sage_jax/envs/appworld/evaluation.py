"""AppWorld's evaluation of the state an episode saved: checked, confined, time-limited.

The saved state is the agent's to forge (saved_state.py), so AppWorld's evaluator never
replays it where it lies. Each evaluation runs in a process of its own
(episode_process.run_in_fork) that:

- copies the state into a scratch directory, refusing any line or file AppWorld would not
  have written (saved_state.copy_checked), and evaluates that copy with AppWorld's own
  evaluator, unchanged;
- is confined like an episode process: it reads the installation, the task's files (its
  ground truth included), the base DBs and API docs and the saved state, and writes only
  its scratch directory: never the data root;
- is killed, with its process group, `timeout` seconds after it started, and dies with its
  parent.

How outcomes count: a refused state, a state whose lines do not replay, and an evaluation
still running at its limit are the agent's failure (`refused`; the pool's
`Evaluation.refused`), not environment faults. Only the episode's own lines reach the
replay, and AppWorld's evaluation of its own saves takes well under the limit; an
environment fault would leave the episode out of training, which a policy could use to hide
its bad episodes. Any other error is an environment fault.

  python -m sage_jax.envs.appworld.evaluation OUTPUTS_ROOT EXPERIMENT TASK_IDS_JSON TIMEOUT_S

prints AppWorld's TGC/SGC of an experiment's saved outputs, each task evaluated this way
(used by sage_jax.eval.metrics.appworld_scores).
"""

import json
import logging
import os
import shutil
import sqlite3
import sys
import tempfile

from sage_jax.envs.appworld import episode_process
from sage_jax.envs.appworld import sandbox
from sage_jax.envs.appworld import saved_state


def read_paths(data: str, task_id: str, saved: str) -> list[str]:
  """What an evaluation process may read (those that exist)."""
  d = os.path.join(data, "data")
  paths = [os.path.join(d, "base_dbs"), os.path.join(d, "api_docs"),
           os.path.join(d, "tasks", task_id), saved]
  return episode_process.sandbox_read_paths() + [p for p in paths if os.path.exists(p)]


def evaluate(data: str, apps: list[str], task_id: str, experiment: str, saved: str, *,
             confine: bool, timeout: float, scratch_dir: str | None = None) -> dict:
  """AppWorld's test results of the state saved in directory `saved` (TestTracker.to_dict:
  success, difficulty, num_tests, passes, failures), or {"refused": why} for the agent's
  failures. Raises RuntimeError on an environment fault. The copy is made in a new directory
  under `scratch_dir` (None: the system's temporary directory), removed after."""
  scratch = tempfile.mkdtemp(prefix="sage_jax_evaluation_", dir=scratch_dir)
  try:
    os.symlink(os.path.join(data, "data"), os.path.join(scratch, "data"))
    return episode_process.run_in_fork(
      lambda: _evaluate_copy(scratch, apps, task_id, experiment, saved),
      read_paths=read_paths(data, task_id, saved), write_dir=scratch, confine=confine,
      timeout=timeout)
  except episode_process.EvaluationTimeout as e:
    return {"refused": f"the evaluation of the saved state was {e}"}
  finally:
    shutil.rmtree(scratch, ignore_errors=True)


def _evaluate_copy(root: str, apps: list[str], task_id: str, experiment: str,
                   saved: str) -> dict:
  """Runs in the evaluation process: copies, then evaluates the copy (APPWORLD_ROOT=root,
  whose data/ links to the real data)."""
  from appworld.evaluator import evaluate_task

  copy = os.path.join(root, "experiments", "outputs", experiment, "tasks", task_id, "dbs")
  try:
    saved_state.copy_checked(saved, copy, apps)
  except saved_state.RefusedState as e:
    return {"refused": f"the saved state is not what AppWorld writes: {e}"}
  os.environ["APPWORLD_ROOT"] = root
  _refuse_replay_errors_in(copy)
  try:
    # No report on disk: nothing but the scores is wanted.
    tracker = evaluate_task(task_id=task_id, experiment_name=experiment,
                            suppress_errors=True, save_report=False)
  except saved_state.RefusedState as e:
    return {"refused": str(e)}
  return tracker.to_dict()


def _refuse_replay_errors_in(directory: str) -> None:
  """Makes an SQLite error while AppWorld replays a file of `directory` a RefusedState:
  those lines are the episode's (the official data's own replays keep their errors)."""
  from appworld.apps import model_lib

  replay = model_lib.apply_db_changes

  def checked(connection, changes_file_path):
    try:
      return replay(connection, changes_file_path)
    except sqlite3.Error as e:
      if changes_file_path and changes_file_path.startswith(directory + os.sep):
        raise saved_state.RefusedState(f"the saved state does not replay: {e}") from e
      raise

  model_lib.apply_db_changes = checked


def saved_dbs(outputs_root: str, experiment: str, task_id: str) -> str:
  """Where an episode of `experiment` saved the state of its task's databases."""
  return os.path.join(outputs_root, "experiments", "outputs", experiment, "tasks", task_id,
                      "dbs")


def main() -> None:
  outputs_root, experiment = sys.argv[1], sys.argv[2]
  task_ids, timeout = json.loads(sys.argv[3]), float(sys.argv[4])
  logging.disable(logging.WARNING)
  os.environ["APPWORLD_ROOT"] = outputs_root
  from appworld.apps import get_all_apps
  from appworld.evaluator import Metric
  from appworld.evaluator import TestTracker

  data = os.path.dirname(os.path.realpath(os.path.join(outputs_root, "data")))
  apps = get_all_apps()
  confine = sandbox.unavailable() is None  # else the pool ran with sandbox="off"
  metric = Metric()
  for task_id in task_ids:
    result = evaluate(data, apps, task_id, experiment,
                      saved_dbs(outputs_root, experiment, task_id), confine=confine,
                      timeout=timeout)
    if "refused" in result:  # one failed test, as AppWorld's Metric counts it
      tracker = TestTracker()
      tracker.failures = [{"requirement": result["refused"], "trace": "", "label": None}]
    else:
      tracker = TestTracker.from_dict(result)
    metric(task_id, tracker)
  sys.stdout.write("METRICS" + json.dumps(metric.get_metrics()["aggregate"]))


if __name__ == "__main__":
  main()
