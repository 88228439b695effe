"""An episode's saved state is agent-written: its evaluation checks it, is confined, and ends.

The agent's code can reach the AppWorld object, stop its saves and write any line into the
DB logs that AppWorld's evaluator replays. These tests forge such lines on a private copy of
the mini world (never the shared cache), through a pool and through the evaluation alone
with the line check switched off, so that each layer is shown to hold by itself.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from sage_jax.envs import appworld
from sage_jax.envs.appworld import sandbox
from sage_jax.envs.appworld import saved_state
from sage_jax.eval import metrics
from tests.appworld_fixtures import _copy_tree
from tests.appworld_fixtures import all_task_ids
from tests.appworld_fixtures import children
from tests.appworld_fixtures import gold_solution
from tests.appworld_fixtures import mini_root  # noqa: F401 - pytest fixture
from tests.appworld_fixtures import pool_config
from tests.appworld_fixtures import pool_templates

ENDLESS = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
EVALUATION_TIMEOUT_S = 8.0

# Agent code that stops AppWorld's saves and writes its own lines as supervisor's DB log.
FORGE = """
imp = __builtins__["__import__"] if isinstance(__builtins__, dict) else __builtins__.__import__
gc, posix, json = imp("gc"), imp("posix"), imp("json")
world = [o for o in gc.get_objects() if type(o).__name__ == "AppWorld"][0]
world._save_state = lambda *args, **kwargs: None
fd = posix.open(world.output_db_home_path_on_disk + "/supervisor.jsonl",
                posix.O_WRONLY | posix.O_CREAT | posix.O_TRUNC, 0o644)
