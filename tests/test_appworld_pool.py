"""The pool runs the real AppWorld: episodes, scoring against AppWorld's own evaluation."""

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from sage_jax import configurable
from sage_jax.envs import appworld
from sage_jax.envs.appworld.process import WorkerFault
from tests.appworld_fixtures import all_task_ids
from tests.appworld_fixtures import appworld_metrics
from tests.appworld_fixtures import gold_solution
from tests.appworld_fixtures import ground_truth_answer
from tests.appworld_fixtures import mini_root  # noqa: F401 - pytest fixture
from tests.appworld_fixtures import pool_config
from tests.appworld_fixtures import pool_templates
from tests.appworld_fixtures import task_dir


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
  return str(tmp_path_factory.mktemp("appworld_outputs"))


@pytest.fixture(scope="module")
def pool(mini_root, outputs):  # noqa: F811
  # Some probes here reach AppWorld's internals (private attributes, `_io`) to test what lies
  # beneath the code guard, which refuses them (tests/test_code_guard.py): off here.
  with appworld.EnvPool(pool_config(mini_root, outputs, code_guard=False)) as pool:
    yield pool


def _run_all(pool, runs, experiment):
  """Runs (task_id, code) episodes concurrently; returns their results in order."""
  async def one(task_id, code):
    async with pool.episode(task_id, experiment) as ep:
      await ep.execute(code)
    return ep.result

  async def all_of_them():
    return await asyncio.gather(*(one(t, c) for t, c in runs))

  return asyncio.run(all_of_them())


