"""`python -m <module> [flags]` whose process 1 cannot start an AppWorld episode (as on a host
whose workers cannot open a world: a full disk, a failed fork), every other process as usual.

  python tests/failing_start.py sage_jax.evaluate --config=... --workdir=...
"""

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sage_jax.envs.appworld import pool  # noqa: E402


def _refuse(self, worker, job):
  del self, worker
  job.future.set_exception(pool.EpisodeError(
      f"Cannot start {job.task_id}: the episode process could not open the world"))


if __name__ == "__main__":
  module = sys.argv.pop(1)
  if os.environ.get("JAX_PROCESS_ID") == "1":
    pool.EnvPool._run_episode = _refuse
  runpy.run_module(module, run_name="__main__", alter_sys=True)