posix.write(fd, "".join(json.dumps(line) + "\\n" for line in {lines!r}).encode())
posix.close(fd)
print("forged")
"""


def _attach_lines(*paths: str) -> list:
  lines = []
  for i, path in enumerate(paths):
    lines += [[f"ATTACH DATABASE '{path}' AS a{i}", [], False],
              [f"CREATE TABLE a{i}.written_by_agent(x)", [], False]]
  return lines


def _digest(directory: str) -> str:
  digest = hashlib.sha256()
  for name in sorted(os.listdir(directory)):
    with open(os.path.join(directory, name), "rb") as f:
      digest.update(name.encode() + f.read())
  return digest.hexdigest()


def _processes_with(marker: str) -> list[int]:
  """Processes whose environment holds `marker` (live ones, not zombies)."""
  found = []
  for name in os.listdir("/proc"):
    try:
      with open(f"/proc/{name}/environ", "rb") as f:
        environ = f.read()
      with open(f"/proc/{name}/stat") as f:
        state = f.read().rpartition(")")[2].split()[0]
    except (OSError, ValueError, IndexError):
      continue
    if marker.encode() in environ and state != "Z" and int(name) != os.getpid():
      found.append(int(name))
  return found


def _workers_children() -> list[int]:
  """The processes that this test process's pool workers (the children of its pool's
  template process) have forked."""
  workers = [worker for template in pool_templates() for worker, _ in children(template)]
  assert workers
  return [child for worker in workers for child, _ in children(worker)]


@pytest.fixture(scope="module")
def world(mini_root, tmp_path_factory):  # noqa: F811
  """A private copy of the mini world, which the forged lines aim at."""
  root = str(tmp_path_factory.mktemp("sandbox_world"))
  _copy_tree(mini_root, root)
  return root


@pytest.fixture(scope="module")
def pool(world, tmp_path_factory):
  outputs = str(tmp_path_factory.mktemp("sandbox_outputs"))
  # The forgeries below reach the interpreter, which the code guard refuses first
  # (tests/test_code_guard.py): off here, to show that the layers below it hold alone.
  config = pool_config(world, outputs, num_workers=1, data_check_cache=None,
                       evaluation_timeout_s=EVALUATION_TIMEOUT_S, code_guard=False)
  with appworld.EnvPool(config) as pool:
    yield pool


def _forged_episode(pool, world, experiment: str, lines: list):
  task_id = all_task_ids(world)[0]
  with pool.episode(task_id, experiment) as ep:
    assert "forged" in ep.execute(FORGE.format(lines=lines)).result()
  return ep.result


def test_forged_attach_changes_no_file(pool, world, tmp_path):
  outside = str(tmp_path / "created_by_agent.db")
  base_dbs = os.path.join(world, "data", "base_dbs")
  before = _digest(base_dbs)
  result = _forged_episode(pool, world, "forged_attach", _attach_lines(
    outside, os.path.join(base_dbs, "supervisor.db")))
  assert result.error is None and not result.success  # the agent's failure, not hidden
  assert "not what AppWorld writes" in result.evaluation.refused
  assert "ATTACH DATABASE" in result.evaluation.refused
  # AppWorld's own scores of the same outputs: the same refusal, a failed task.
  scores = metrics.appworld_scores(pool.outputs_root, "forged_attach",
                                   [result.task_id], EVALUATION_TIMEOUT_S)
  assert scores == {"task_goal_completion": 0.0, "scenario_goal_completion": 0.0}
  assert not os.path.exists(outside)
  assert _digest(base_dbs) == before


def test_forged_endless_query_ends_within_the_limit(pool, world):
  start = time.monotonic()
  result = _forged_episode(pool, world, "forged_endless", [[ENDLESS, [], False]])
  assert time.monotonic() - start < EVALUATION_TIMEOUT_S
  assert result.error is None and "not what AppWorld writes" in result.evaluation.refused
  assert _workers_children() == []  # nothing left evaluating


def test_gold_state_still_scores(pool, world):
  task_id = all_task_ids(world)[0]
  with pool.episode(task_id, "gold_after_forgery") as ep:
    ep.execute(gold_solution(world, task_id)).result()
  assert ep.result.success and ep.result.evaluation.refused is None


@pytest.mark.parametrize("line", [
  ["ATTACH DATABASE '/tmp/x.db' AS x", [], False],
  ["PRAGMA writable_schema = 1", [], False],
  ["VACUUM INTO '/tmp/x.db'", [], False],
  ["CREATE TABLE t(x)", [], False],
  ["INSERT INTO t (a) VALUES (?); DROP TABLE t", [1], False],
  ["INSERT INTO t (a, b) VALUES (?)", [1], False],
  ["INSERT INTO sqlite_sequence (name, seq) VALUES (?, ?)", ["t", 1], False],
  ["UPDATE t SET a=? WHERE t.id = ? OR 1", [1, 2], False],
  ["DELETE FROM t WHERE t.id = ?", [[1], [2, 3]], True],
  ["DELETE FROM t WHERE t.id = ?", [{"id": 1}], False],
  ["DELETE FROM t", [], False],
  ["DELETE FROM t WHERE t.id = ?", [1]],
])
def test_lines_appworld_never_writes_are_refused(line):
  with pytest.raises(saved_state.RefusedState):
    saved_state.check_line(line)


@pytest.mark.parametrize("line", [
  ["INSERT INTO notes (title, \"order\") VALUES (?, ?)", ["a", None], False],
  ["UPDATE notes SET record_hash=?, content=? WHERE notes.id = ?", ["h", "c", 3], False],
  ["UPDATE notes_fts SET saved_search_text = ? WHERE id = ?", ["t", 3], False],
  ["DELETE FROM playlist_songs WHERE playlist_songs.id = ?", [[1], [2]], True],
])
def test_appworlds_own_forms_pass(line):
  saved_state.check_line(line)


def test_a_file_nested_too_deep_to_parse_is_refused(tmp_path):
  """JSON nested past the parser's recursion limit is the episode's forgery (AppWorld writes
  flat lines), not an environment fault."""
  for name, text in (("supervisor.jsonl", "[" * 100_000 + "\n"),
                     (saved_state.HASHES, "{\"a\": " * 100_000)):
    saved = tmp_path / name.split(".")[0]
    saved.mkdir()
    (saved / name).write_text(text)
    with pytest.raises(saved_state.RefusedState, match=name):
      saved_state.copy_checked(str(saved), str(tmp_path / "copy"), ["supervisor"])


# --- The evaluation alone, with the line check off: confinement and time limit still hold --

UNCHECKED_EVALUATION = """
import json, os, sys
from sage_jax.envs.appworld import evaluation, saved_state
saved_state.check_line = lambda line: line[0]  # as if nothing checked the lines
from appworld.apps import get_all_apps
data, task_id, saved, timeout = sys.argv[1:]
print("RESULT" + json.dumps(evaluation.evaluate(data, get_all_apps(), task_id, "unchecked",
                                                saved, confine=True, timeout=float(timeout))))
