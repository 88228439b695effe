"""Agent code that misbehaves: a clear observation or an error result, and the pool goes on."""

import asyncio
import random

import pytest

from sage_jax.envs import appworld
from tests.appworld_fixtures import all_task_ids
from tests.appworld_fixtures import gold_solution
from tests.appworld_fixtures import mini_root  # noqa: F401 - pytest fixture
from tests.appworld_fixtures import pool_config

# Spins in C (builtin sum over a range never checks for signals), where AppWorld's SIGALRM
# cannot interrupt it: only the pool's per-call timeout ends it.
C_LEVEL_HANG = "print(sum(range(10**13)))"

# code -> what the observation says (None: the worker dies and the episode ends in error)
FAULTS = {
  "infinite_loop": ("while True:\n    pass", "timed out after"),
  "import_subprocess": ("import subprocess\nsubprocess.run(['ls'])", "subprocess"),
  "os_system": ("import os\nos.system('ls')", "os.system"),
  "open_file": ("print(open('/etc/passwd').read())", "open"),
  "huge_print": ("print('x' * 50_000_000)", "output truncated"),
  "memory_bomb": ("chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 2**20))",
                  "MemoryError"),
  "os_exit": ("import os\nos._exit(1)", "os._exit"),
  "exception": ("raise ValueError('agent bug')", "ValueError: agent bug"),
  "abort": ("import os\nos.abort()", None),
  "c_level_hang": (C_LEVEL_HANG, None),
}


@pytest.fixture(scope="module")
def pool(mini_root, tmp_path_factory):  # noqa: F811
  outputs = str(tmp_path_factory.mktemp("fault_outputs"))
  # Shorter limits than elsewhere, so that the loop and hang faults resolve in seconds.
  config = pool_config(mini_root, outputs, timeout_seconds=5, call_timeout_s=15.0,
                       keep_outputs=False)
  with appworld.EnvPool(config) as pool:
    yield pool


def _check_gold_still_passes(pool, root, task_id, experiment):
  with pool.episode(task_id, experiment) as ep:
    ep.execute(gold_solution(root, task_id)).result()
  assert ep.result.success, ep.result


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fault_gives_observation_or_error_result(pool, mini_root, fault):  # noqa: F811
  code, expected = FAULTS[fault]
  task_id = all_task_ids(mini_root)[0]
  with pool.episode(task_id, f"fault_{fault}") as ep:
    observation = ep.execute(code).result()
    assert len(observation) <= pool.config.max_output_chars + 100
    if expected is None:
      assert ep.error and "EnvironmentError" in observation
      assert ep.execute("print(1)").result() == observation  # the episode has ended
    else:
      assert expected in observation, observation[:300]
      assert ep.error is None
  result = ep.result
  assert result is not None and result in pool.results
  assert (result.error is not None) == (expected is None)
  assert not result.success
  _check_gold_still_passes(pool, mini_root, all_task_ids(mini_root)[1], f"after_{fault}")


@pytest.mark.slow
def test_hundred_episodes_with_random_faults_give_hundred_records(pool, mini_root):  # noqa: F811
  rng = random.Random(0)
  task_ids = all_task_ids(mini_root)
  cheap = ["import_subprocess", "os_system", "open_file", "os_exit", "exception",
           "infinite_loop"]
  plan = []
  for i in range(100):
    task_id = task_ids[i % len(task_ids)]
    roll = rng.random()
    if roll < 0.05:
      plan.append((task_id, FAULTS["abort"][0]))
    elif roll < 0.3:
      plan.append((task_id, FAULTS[rng.choice(cheap)][0]))
    else:
      plan.append((task_id, gold_solution(mini_root, task_id)))
  before = len(pool.results)

  async def one(i, task_id, code):
    async with pool.episode(task_id, f"random_{i}") as ep:
      await ep.execute(code)
      await ep.evaluate()
    return ep.result

  async def run():
    return await asyncio.gather(*(one(i, t, c) for i, (t, c) in enumerate(plan)))

  results = asyncio.run(run())
  assert len(results) == 100 and all(r is not None for r in results)
  assert len(pool.results) - before == 100
  golds = [r for r, (t, c) in zip(results, plan) if c == gold_solution(mini_root, t)]
  assert all(r.success for r in golds), [r for r in golds if not r.success]
  assert any(r.error for r in results)
