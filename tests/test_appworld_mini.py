"""The mini AppWorld's data: format, coverage, splits, skill-shaped gold solutions."""

import ast
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time

import pytest

from sage_jax import assets
from sage_jax.envs import appworld
from sage_jax.envs.appworld import mini_world
from sage_jax.envs.appworld.mini import content
from sage_jax.envs.appworld.mini import scenarios
from tests.appworld_fixtures import all_task_ids
from tests.appworld_fixtures import gold_solution
from tests.appworld_fixtures import mini_root  # noqa: F401 - pytest fixture
from tests.appworld_fixtures import task_dir


def _json(root, task_id, *parts):
  with open(os.path.join(task_dir(root, task_id), *parts)) as f:
    return json.load(f)


def test_cached_under_builder_version(mini_root):  # noqa: F811
  assert mini_root == mini_world.mini_world_root()
  assert mini_root.endswith(os.path.join("appworld_mini", mini_world.BUILDER_VERSION))
  with open(os.path.join(mini_root, mini_world.MANIFEST)) as f:
    manifest = json.load(f)
  assert manifest["builder_version"] == mini_world.BUILDER_VERSION
  assert appworld.ensure_mini_world() == mini_root  # cached: no rebuild


def _digests(root):
  """sha256 of every file the builder wrote (the cache's own digest file left out)."""
  out = {}
  for d, _, files in os.walk(root):
    for f in files:
      with open(os.path.join(d, f), "rb") as fh:
        out[os.path.relpath(os.path.join(d, f), root)] = hashlib.sha256(fh.read()).hexdigest()
  out.pop(mini_world.DIGEST, None)
  return out


@pytest.fixture(scope="module")
def rebuilt(mini_root, tmp_path_factory):  # noqa: F811
  """A copy of the cached world that an episode wrote into, in a cache of its own, after
  `ensure_mini_world()` found it damaged and rebuilt it with the build command (the README's,
  in a child process): (its root, what ensure_mini_world returned, the warnings it logged)."""
  warnings = []
  handler = logging.Handler(logging.WARNING)
  handler.emit = lambda record: warnings.append(record.getMessage())
  logging.getLogger().addHandler(handler)
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("SAGE_JAX_CACHE", str(tmp_path_factory.mktemp("cache")))
    try:
      damaged = mini_world.mini_world_root()
      shutil.copytree(mini_root, damaged)
      for d, _, _ in os.walk(damaged):
        os.chmod(d, 0o755)
      os.makedirs(os.path.join(damaged, "experiments"))
      with open(os.path.join(damaged, "experiments", "stray.txt"), "w") as f:
        f.write("written by an episode")
      returned = appworld.ensure_mini_world()
    finally:
      logging.getLogger().removeHandler(handler)
  return damaged, returned, warnings


def _assert_same_files(built, cached):
  built, cached = _digests(built), _digests(cached)
  assert sorted(set(built) ^ set(cached)) == []
  assert [f for f in built if built[f] != cached[f]] == []


@pytest.mark.slow
def test_a_damaged_cache_is_rebuilt_to_the_same_bytes(mini_root, rebuilt):  # noqa: F811
  damaged, returned, warnings = rebuilt
  assert mini_world.build_command("/w")[1:] == [
      "-m", "sage_jax.envs.appworld.build_mini", "--out=/w"]  # the README's command
  assert returned == damaged
  assert [m for m in warnings if "damaged" in m] == [
      f"The cached mini AppWorld at {damaged} is damaged (its files or directories differ from "
      "the digest stored when it was built): rebuilding it."]
  assert mini_world.damage(damaged) is None
  _assert_same_files(damaged, mini_root)
  with open(os.path.join(mini_root, mini_world.DIGEST)) as f:
    assert mini_world.data_digest(damaged) == f.read().strip()
  assert os.listdir(os.path.dirname(damaged)) == [mini_world.BUILDER_VERSION]


@pytest.mark.slow
def test_readme_pool_example_leaves_the_cache_as_built(mini_root, rebuilt):  # noqa: F811
  """The README's EnvPool example (no outputs_root) writes nothing into the data root."""
  import asyncio  # noqa: PLC0415

  task_id = appworld.read_split(mini_root, "train")[0]
  config = appworld.EnvPoolConfig(num_workers=2, appworld_root=appworld.ensure_mini_world())

  async def episode(experiment, code):
    async with pool.episode(task_id, experiment=experiment) as ep:
      await ep.execute(code)
      return await ep.evaluate()

  with appworld.EnvPool(config) as pool:
    scratch = pool.outputs_root
    assert not scratch.startswith(mini_root)
    gold = asyncio.run(episode("readme/gold", gold_solution(mini_root, task_id)))
    noop = asyncio.run(episode("readme/noop", "print(apis.supervisor.show_profile())"))
    assert os.listdir(os.path.join(scratch, "experiments", "outputs"))
  assert gold.success and not noop.success
  assert not os.path.exists(scratch)  # the pool's own outputs directory is gone with it
  assert mini_world.damage(mini_root) is None
  _assert_same_files(rebuilt[0], mini_root)


