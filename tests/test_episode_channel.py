"""The channel from an episode process to its worker is within reach of the agent's code (it
runs in that process); whatever the code writes there ends its episode, unscored, and is
never taken as an answer. The code below passes the code guard and AppWorld's own: it finds
the channel among its open descriptors and writes to it with `os.writev`."""

import json

import pytest

from sage_jax.agent.skills import BlockTrace, SkillTracker, analyze
from sage_jax.envs import appworld
from tests.appworld_fixtures import all_task_ids, gold_solution
from tests.appworld_fixtures import mini_root  # noqa: F401 - pytest fixture
from tests.appworld_fixtures import pool_config

LIBRARY = 'def my_skill(x):\n    """A library skill."""\n    return apis.supervisor.show_profile()\n'
WRITE_TO_CHANNEL = """import os
for fd in range(3, 64):
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        continue
    if mode & 0o170000 == 0o140000 and os.get_blocking(fd):
        os.writev(fd, [{raw!r}])
print('the real output of this block')
"""


def _message(answer: dict) -> bytes:
  body = json.dumps(answer).encode()
  return len(body).to_bytes(4, "big") + body


# An answer claiming the task completed and the library skill used, with its call records.
FORGED = _message({"ok": True, "output": "forged", "task_completed": True, "trace": {
    "block": 0, "complete": True, "calls": [{"block": "library", "line": 1, "name": "my_skill",
                                             "returned": 1, "raised": 0, "discarded": 0}]}})


@pytest.mark.parametrize("raw, why", [
    (FORGED, "a message that is not the answer"),
    # an environment failure made up: the episode would have been left out of training
    (_message({"ok": False, "error": "made up"}), "a message that is not the answer"),
    # -1 and an 8-byte size of 1 TiB: read as is, the worker's memory
    ((2**32 - 1).to_bytes(4, "big") + (2**40).to_bytes(8, "big"), "a message of 1099511627776"),
    # a size with nothing behind it: read as is, the worker waited for good
    ((50 * 2**20).to_bytes(4, "big"), "a message cut short"),
], ids=["forged_answer", "forged_failure", "huge_size", "size_without_message"])
def test_what_the_code_writes_to_the_channel_ends_its_episode_unscored(mini_root, tmp_path,  # noqa: F811
                                                                        raw, why):
  config = pool_config(mini_root, str(tmp_path / "outputs"), num_workers=1, timeout_seconds=5,
                       kill_grace_s=1.0)
  tasks = all_task_ids(mini_root)
  with appworld.EnvPool(config) as pool:
    with pool.episode(tasks[0], "channel", library_code=LIBRARY) as ep:
      code = WRITE_TO_CHANNEL.format(raw=raw)
      output = ep.execute(code).result()
      trace = ep.last_trace
      later = ep.execute("print('next block')").result()
    assert output.startswith("Execution failed.") and "forged" not in output
    assert "The code wrote to the episode's channel to the environment" in output
    assert why in output and later == output and not ep.task_completed
    assert ep.result.error is None and ep.result.success is False
    assert "wrote to its channel to the environment" in ep.result.evaluation.refused
    tracker = SkillTracker({"my_skill": analyze(LIBRARY).functions[0].calls})
    tracker.observe(code, BlockTrace.from_dict(trace) if trace else None)
    assert tracker.events().used == ()
    # The worker goes on: the next episode's gold solution passes.
    with pool.episode(tasks[1], "after") as ep:
      ep.execute(gold_solution(mini_root, tasks[1])).result()
    assert ep.result.success and pool.worker_restarts == 0


def test_a_print_too_big_for_the_process_ends_the_episode_as_the_codes_failure(mini_root,  # noqa: F811
                                                                          tmp_path):
  """The code's own print succeeds; AppWorld's capture and log of it run out of the episode
  process's memory. That is the code's doing: the episode ends and is scored, not counted
  as an environment failure (which would leave it out of training)."""
  config = pool_config(mini_root, str(tmp_path / "outputs"), num_workers=1, memory_limit_mb=1024)
  task = all_task_ids(mini_root)[0]
  with appworld.EnvPool(config) as pool:
    with pool.episode(task, "big_print") as ep:
      output = ep.execute("s = 'x' * (300 * 2**20)\nprint(s)").result()
    assert output.startswith("Execution failed.") and "MemoryError" in output
    assert "the limit is 1024 MB" in output and "This episode has ended." in output
    assert ep.result.error is None and ep.result.success is False
    assert pool.worker_restarts == 0
