"""Storage that lags behind on one host, simulated in one process of a local multi-process
run: NFS attribute caches and eventually consistent buckets may, for a while, leave a
directory's newest entries out of its listing, or not show a file that the other hosts see.

  python tests/lagging_storage.py PROCESS FILE MODULE [ARGS...]

runs `python -m MODULE ARGS...`, in which process PROCESS (JAX_PROCESS_ID) does not see FILE
(`lagging_file`).
"""

from __future__ import annotations

import os
import runpy
import sys

from etils import epath

_LOCAL = type(epath.Path("/"))  # local paths: their methods are replaced here


def lagging_listing(directory: str) -> None:
  """Listings of `directory` leave its steps out; files are still read and written by name."""
  iterdir = _LOCAL.iterdir

  def lagging_iterdir(self):
    entries = iterdir(self)
    if os.path.realpath(self) != os.path.realpath(directory):
      return entries
    return (entry for entry in entries if not entry.name.isdigit())

  _LOCAL.iterdir = lagging_iterdir


def lagging_file(path: str) -> None:
  """`path` is not there yet: it does not exist, for `storage.read_json` and its callers."""
  exists = _LOCAL.exists

  def lagging_exists(self):
    return os.path.realpath(self) != os.path.realpath(path) and exists(self)

  _LOCAL.exists = lagging_exists


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  process, file, module = sys.argv[1:4]
  if os.environ.get("JAX_PROCESS_ID", "0") == process:
    lagging_file(file)
  sys.argv = sys.argv[3:]
  runpy.run_module(module, run_name="__main__", alter_sys=True)