def test_importing_the_pool_does_not_import_appworld():
  code = ("import sys\nimport sage_jax.envs.appworld as a\nimport sage_jax.envs.appworld.pool\n"
          "a.EnvPoolConfig(); print(sorted(m for m in sys.modules if m.startswith('appworld')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]"


def test_config_rejects_unknown_keys_and_bad_values():
  config = configurable.build(appworld.EnvPoolConfig, {"num_workers": 3, "use_servers": True},
                              "config.pool")
  assert config.num_workers == 3 and config.use_servers
  with pytest.raises(ValueError, match="config.pool.num_wrokers: unknown key"):
    configurable.build(appworld.EnvPoolConfig, {"num_wrokers": 3}, "config.pool")
  with pytest.raises(ValueError, match="call_timeout_s"):
    appworld.EnvPoolConfig(timeout_seconds=100, call_timeout_s=50)
  with pytest.raises(ValueError, match="num_workers"):
    appworld.EnvPoolConfig(num_workers=0)


def test_episode_start_carries_the_prompt_material(pool, mini_root):  # noqa: F811
  task_id = appworld.read_split(mini_root, "train")[0]
  with open(os.path.join(task_dir(mini_root, task_id), "specs.json")) as f:
    specs = json.load(f)
  with pool.episode(task_id, "start_info") as ep:
    start = ep.start
  assert start.task_id == task_id
  assert start.instruction == specs["instruction"]
  assert start.supervisor == specs["supervisor"]
  assert start.datetime.startswith(specs["datetime"][:10])
  assert {"spotify", "venmo", "supervisor", "api_docs"} <= set(start.app_descriptions)
  assert all(start.app_descriptions.values())
  assert start.library_ok is None
  assert ep.result.evaluation is not None and not ep.result.success  # nothing was done


@pytest.mark.slow
def test_gold_passes_noop_fails_and_tgc_sgc_match_appworld(pool, mini_root, outputs):  # noqa: F811
  task_ids = all_task_ids(mini_root)
  gold = _run_all(pool, [(t, gold_solution(mini_root, t)) for t in task_ids], "gold")
  noop = _run_all(pool, [(t, "print('nothing to do')") for t in task_ids], "noop")
  failed = [r.task_id for r in gold if not r.success]
  assert not failed, f"gold solutions fail on {failed}"
  assert all(r.evaluation.fraction_passed == 1.0 and r.task_completed for r in gold)
  assert not [r.task_id for r in noop if r.success or r.error]
  assert all(r.evaluation.num_failed > 0 for r in noop)
  # A mix (gold on two tasks of each scenario but one) makes TGC/SGC non-trivial.
  mixed_runs = [(t, gold_solution(mini_root, t) if i % 4 else "print(0)")
                for i, t in enumerate(task_ids)]
  mixed = _run_all(pool, mixed_runs, "mixed")
  for experiment, results in (("gold", gold), ("noop", noop), ("mixed", mixed)):
    ours = (appworld.task_goal_completion(results), appworld.scenario_goal_completion(results))
    theirs = appworld_metrics(outputs, experiment, task_ids)
    assert ours[0] == pytest.approx(theirs["task_goal_completion"], abs=0.05), experiment
    assert ours[1] == pytest.approx(theirs["scenario_goal_completion"], abs=0.05), experiment
  assert 0 < appworld.task_goal_completion(mixed) < 100
  assert appworld.scenario_goal_completion(mixed) < appworld.task_goal_completion(mixed)


def test_tgc_sgc_score_a_task_once_by_its_last_result():
  """pool.results keeps every attempt: a retried task counts once, by its retry, as AppWorld
  counts tasks."""
  ok = appworld.Evaluation(success=True, num_passed=2, num_failed=0)
  results = [appworld.EpisodeResult("aaaaaaa_1", "run", None, 3, False, error="worker died"),
             appworld.EpisodeResult("aaaaaaa_1", "run", ok, 3, True),
             appworld.EpisodeResult("aaaaaaa_2", "run", ok, 3, True)]
  assert appworld.task_goal_completion(results) == appworld.scenario_goal_completion(
      results) == 100.0
  assert appworld.task_goal_completion([results[1], results[0], results[2]]) == 50.0


@pytest.mark.parametrize("cancel_after_s", [0.0, 0.3])
def test_a_start_cancelled_is_not_live_once_the_cancel_returns(pool, mini_root,  # noqa: F811
                                                              cancel_after_s):
  """A stop while an episode starts (its start still queued, or begun by a worker: a slow
  library install) leaves nothing live once the cancelled call returns: the same task starts
  again at once, as a rerun of a stopped evaluation on the same pool does."""
  task_id = appworld.read_split(mini_root, "dev")[0]
  slow_library = "total = 0\nfor i in range(3_000_000):\n  total += i\n"  # a start of ~1 s

  async def cancelled() -> None:
    async def enter() -> None:
      async with pool.episode(task_id, "cancelled", library_code=slow_library):
        await asyncio.sleep(60)

    entering = asyncio.ensure_future(enter())
    await asyncio.sleep(cancel_after_s)
    entering.cancel()
    with pytest.raises(asyncio.CancelledError):
      await entering

  asyncio.run(cancelled())
  with pool.episode(task_id, "cancelled") as episode:
    assert episode.start.task_id == task_id
  assert episode.result is not None


def test_wrong_answers_fail(pool, mini_root):  # noqa: F811
  qa = [t for t in all_task_ids(mini_root) if ground_truth_answer(mini_root, t) is not None]
  runs = []
  for t in qa[::3]:
    answer = ground_truth_answer(mini_root, t)
    runs.append((t, f"apis.supervisor.complete_task(answer={answer + 1!r})"))
  results = _run_all(pool, runs, "wrong")
  assert results and not [r.task_id for r in results if r.success]
  assert all(r.task_completed and r.evaluation.failed_requirements for r in results)


def test_skill_library_is_installed_before_the_first_turn(pool, mini_root):  # noqa: F811
  task_id = appworld.read_split(mini_root, "dev")[0]
  library = ("def double(x):\n    return 2 * x\n\n"
             "def finish():\n    apis.supervisor.complete_task(answer=0)\n")
  with pool.episode(task_id, "library", library_code=library) as ep:
    assert ep.start.library_ok is True
    assert ep.execute("print(double(21))").result().strip() == "42"
    assert ep.num_steps == 1  # the library does not count as a step
    assert not ep.task_completed
    ep.execute("finish()").result()  # completes the task through a library skill
    assert ep.task_completed and ep.num_steps == 2
  broken = "def ok():\n    return 1\n\nraise ValueError('broken skill')\n"
  with pool.episode(task_id, "library_broken", library_code=broken) as ep:
    assert ep.start.library_ok is False
    assert "broken skill" in ep.start.library_output
    assert ep.execute("print(ok())").result().strip() == "1"  # not fatal
  assert ep.result.error is None


def test_episodes_inherit_what_appworld_builds_at_first_use(pool, mini_root):  # noqa: F811
  """AppWorld checks each request against its app's API docs, which it builds (0.1-0.4 s an
  app) at a process's first request to that app, and imports pytest (~0.1 s) at an
  evaluation's first check; the worker does both before it forks episode and evaluation
  processes, so no episode builds any docs and no evaluation imports pytest."""
  probe = ("from appworld import requester\n"
           "from appworld.apps import get_all_apps\n"
           "built = requester._get_api_name_to_doc.cache_info().misses\n"
           "for app in get_all_apps():\n"
           "    requester._get_api_name_to_doc(app, include_private_apis=True)\n"
           "print(requester._get_api_name_to_doc.cache_info().misses - built)")
  with pool.episode(appworld.read_split(mini_root, "train")[0], "api_docs") as ep:
    assert ep.execute(probe).result().strip() == "0"
    # (agent code may not import sys; AppWorld's requester module holds it)
    loaded = "print('pytest' in requester.sys.modules)"
    assert ep.execute(loaded).result().strip() == "True"


def test_bad_requests_get_clear_errors(pool, mini_root):  # noqa: F811
  with pytest.raises(appworld.EpisodeError, match="doesn't exist"):
    pool.begin("fffffff_9", "bad").result()
  task_id = appworld.read_split(mini_root, "test")[0]
  with pool.episode(task_id, "twice"):
    with pytest.raises(ValueError, match="already live"):
      pool.begin(task_id, "twice")


def test_bad_data_root_fails_at_start_saying_what_is_missing(mini_root, tmp_path):  # noqa: F811
  def start(root):
    outputs = str(tmp_path / f"out_{root.name}")
    with appworld.EnvPool(pool_config(str(root), outputs, num_workers=1)):
      pass

  with pytest.raises(appworld.AppWorldDataError, match="no task directory.*build_mini"):
    start(tmp_path / "empty")
  copy = tmp_path / "copy"
  shutil.copytree(mini_root, copy)
  os.remove(copy / "data" / "base_dbs" / "venmo.db")
  task_id = appworld.read_split(mini_root, "train")[0]
  specs_path = copy / "data" / "tasks" / task_id / "specs.json"
  specs = json.loads(specs_path.read_text())
  specs_path.write_text(json.dumps(specs | {"db_version": "0.0.9"}))
  with pytest.raises(appworld.AppWorldDataError) as error:
    start(copy)
  assert "venmo" in str(error.value) and "0.0.9" in str(error.value)
  assert "appworld download data" in str(error.value)


def test_a_pool_started_in_background_serves_once_ready_and_raises_what_kept_it(
    mini_root, tmp_path):  # noqa: F811
  """`start_in_background` returns once the task files are checked, before AppWorld has
  started (seconds); the first episode waits for the workers. A start that fails (here: the
  template gets no time to answer) raises its error at every episode and at
  `wait_started`, and leaves no process or scratch directory behind."""
  task_id = appworld.read_split(mini_root, "train")[0]
  config = pool_config(mini_root, str(tmp_path / "out"), num_workers=1)
  others = set(pool_templates())  # other pools' templates (a module's fixture)
  began = time.monotonic()
  pool = appworld.EnvPool(config).start_in_background()
  returned = time.monotonic() - began
  try:
    with pool.episode(task_id, "background") as ep:
      ep.execute(gold_solution(mini_root, task_id)).result()
    ready = time.monotonic() - began
    assert len(set(pool_templates()) - others) == 1  # the template; the workers are its
  finally:
    pool.close()
  assert ep.result.success
  assert returned < ready / 5, (returned, ready)

  failing = appworld.EnvPool(dataclasses.replace(config, start_timeout_s=0.01))
  failing.start_in_background()
  for attempt in (lambda: failing.begin(task_id, "never"), failing.wait_started,
                  lambda: failing.begin(task_id, "never again")):
    with pytest.raises(WorkerFault, match="no answer within 0.01 s while starting"):
      attempt()
  assert not set(pool_templates()) - others and failing._scratch is None
  failing.close()  # idempotent


def test_tasks_without_model_hashes_run_and_evaluate(mini_root, tmp_path):  # noqa: F811
  """AppWorld reads a task's dbs/model_hashes.json when it is there and does without it: so
  does the data check."""
  copy = tmp_path / "copy"
  shutil.copytree(mini_root, copy)
  for task in os.listdir(copy / "data" / "tasks"):
    hashes = copy / "data" / "tasks" / task / "dbs" / "model_hashes.json"
    if hashes.exists():
      os.remove(hashes)
  task_id = appworld.read_split(mini_root, "train")[0]
  config = pool_config(str(copy), str(tmp_path / "out"), num_workers=1)
  with appworld.EnvPool(config) as pool:
    with pool.episode(task_id, "no_hashes") as ep:
      ep.execute(gold_solution(mini_root, task_id)).result()
  assert ep.result.success


def test_server_mode_and_no_state_shared_between_episodes(mini_root, tmp_path):  # noqa: F811
  task_id = appworld.read_split(mini_root, "train")[1]
  config = pool_config(mini_root, str(tmp_path), num_workers=1, use_servers=True)
  with appworld.EnvPool(config) as pool:
    with pool.episode(task_id, "defines") as ep:
      ep.execute("def leaked_skill():\n    return 1").result()
    with pool.episode(task_id, "server") as ep:  # same worker, next episode
      assert "NameError" in ep.execute("leaked_skill()").result()
      ep.execute(gold_solution(mini_root, task_id)).result()
  assert ep.result.success


def test_every_task_is_checked_before_any_episode(mini_root, tmp_path):  # noqa: F811
  copy = tmp_path / "copy"
  shutil.copytree(mini_root, copy)
  cache = tmp_path / "checks"
  config = pool_config(str(copy), str(tmp_path / "out"), num_workers=1,
                       data_check_cache=str(cache))
  broken, later = appworld.read_split(mini_root, "test")[-1], appworld.read_split(mini_root,
                                                                                 "train")[0]
  os.remove(copy / "data" / "tasks" / broken / "dbs" / "venmo.jsonl")
  with pytest.raises(appworld.AppWorldDataError, match=f"{broken} \\(dbs/venmo.jsonl\\)"):
    appworld.EnvPool(config).start()
  assert not cache.exists()  # a root that failed is not remembered
  (copy / "data" / "tasks" / broken / "dbs" / "venmo.jsonl").write_text("")
  with appworld.EnvPool(config) as pool:
    assert len(os.listdir(cache)) == 1  # remembered under the root's fingerprint
    # Gone after the check: the episode cannot start, and says it is the environment's fault.
    os.remove(copy / "data" / "tasks" / later / "ground_truth" / "answer.json")
    with pytest.raises(appworld.EpisodeError, match="environment fault.*answer.json"):
      pool.begin(later, "after_check").result()
  with pytest.raises(appworld.AppWorldDataError, match=f"{later} \\(ground_truth/answer.json"):
    appworld.EnvPool(config).start()  # the fingerprint changed: checked again