def test_cache_is_read_only_and_checked_against_its_digest(mini_root, tmp_path):  # noqa: F811
  for d, _, files in os.walk(mini_root):
    assert not os.stat(d).st_mode & 0o222, d
    for f in files:
      assert not os.stat(os.path.join(d, f)).st_mode & 0o222, f
  assert mini_world.damage(mini_root) is None
  copy = str(tmp_path / "copy")
  shutil.copytree(mini_root, copy)
  for d, _, _ in os.walk(copy):
    os.chmod(d, 0o755)
  assert mini_world.damage(copy) is None
  spec = os.path.join(copy, "data", "tasks", all_task_ids(copy)[0], "specs.json")
  os.chmod(spec, 0o644)
  with open(spec, "r+b") as f:  # one byte
    first = f.read(1)
    f.seek(0)
    f.write(bytes([first[0] ^ 1]))
  assert "differ" in mini_world.damage(copy)
  with open(spec, "r+b") as f:
    f.write(first)
  assert mini_world.damage(copy) is None
  os.makedirs(os.path.join(copy, "experiments", "outputs", "x"))
  with open(os.path.join(copy, "experiments", "outputs", "x", "log.txt"), "w") as f:
    f.write("")
  assert "differ" in mini_world.damage(copy)
  os.remove(os.path.join(copy, "experiments", "outputs", "x", "log.txt"))
  assert "differ" in mini_world.damage(copy)  # the directories a writer left behind
  shutil.rmtree(os.path.join(copy, "experiments"))
  assert mini_world.damage(copy) is None
  os.remove(os.path.join(copy, mini_world.DIGEST))
  assert mini_world.damage(copy) == "no stored digest"


# A process that would build the mini world fails instead (its build command exits 3), then
# prints the root that ensure_mini_world() returned.
NO_BUILD = """
import sys
from sage_jax.envs.appworld import mini_world
mini_world.build_command = lambda out: [sys.executable, "-c", "raise SystemExit(3)"]
print(mini_world.ensure_mini_world())
"""