"""


def _unchecked(world, tmp_path, lines: list, timeout: float) -> subprocess.Popen:
  """Starts an evaluation of `lines` (the line check off) in a child process."""
  task_id = all_task_ids(world)[0]
  outputs = tmp_path / "outputs"
  saved = outputs / "experiments" / "outputs" / "unchecked" / "tasks" / task_id / "dbs"
  saved.mkdir(parents=True)
  (outputs / "data").symlink_to(os.path.join(world, "data"))
  (saved / "supervisor.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
  # The evaluation's scratch directory under the test's own: a killed child leaves it behind.
  (tmp_path / "tmp").mkdir()
  env = dict(os.environ, APPWORLD_ROOT=str(outputs), SAGE_JAX_TEST_MARKER=str(tmp_path),
             TMPDIR=str(tmp_path / "tmp"))
  return subprocess.Popen([sys.executable, "-c", UNCHECKED_EVALUATION, world, task_id,
                           str(saved), str(timeout)], stdout=subprocess.PIPE, text=True,
                          env=env)


@pytest.mark.parametrize("target", ["outside", "base_db"])
def test_confined_evaluation_writes_nothing_outside(world, tmp_path, target):
  outside = str(tmp_path / "created_by_agent.db")
  base_dbs = os.path.join(world, "data", "base_dbs")
  before = _digest(base_dbs)
  path = outside if target == "outside" else os.path.join(base_dbs, "supervisor.db")
  child = _unchecked(world, tmp_path, _attach_lines(path), timeout=60)
  out, _ = child.communicate(timeout=120)
  result = json.loads(out.rpartition("RESULT")[2])
  assert "does not replay" in result["refused"], result
  assert not os.path.exists(outside)
  assert _digest(base_dbs) == before


def test_endless_evaluation_is_killed_at_its_limit(world, tmp_path):
  start = time.monotonic()
  child = _unchecked(world, tmp_path, [[ENDLESS, [], False]], timeout=3)
  out, _ = child.communicate(timeout=120)
  result = json.loads(out.rpartition("RESULT")[2])
  assert "still running 3 s after it started" in result["refused"], result
  assert time.monotonic() - start < 60
  assert not _processes_with(str(tmp_path))


def test_evaluation_dies_with_its_parent(world, tmp_path):
  child = _unchecked(world, tmp_path, [[ENDLESS, [], False]], timeout=600)
  deadline = time.monotonic() + 60
  while len(_processes_with(str(tmp_path))) < 2:  # the child and its evaluation process
    assert time.monotonic() < deadline and child.poll() is None
    time.sleep(0.2)
  child.send_signal(signal.SIGKILL)
  child.wait()
  deadline = time.monotonic() + 10
  while _processes_with(str(tmp_path)):
    assert time.monotonic() < deadline, "the evaluation process outlived its parent"
    time.sleep(0.1)


def test_agent_code_cannot_read_the_packages_other_files(pool, world):
  package = os.path.dirname(os.path.abspath(appworld.__file__))
  paths = [os.path.join(package, "mini", "scenarios.py"), os.path.join(package, "build_mini.py")]
  code = ("io = __import__('_i' + 'o')\n"
          f"for path in {paths!r}:\n"
          "    try:\n"
          "        print('READ', len(io.FileIO(path).read()))\n"
          "    except OSError as e:\n"
          "        print('DENIED', type(e).__name__)\n")
  with pool.episode(all_task_ids(world)[0], "package_files") as ep:
    observation = ep.execute(code).result()
  assert observation.count("DENIED PermissionError") == len(paths), observation


def test_format_fields_reach_no_refused_attribute(pool, world):
  """A string.Formatter subclass is handed the object a format field names: with the code
  guard off, the episode process still resolves no field the guard's attribute rule refuses,
  and resolves the others."""
  grab = ("import string\n"
          "class Grab(string.Formatter):\n"
          "    def format_field(self, value, format_spec):\n"
          "        print('GRABBED', type(value).__name__)\n"
          "        return ''\n\n"
          "def f():\n    pass\n\n"
          "Grab().format('{0.__globals__}', f)\n")
  with pool.episode(all_task_ids(world)[0], "format_fields") as ep:
    grabbed = ep.execute(grab).result()
    formatted = ep.execute("print(string.Formatter().format('{0} {1.real}', 'a', 2))").result()
  assert "GRABBED" not in grabbed, grabbed
  assert "the format field '0.__globals__' is not resolved" in grabbed, grabbed
  assert formatted.strip() == "a 2", formatted


CONFINED_READS = """
import json, os, sys
from sage_jax.envs.appworld import sandbox
site, package = sys.argv[1:]
sandbox.confine(sandbox.system_read_paths() + sandbox.withhold([site], package), [])
read = {}
for path in (os.path.join(site, "other", "__init__.py"), os.path.join(site, "top.pth"),
             os.path.join(package, "mini", "scenarios.py")):
  try:
    read[path] = open(path).read()
  except OSError as e:
    read[path] = type(e).__name__
print("RESULT" + json.dumps(read))
"""


def test_a_package_installed_inside_a_granted_directory_stays_unreadable(tmp_path):
  """Under a non-editable install the package lies in site-packages, which agent code reads:
  its files (the mini world's gold procedures) stay unreadable, site-packages' others not."""
  site = tmp_path.resolve() / "lib" / "site-packages"
  package = site / "sage_jax"
  (package / "mini").mkdir(parents=True)
  (package / "mini" / "scenarios.py").write_text("GOLD = 1\n")
  (site / "other").mkdir()
  (site / "other" / "__init__.py").write_text("OTHER = 1\n")
  (site / "top.pth").write_text("other\n")
  assert sandbox.withhold([str(tmp_path)], str(package)) == [str(site / "other"),
                                                             str(site / "top.pth")]
  out = subprocess.run([sys.executable, "-c", CONFINED_READS, str(site), str(package)],
                       capture_output=True, text=True, timeout=120)
  read = json.loads(out.stdout.rpartition("RESULT")[2])
  assert list(read.values()) == ["OTHER = 1\n", "other\n", "PermissionError"], out.stderr
