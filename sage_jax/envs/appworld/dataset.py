"""Task ids of an AppWorld data root: splits and scenarios. Pure Python, no appworld."""

import collections
import os


def scenario_id(task_id: str) -> str:
  """AppWorld task ids are `<scenario>_<n>`; tasks of one scenario share a procedure."""
  scenario, sep, number = task_id.partition("_")
  if not sep or not scenario or not number.isdigit():
    raise ValueError(f"Not an AppWorld task id (<scenario>_<n>): {task_id!r}")
  return scenario


def read_split(root: str, split: str) -> list[str]:
  """Task ids listed in <root>/data/datasets/<split>.txt, in file order; a line's tag
  (`<task_id>:<tag>`) is dropped, as AppWorld's `load_task_ids` drops it. A line that is no
  task id, or names a task without a directory under data/tasks, fails here, naming the
  file (a missing task failed at its episode, mid-run; a byte-order mark made an id of its
  own)."""
  path = os.path.join(root, "data", "datasets", f"{split}.txt")
  if not os.path.exists(path):
    available = sorted(f.removesuffix(".txt")
                       for f in os.listdir(os.path.dirname(path))) if os.path.isdir(
                         os.path.dirname(path)) else []
    raise FileNotFoundError(f"No split {split!r} at {path}; available: {available}")
  with open(path, encoding="utf-8-sig") as f:
    task_ids = [line.strip().split(":")[0] for line in f if line.strip()]
  for task_id in task_ids:
    try:
      scenario_id(task_id)
    except ValueError as e:
      raise ValueError(f"{path}: {e}") from None
  tasks = os.path.join(root, "data", "tasks")
  missing = [t for t in task_ids if not os.path.isdir(os.path.join(tasks, t))]
  if missing:
    more = " ..." if len(missing) > 10 else ""
    raise FileNotFoundError(f"{path} names {len(missing)} task(s) with no directory under "
                            f"{tasks}: {', '.join(missing[:10])}{more}")
  return task_ids


def first_scenarios(task_ids: list[str], n: int) -> list[str]:
  """The tasks of the first `n` scenarios of `task_ids` (in order of first appearance; 0 =
  all), in their given order."""
  keep = set(list(group_by_scenario(task_ids))[:n or None])
  return [t for t in task_ids if scenario_id(t) in keep]


def group_by_scenario(task_ids: list[str]) -> dict[str, list[str]]:
  """Scenario id -> its task ids, sorted by task number (the order of a chain)."""
  groups = collections.defaultdict(list)
  for task_id in task_ids:
    groups[scenario_id(task_id)].append(task_id)
  return {s: sorted(ids, key=lambda t: int(t.partition("_")[2])) for s, ids in groups.items()}
