"""Checks an entry point's command line before a shell launcher starts it on every host:

  python launch/check.py MODULE [ARGS...]

exits 0 when the command's --config file loads with its --config.<key> overrides (and, for a
training run, resolves whole), else with one line naming the problem (`common.check_command`).
Run from the code checkout, where the entry point will run.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch import common  # noqa: E402

if __name__ == "__main__":
  if len(sys.argv) < 2:
    sys.exit(__doc__)
  common.check_or_exit(sys.argv[1], sys.argv[2:])
