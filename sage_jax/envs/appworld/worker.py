"""A worker process: runs AppWorld in its main thread, at most one live world at a time.

  python -m sage_jax.envs.appworld.worker [--server]

The parent (process.py) sends JSON requests, length-prefixed, on stdin and reads the
answers on the original stdout; AppWorld's own prints go to stderr. With --server the
requests come as HTTP POSTs to 127.0.0.1 instead (the port is announced on the pipe), and
stdin only tells the worker when its parent is gone. The only module of the pool that
imports appworld: it is never imported by the trainer process.
"""

import http.server
import json
import logging
import os
import resource
import select
import shutil
import sys
from multiprocessing.connection import Connection
from typing import Any

from sage_jax.envs.appworld import calltrace
from sage_jax.envs.appworld import data_root

FAILED_PREFIX = "Execution failed."
COMPLETE_TASK = "complete_task"
WARMUP_EXPERIMENT = "_worker_warmup"
RECYCLE_FRACTION = 0.5  # of memory_limit_mb


def _address_space_mb() -> float:
  with open("/proc/self/status") as f:
    line = next(line for line in f if line.startswith("VmSize:"))
  return int(line.split()[1]) / 1024


def truncate(text: str, limit: int) -> str:
  if len(text) <= limit:
    return text
  return text[:limit] + f"\n[... output truncated: {len(text) - limit} more characters]"


def _outputs_root(data: str, outputs: str | None) -> str:
  """An APPWORLD_ROOT whose experiments/ is `outputs` and whose data/ is `data`'s."""
  if not outputs or os.path.abspath(outputs) == data:
    return data
  os.makedirs(outputs, exist_ok=True)
  link = os.path.join(outputs, "data")
  try:
    os.symlink(os.path.join(data, "data"), link)
  except FileExistsError:
    if os.path.realpath(link) != os.path.realpath(os.path.join(data, "data")):
      raise data_root.AppWorldDataError(f"{link} exists and is not a link to {data}/data.")
  return outputs


