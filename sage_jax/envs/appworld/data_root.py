"""Checks that an AppWorld data root is complete before any world is opened.

Pure Python; the worker calls it with AppWorld's own DB version and app list, so a bad
root fails at pool start with a message that says what is missing and how to get it.
"""

import json
import os

HOW_TO_GET_DATA = (
  "Build the mini world with `python -m sage_jax.envs.appworld.build_mini --out=DIR` (or "
  "call sage_jax.envs.appworld.ensure_mini_world()), or download the official data with "
  "`appworld download data --root DIR` where that is reachable; then point "
  "APPWORLD_ROOT (or EnvPoolConfig.appworld_root) at DIR.")


class AppWorldDataError(RuntimeError):
  """The AppWorld data root is missing, incomplete or of the wrong version."""


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