def test_a_process_that_finds_no_world_waits_for_the_one_building_it(
    mini_root, tmp_path):  # noqa: F811
  """While one process holds the build lock (it is building), another that finds no world
  waits for it and then returns the world it built, instead of building one more."""
  cache = tmp_path / "cache"
  env = {**os.environ, "SAGE_JAX_CACHE": str(cache)}
  lock = cache / ".locks" / "appworld_mini" / f"{mini_world.BUILDER_VERSION}.lock"
  with assets.build_lock(lock):
    waiting = subprocess.Popen([sys.executable, "-c", NO_BUILD], env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(3)  # it finds no world and waits on the lock
    assert waiting.poll() is None
    built = cache / "appworld_mini" / mini_world.BUILDER_VERSION
    shutil.copytree(mini_root, built)  # what the holder's build puts in place
  out, err = waiting.communicate(timeout=120)
  assert waiting.returncode == 0, err[-3000:]
  assert out.strip() == str(built)


def test_a_world_moved_away_while_it_is_read_is_damaged_not_an_error(mini_root, tmp_path,
                                                                     monkeypatch):  # noqa: F811
  """Two processes that find the cache damaged at once: one moves it aside while the other is
  still reading it. The reader gets a reason to rebuild, not a FileNotFoundError."""
  copy = str(tmp_path / "copy")
  shutil.copytree(mini_root, copy)
  walk = os.walk

  def walk_then_move_away(top):
    yield from walk(top)
    shutil.move(copy, str(tmp_path / "aside"))

  monkeypatch.setattr(mini_world.os, "walk", walk_then_move_away)
  assert "went away while it was read" in mini_world.damage(copy)


def test_appworld_layout(mini_root):  # noqa: F811
  data = os.path.join(mini_root, "data")
  apps = {f.removesuffix(".db") for f in os.listdir(os.path.join(data, "base_dbs"))}
  assert {"admin", "supervisor", "api_docs", "spotify", "venmo", "phone"} <= apps
  assert len(apps) == 12
  for task_id in all_task_ids(mini_root):
    d = task_dir(mini_root, task_id)
    assert {f.removesuffix(".jsonl") for f in os.listdir(os.path.join(d, "dbs"))
            if f.endswith(".jsonl")} == apps
    specs = _json(mini_root, task_id, "specs.json")
    assert specs["db_version"] == "0.1.0" and specs["instruction"]
    assert set(specs["supervisor"]) == {"first_name", "last_name", "email", "phone_number"}
    gt = set(os.listdir(os.path.join(d, "ground_truth")))
    assert {"metadata.json", "evaluation.py", "solution.py", "test_data.json", "answer.json",
            "public_data.json", "private_data.json", "required_apps.json"} <= gt
    labels = {t["label"] for t in _json(mini_root, task_id, "ground_truth", "test_data.json")}
    assert "no_op_fail" in labels  # a no-op must fail at least one test


def test_coverage_and_disjoint_splits(mini_root):  # noqa: F811
  splits = {s: appworld.read_split(mini_root, s) for s in ("train", "dev", "test")}
  groups = {s: appworld.group_by_scenario(ids) for s, ids in splits.items()}
  all_groups = {k: v for g in groups.values() for k, v in g.items()}
  assert len(all_groups) >= 12
  assert all(len(ids) == 3 and [i.split("_")[1] for i in ids] == ["1", "2", "3"]
             for ids in all_groups.values())
  assert not set(groups["train"]) & set(groups["dev"])
  assert not set(groups["train"]) & set(groups["test"])
  assert not set(groups["dev"]) & set(groups["test"])
  ids = all_task_ids(mini_root)
  apps = {a for t in ids for a in _json(mini_root, t, "ground_truth", "required_apps.json")}
  assert len(apps) >= 5
  difficulties = {_json(mini_root, t, "ground_truth", "metadata.json")["difficulty"]
                  for t in ids}
  assert difficulties == {1, 2, 3}
  answers = [_json(mini_root, t, "ground_truth", "answer.json") for t in ids]
  assert any(a is None for a in answers) and any(a is not None for a in answers)
  assert any(len(_json(mini_root, t, "ground_truth", "required_apps.json")) >= 2 for t in ids)


def test_tasks_of_a_scenario_differ_in_parameters_only(mini_root):  # noqa: F811
  for scenario, ids in appworld.group_by_scenario(all_task_ids(mini_root)).items():
    instructions = {_json(mini_root, t, "specs.json")["instruction"] for t in ids}
    assert len(instructions) == 3, scenario
    definitions, calls = set(), set()
    for t in ids:
      with open(os.path.join(task_dir(mini_root, t), "ground_truth", "solution.py")) as f:
        tree = ast.parse(f.read())
      (function,) = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
      definitions.add(ast.unparse(function))
      calls.add(ast.unparse(tree.body[1]))
      assert ast.unparse(tree.body[-1]).startswith("apis.supervisor.complete_task(")
    assert len(definitions) == 1, f"{scenario}: the procedure differs between tasks"
    assert len(calls) == 3, f"{scenario}: the calls do not differ"


def test_world_is_deterministic_and_hand_written():
  a, b = content.make_world(0), content.make_world(0)
  assert a == b
  assert content.make_world(1) != a
  titles = {s.title for s in a.songs}
  for holdings in a.holdings.values():
    assert set(holdings.library) <= titles
    assert all(set(p) <= set(holdings.library) for p in holdings.playlists.values())
    emails = {p.email for p in a.people}
    assert {e for e, _ in holdings.contacts} <= emails
    assert all(p.sender in emails and p.receiver in emails for p in holdings.payments)
  for s in scenarios.SCENARIOS:
    assert len(s.variants(a)) == 3


def test_split_helpers_reject_bad_input(tmp_path):
  with pytest.raises(ValueError, match="not-a-task"):
    appworld.scenario_id("not-a-task")
  with pytest.raises(FileNotFoundError, match="train"):
    appworld.read_split(str(tmp_path), "train")
  # AppWorld's split lines may carry a tag (`<task_id>:<tag>`), which its loader drops.
  # A byte-order mark, as editors on some systems write, is not part of the first id.
  (tmp_path / "data" / "datasets").mkdir(parents=True)
  for task_id in ("82e2fac_1", "82e2fac_2", "07b42fd_3"):
    (tmp_path / "data" / "tasks" / task_id).mkdir(parents=True)
  split = tmp_path / "data" / "datasets" / "train.txt"
  split.write_text("\ufeff82e2fac_1:reviewed\n82e2fac_2\r\n\n 07b42fd_3 \n", encoding="utf-8")
  assert appworld.read_split(str(tmp_path), "train") == ["82e2fac_1", "82e2fac_2", "07b42fd_3"]
  # A task listed without its directory fails here, naming the file, not at its episode.
  split.write_text("82e2fac_1\n82e2fac_4\n")
  with pytest.raises(FileNotFoundError, match=rf"{split} names 1 task\(s\) with no directory "
                                              r"under .*: 82e2fac_4$"):
    appworld.read_split(str(tmp_path), "train")
  split.write_text("# the train split\n82e2fac_1\n")
  with pytest.raises(ValueError, match=rf"^{split}: Not an AppWorld task id"):
    appworld.read_split(str(tmp_path), "train")
