"""The worker's call records rest on CPython's trace events and bytecode (which instruction a
frame stands at when it returns, yields or is closed), which change between versions: the
same blocks must give the same records on every CPython the project supports that is
installed here (3.11 upward, found on PATH or under pyenv), IPython taken from this
environment."""

import glob
import json
import os
import shutil
import subprocess
import sys

import IPython
import pytest

import sage_jax.envs.appworld.calltrace as calltrace

# Runs each block after the library (each time with a new tracer) in an IPython shell;
# prints the records as JSON. `request` stands for AppWorld's `Requester.request`.
SCRIPT = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("calltrace", sys.argv[1])
calltrace = importlib.util.module_from_spec(spec)
spec.loader.exec_module(calltrace)
from IPython.core.interactiveshell import InteractiveShell
library, blocks = json.loads(sys.argv[2])
def request(_app_name, _api_name):
  return {}
shell = InteractiveShell()
shell.user_ns["request"] = request
run = lambda c: shell.run_cell(c, silent=True)
records = []
for code in blocks:
  tracer = calltrace.CallTracer(request.__code__)
  tracer.run(run, library, library=True)
  _, trace = tracer.run(run, code)
  records.append(sorted((c["name"], c["returned"], c["raised"], c["discarded"], c["requested"])
                        for c in trace["calls"]))
sys.__stdout__.write("RECORDS" + json.dumps([list(sys.version_info[:2]), records]))
"""

LIBRARY = """
def double(x):
    return 2 * x

def pages(n, fail_at=None):
    for i in range(n):
        if i == fail_at:
            raise ValueError(i)
        yield double(i)

def swallow():
    try:
        double(None + 1)
    except TypeError:
        return 0

def guarded(n, fail_at=None):
    try:
        for i in range(n):
            if i == fail_at:
                raise ValueError(i)
            yield double(i)
    finally:
        pass

def quits():
    yield double(1)
    raise GeneratorExit

class Pause:
    def __await__(self):
        yield

async def fetch(x, fail=False):
    await Pause()
    if fail:
        raise ValueError(x)
    return double(x)

def asks(x):
    request("app", "api")
    return double(x)

def reads_docs():
    return request("api_docs", "show_api_doc")

def asking_pages(n):
    for i in range(n):
        yield asks(i)

def drive(coroutine):  # an event loop's part (AppWorld's agent code may not import asyncio)
    while True:
        try:
            coroutine.send(None)
        except StopIteration as stop:
            return stop.value
"""

# block -> (names whose calls returned, names called that never returned)
BLOCKS = {
    "double(2)\n": ({"double"}, set()),
    "try:\n    double(None)\nexcept TypeError:\n    pass\n": (set(), {"double"}),
    "swallow()\n": ({"swallow"}, set()),
    "def twice(x):\n    y = double(x)\n    raise ValueError(y)\n\ntry:\n    twice(1)\n"
    "except ValueError:\n    pass\n": (set(), {"double", "twice"}),
    "print(list(pages(3)))\n": ({"double", "pages"}, set()),
    "try:\n    list(pages(3, fail_at=1))\nexcept ValueError:\n    pass\n":
        (set(), {"double", "pages"}),
    "for page in pages(5):\n    break\n": ({"double", "pages"}, set()),
    "for _ in range(3):\n    for page in pages(5):\n        break\n": ({"double", "pages"}, set()),
    "print(next(pages(5)))\n": ({"double", "pages"}, set()),
    "kept = pages(2)\n": (set(), set()),
    "try:\n    list(guarded(3, fail_at=1))\nexcept ValueError:\n    pass\n":
        (set(), {"double", "guarded"}),
    "for page in guarded(5):\n    break\n": ({"double", "guarded"}, set()),
    "try:\n    list(quits())\nexcept BaseException:\n    pass\n": (set(), {"double", "quits"}),
    "print(drive(fetch(2)))\n": ({"double", "drive", "fetch"}, set()),
    # (distinct names: in the one shell that runs every block, objects outlive their block)
    "paused = fetch(1)\npaused.send(None)\n": (set(), {"fetch"}),
    "closed = fetch(1)\nclosed.send(None)\nclosed.close()\n": (set(), {"fetch"}),
    "try:\n    drive(fetch(2, fail=True))\nexcept ValueError:\n    pass\n":
        (set(), {"drive", "fetch"}),
    "def first():\n    value = next(pages(5))\n    raise ValueError(value)\n\ntry:\n    first()\n"
    "except ValueError:\n    pass\n": (set(), {"double", "first", "pages"}),
}
# Blocks whose functions call `request`, which only the bare shell above binds (AppWorld's
# worker has the real one: tests/test_skill_events.py), in the same form.
REQUEST_BLOCKS = {
    "asks(1)\n": ({"asks", "double"}, set()),
    "reads_docs()\n": ({"reads_docs"}, set()),
    "try:\n    asks(None)\nexcept TypeError:\n    pass\n": (set(), {"asks", "double"}),
    "print(list(asking_pages(2)))\n": ({"asking_pages", "asks", "double"}, set()),
    "def outer():\n    return next(asking_pages(3))\n\nouter()\n":
        ({"asking_pages", "asks", "double", "outer"}, set()),
}
# block -> names with a returned call during which an app request (not `api_docs`) was made;
# none for the blocks not named here.
REQUESTED = {
    "asks(1)\n": {"asks"},  # `double` ran after the request
    "print(list(asking_pages(2)))\n": {"asking_pages", "asks"},
    "def outer():\n    return next(asking_pages(3))\n\nouter()\n":
        {"asking_pages", "asks", "outer"},
}


def _interpreters() -> dict[tuple[int, int], str]:
  """Other CPython 3.11+ interpreters that run here, by version."""
  candidates = [shutil.which(f"python3.{minor}") for minor in range(11, 20)]
  root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
  candidates += sorted(glob.glob(os.path.join(root, "versions", "3.*", "bin", "python3")))
  found = {}
  for path in filter(None, candidates):
    try:
      out = subprocess.run([path, "-c", "import sys; print(*sys.version_info[:2])"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
      continue
    if out.returncode == 0:
      version = tuple(int(v) for v in out.stdout.split())
      if version >= (3, 11) and version != sys.version_info[:2]:
        found.setdefault(version, path)
  return found


def _records(python: str) -> list:
  env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(IPython.__file__))}
  out = subprocess.run([python, "-s", "-c", SCRIPT, calltrace.__file__,
                        json.dumps([LIBRARY, list(BLOCKS | REQUEST_BLOCKS)])],
                       capture_output=True, text=True, timeout=300, env=env)
  assert out.returncode == 0 and "RECORDS" in out.stdout, out.stderr[-3000:]
  return json.loads(out.stdout.split("RECORDS", 1)[1])[1]


def test_call_records_are_what_ran():
  blocks = BLOCKS | REQUEST_BLOCKS
  for (code, (returned, failed)), calls in zip(blocks.items(), _records(sys.executable)):
    assert {name for name, r, _, _, _ in calls if r} == returned, code
    assert {name for name, r, _, _, _ in calls if not r} == failed, code
    assert {name for name, *_, requested in calls if requested} == REQUESTED.get(code, set()), code


def test_call_records_are_the_same_on_every_installed_cpython():
  others = _interpreters()
  if not others:
    pytest.skip("no other CPython 3.11+ installed")
  ours = _records(sys.executable)
  for version, python in sorted(others.items()):
    theirs = _records(python)
    for code, mine, other in zip(BLOCKS | REQUEST_BLOCKS, ours, theirs):
      assert other == mine, (version, code)