class Session:
  """One worker's AppWorld: starts, steps, evaluates and closes worlds."""

  def __init__(self, settings: dict[str, Any]):
    self.settings = settings
    self.world = None
    self.tracer: calltrace.CallTracer | None = None  # the live world's call records
    # Asking AppWorld whether the task is completed costs an API request (~7 ms); only
    # code that mentions complete_task (directly or in a function it defined) can do it.
    self.may_complete = False

  def start(self, task_id: str, experiment: str, library_code: str | None) -> dict:
    from appworld import AppWorld

    self.close()
    s = self.settings
    world = AppWorld(task_id=task_id, experiment_name=experiment,
                     max_interactions=s["max_interactions"],
                     timeout_seconds=s["timeout_seconds"], random_seed=s["random_seed"])
    self.world = world
    self.tracer = calltrace.CallTracer()
    self.may_complete = False
    library_output = library_ok = None
    if library_code:
      self.may_complete = COMPLETE_TASK in library_code
      # Runs like agent code (same guards, timeout and logs) but is not an agent step.
      output, _ = self.tracer.run(world.execute, library_code, library=True)
      library_output = truncate(output, s["max_output_chars"])
      library_ok = not library_output.startswith(FAILED_PREFIX)
      world.num_interactions -= 1
    descriptions = world.requester.request("api_docs", "show_app_descriptions", track=False)
    supervisor = world.task.supervisor
    return {
      "task_id": task_id,
      "instruction": world.task.instruction,
      "supervisor": {k: supervisor[k] for k in
                     ("first_name", "last_name", "email", "phone_number")},
      "app_descriptions": {d["name"]: d["description"] for d in descriptions},
      "datetime": world.task.datetime.isoformat(),
      "library_output": library_output,
      "library_ok": library_ok,
    }

  def _live_world(self):
    if self.world is None:
      raise RuntimeError("No live world: start an episode first.")
    return self.world

  def execute(self, code: str) -> dict:
    world = self._live_world()
    output, trace = self.tracer.run(world.execute, code)
    self.may_complete = self.may_complete or COMPLETE_TASK in code
    return {"output": truncate(output, self.settings["max_output_chars"]),
            "task_completed": self.may_complete and bool(world.task_completed()),
            "num_steps": world.num_interactions, "trace": trace}

  def evaluate(self) -> dict:
    tracker = self._live_world().evaluate(suppress_errors=True)
    return {"success": bool(tracker.success), "num_passed": tracker.pass_count,
            "num_failed": tracker.num_tests - tracker.pass_count,
            "failed_requirements": [f["requirement"] for f in tracker.failures]}

  def close(self) -> dict:
    if self.world is not None:
      world, self.world = self.world, None
      world.close()
      if not self.settings["keep_outputs"]:
        shutil.rmtree(world.output_directory, ignore_errors=True)
    # Agent code can leave memory behind in the shell namespace (IPython keeps it between
    # worlds); past half the limit the pool replaces this process.
    limit = self.settings["memory_limit_mb"]
    return {"recycle": bool(limit) and _address_space_mb() > RECYCLE_FRACTION * limit}

  def handle(self, request: dict) -> dict:
    """Runs one request; AppWorld's exceptions come back as errors, not crashes."""
    op = request.pop("op")
    try:
      method = {"start": self.start, "execute": self.execute, "evaluate": self.evaluate,
                "close": self.close}[op]
      return {"ok": True, **method(**request)}
    except Exception as e:  # noqa: BLE001 - any AppWorld failure goes back to the caller
      return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def _init(settings: dict[str, Any]) -> Session:
  """Applies the memory limit, points AppWorld at the data, checks it, warms imports."""
  if settings["memory_limit_mb"]:
    limit = settings["memory_limit_mb"] * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  logging.getLogger("httpx").setLevel(logging.WARNING)
  from appworld import AppWorld
  from appworld.apps import get_all_apps
  from appworld.common.constants import DB_VERSION
  data = settings["appworld_root"]
  data_root.check(data, DB_VERSION, get_all_apps())
  os.environ["APPWORLD_ROOT"] = _outputs_root(data, settings["outputs_root"])
  # The first world of a process pays for lazy imports (~seconds): pay it now, not in the
  # first episode.
  task_id = sorted(os.listdir(os.path.join(data, "data", "tasks")))[0]
  with AppWorld(task_id=task_id, experiment_name=f"{WARMUP_EXPERIMENT}_{os.getpid()}") as world:
    shutil.rmtree(world.base_output_directory, ignore_errors=True)
  return Session(settings)


def _serve_pipe(session: Session, reader: Connection, writer: Connection) -> None:
  while True:
    try:
      request = json.loads(reader.recv_bytes())
    except EOFError:
      return
    writer.send_bytes(json.dumps(session.handle(request)).encode())


def _serve_http(session: Session, reader: Connection, writer: Connection) -> None:
  """HTTP on 127.0.0.1, one request at a time in this (main) thread."""

  class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
      body = self.rfile.read(int(self.headers["Content-Length"]))
      answer = json.dumps(session.handle(json.loads(body))).encode()
      self.send_response(200)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(answer)))
      self.end_headers()
      self.wfile.write(answer)

    def log_message(self, *args):
      del args

  server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
  writer.send_bytes(json.dumps({"port": server.server_address[1]}).encode())
  while True:
    ready, _, _ = select.select([server.socket, reader.fileno()], [], [])
    if reader.fileno() in ready:  # the parent closed the pipe or died
      return
    server.handle_request()


def main() -> None:
  reader = Connection(os.dup(0), writable=False)
  writer = Connection(os.dup(1), readable=False)
  os.dup2(2, 1)  # AppWorld's prints go to stderr, never into the protocol
  settings = json.loads(reader.recv_bytes())
  try:
    session = _init(settings)
  except data_root.AppWorldDataError as e:
    writer.send_bytes(json.dumps({"ok": False, "fatal": str(e)}).encode())
    return
  writer.send_bytes(json.dumps({"ok": True, "pid": os.getpid()}).encode())
  if "--server" in sys.argv[1:]:
    _serve_http(session, reader, writer)
  else:
    _serve_pipe(session, reader, writer)


if __name__ == "__main__":
  main()
