"""Checks that an AppWorld data root is complete before any world is opened.

Pure Python. The pool checks every task's files before it starts a worker (`check_tasks`,
remembered per fingerprint of the root's task directories); each worker checks the root
against AppWorld's own DB version and app list (`check`), and each task's files again
before opening its world (`task_problems`). A bad root fails at pool start with a message
that names what is missing and how to get it; a task whose files went missing later fails
to start, as an environment error, never as the agent's failure.
"""

import hashlib
import json
import os

HOW_TO_GET_DATA = (
  "Build the mini world with `python -m sage_jax.envs.appworld.build_mini --out=DIR` (or "
  "call sage_jax.envs.appworld.ensure_mini_world()), or download the official data with "
  "`appworld download data --root DIR` where that is reachable; then point "
  "APPWORLD_ROOT (or EnvPoolConfig.appworld_root) at DIR.")


class AppWorldDataError(RuntimeError):
  """The AppWorld data root is missing, incomplete or of the wrong version."""


def resolve(data: str | None) -> str:
  """The one place a data setting becomes an AppWorld root: "mini" is the bundled mini world
  (built on first use), a path is that directory, and nothing means $APPWORLD_ROOT."""
  data = data or os.environ.get("APPWORLD_ROOT", "")
  if not data:
    raise AppWorldDataError("No AppWorld data: set the data root (\"mini\" for the bundled "
                            "mini world, or a directory) or $APPWORLD_ROOT. " + HOW_TO_GET_DATA)
  if data == "mini":
    from sage_jax.envs.appworld.mini_world import ensure_mini_world  # noqa: PLC0415

    return ensure_mini_world()
  return os.path.abspath(data)


def problems(root: str, db_version: str, apps: list[str]) -> list[str]:
  """Everything wrong with <root>/data for AppWorld `db_version` with `apps`."""
  data = os.path.join(root, "data")
  tasks = os.path.join(data, "tasks")
  if not os.path.isdir(tasks) or not os.listdir(tasks):
    return [f"no task directory with tasks at {tasks}"]
  found = []
  missing_dbs = [a for a in apps if not os.path.exists(os.path.join(data, "base_dbs", f"{a}.db"))]
  if missing_dbs:
    found.append(f"missing base DBs in {os.path.join(data, 'base_dbs')}: {missing_dbs}")
  docs = os.path.join(data, "api_docs", "standard")
  missing_docs = [a for a in apps
                  if a != "admin" and not os.path.exists(os.path.join(docs, f"{a}.json"))]
  if missing_docs:
    found.append(f"missing API docs in {docs}: {missing_docs}")
  wrong = []
  for task_id in sorted(os.listdir(tasks)):
    specs = os.path.join(tasks, task_id, "specs.json")
    if not os.path.exists(specs):
      wrong.append(f"{task_id} (no specs.json)")
      continue
    with open(specs) as f:
      version = json.load(f).get("db_version")
    if version != db_version:
      wrong.append(f"{task_id} (db_version {version!r})")
  if wrong:
    found.append(f"tasks not of db_version {db_version!r} that this AppWorld needs: "
                 f"{wrong[:5]}{' ...' if len(wrong) > 5 else ''}")
  return found


def check(root: str, db_version: str, apps: list[str]) -> None:
  found = problems(root, db_version, apps)
  if found:
    raise AppWorldDataError(f"AppWorld data root {root} is not usable: "
                            + "; ".join(found) + ". " + HOW_TO_GET_DATA)


# What evaluating a task needs in its directory (AppWorld's minimal ground-truth mode), on
# top of one DB diff per app (dbs/<app>.jsonl). Not dbs/model_hashes.json: AppWorld reads it
# when it is there and does without it.
TASK_FILES = ("specs.json", "ground_truth/metadata.json",
              "ground_truth/public_data.json", "ground_truth/private_data.json",
              "ground_truth/answer.json", "ground_truth/evaluation.py",
              "ground_truth/test_data.json")


def task_problems(root: str, task_id: str, apps: list[str]) -> list[str]:
  """The files of task `task_id` that are missing or unreadable (checked without reading
  them: the worker that calls this must never hold a task's answers)."""
  task = os.path.join(root, "data", "tasks", task_id)
  needed = list(TASK_FILES) + [f"dbs/{app}.jsonl" for app in apps]
  return [f for f in needed if not os.access(os.path.join(task, f), os.R_OK)]


def _tasks_fingerprint(root: str, task_ids: list[str]) -> str:
  """Changes whenever a file is added to or removed from any task's directories."""
  digest = hashlib.sha256(os.path.realpath(root).encode())
  tasks = os.path.join(root, "data", "tasks")
  for path in [os.path.join(root, "data", "base_dbs"), tasks] + [
      os.path.join(tasks, t, sub) for t in task_ids for sub in ("", "dbs", "ground_truth")]:
    try:
      digest.update(f"{path}\0{os.stat(path).st_mtime_ns}\0".encode())
    except OSError:
      digest.update(f"{path}\0missing\0".encode())
  return digest.hexdigest()


def check_tasks(root: str, cache_dir: str | None) -> None:
  """Raises AppWorldDataError naming every task with missing or unreadable files.

  Checks every task under <root>/data/tasks (so every split), for every app that has a
  base DB. A root that passed is remembered in `cache_dir` under its fingerprint, and not
  checked again until a task's directories change.
  """
  tasks = os.path.join(root, "data", "tasks")
  base_dbs = os.path.join(root, "data", "base_dbs")
  if not os.path.isdir(tasks) or not os.path.isdir(base_dbs):
    return  # the worker's check() says what is missing, and how to get it
  task_ids = sorted(os.listdir(tasks))
  marker = (os.path.join(cache_dir, _tasks_fingerprint(root, task_ids))
            if cache_dir else None)
  if marker and os.path.exists(marker):
    return
  apps = sorted(f.removesuffix(".db") for f in os.listdir(base_dbs) if f.endswith(".db"))
  bad = [f"{t} ({', '.join(missing)})" for t in task_ids
         if (missing := task_problems(root, t, apps))]
  if bad:
    raise AppWorldDataError(
      f"AppWorld data root {root} is not usable: {len(bad)} task(s) with missing or "
      f"unreadable files: {'; '.join(bad[:10])}{' ...' if len(bad) > 10 else ''}. "
      + HOW_TO_GET_DATA)
  if marker:
    os.makedirs(cache_dir, exist_ok=True)
    with open(marker, "w") as f:
      f.write(f"{root}: {len(task_ids)} tasks checked\n")
