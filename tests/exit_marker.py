"""`python -m MODULE ARGS...` that first prints EXIT_MARKER to stderr when the interpreter's
exit hooks start (before JAX's own): what a command did before or after that point shows.

  python tests/exit_marker.py MODULE [ARGS...]
"""

import atexit
import runpy
import sys

import jax  # noqa: F401 - its exit hook is registered now, so this one runs before it

EXIT_MARKER = "exit hooks start"

if __name__ == "__main__":
  atexit.register(lambda: print(EXIT_MARKER, file=sys.stderr, flush=True))
  sys.argv = sys.argv[1:]
  runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
