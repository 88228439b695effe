"""`python -m sage_jax.train` with each environment call delayed by a random time drawn
per process, so that the processes of a multi-process run schedule their rollouts
differently (as AppWorld's own timing makes them do on real hosts).

  python tests/delayed_train.py --config=... --workdir=... [--config.a.b=v ...]
"""

import os
import random
import runpy
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sage_jax.envs.appworld import pool  # noqa: E402

MAX_DELAY_S = 0.3


def _delayed(run_command, rng):
  def run(self, worker, episode, command):
    time.sleep(rng.uniform(0, MAX_DELAY_S))
    return run_command(self, worker, episode, command)
  return run


if __name__ == "__main__":
  process = int(os.environ.get("JAX_PROCESS_ID", "0"))
  pool.EnvPool._run_command = _delayed(pool.EnvPool._run_command, random.Random(process))
  runpy.run_module("sage_jax.train", run_name="__main__", alter_sys=True)
