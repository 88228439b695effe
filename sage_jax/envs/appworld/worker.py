"""The worker template and its workers: each worker serves one episode at a time, each in a
process forked from it.

  python -m sage_jax.envs.appworld.worker   (started by process.py, one per pool)

The pool starts one *template* process per pool: a fresh interpreter that imports AppWorld,
checks the data and the sandbox, and builds what every world needs (~12 CPU-seconds, most
of it FastAPI building the apps' routes). Workers are forks of it, made on request in
milliseconds: a pool of N workers pays for one such start instead of N, and a worker
replaced after a fault costs nothing. Workers die with their template (PR_SET_PDEATHSIG),
and the template with the pool (its channel closes).

A worker itself never runs agent code and never loads a task's ground truth: each episode's
world lives in an episode process (confined by the sandbox, see episode_process.py) and
each evaluation in a confined fork of its own (evaluation.py). Worlds run in those
processes' main threads, so AppWorld's SIGALRM timeout works.

The template's stdin is a Unix packet socket to the pool: the settings come first, then
fork requests (each carrying the new worker's end of a socket pair) and exit-status
requests; one JSON answer each. A worker reads length-prefixed JSON requests on its own
socket and answers there; AppWorld's prints go to its log. With `use_servers` the requests
come as HTTP POSTs to 127.0.0.1 instead (the port is announced on the socket), which then
only tells the worker when the pool is gone. The only module of the pool that imports
appworld: it is never imported by the trainer process.
"""

import gc
import http.server
import json
import logging
import os
import resource
import select
import shutil
import signal
import socket
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from sage_jax.envs.appworld import calltrace
from sage_jax.envs.appworld import code_guard
from sage_jax.envs.appworld import data_root
from sage_jax.envs.appworld import episode_process
from sage_jax.envs.appworld import evaluation
from sage_jax.envs.appworld import sandbox

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
  """One episode's world, inside its episode process (see episode_process.py)."""

  def __init__(self, settings: dict[str, Any]):
    self.settings = settings
    self.world = None
    self.tracer: calltrace.CallTracer | None = None  # the live world's call records
    # Asking AppWorld whether the task is completed costs an API request (~7 ms); only
    # code that mentions complete_task (directly or in a function it defined) can do it.
    self.may_complete = False

  def start(self, task_id: str, experiment: str) -> dict:
    """Opens the world without its ground truth: this process runs agent code."""
    from appworld import AppWorld

    s = self.settings
    world = AppWorld(task_id=task_id, experiment_name=experiment,
                     max_interactions=s["max_interactions"],
                     timeout_seconds=s["timeout_seconds"], random_seed=s["random_seed"],
                     load_ground_truth=False)
    _saves_only_in(world, os.getpid())
    if s["code_guard"]:
      code_guard.guard_forward_references()
    self.world = world
    self.tracer = calltrace.CallTracer(type(world.requester).request.__code__)
    descriptions = world.requester.request("api_docs", "show_app_descriptions", track=False)
    supervisor = world.task.supervisor
    return {
      "task_id": task_id,
      "instruction": world.task.instruction,
      "supervisor": {k: supervisor[k] for k in
                     ("first_name", "last_name", "email", "phone_number")},
      "app_descriptions": {d["name"]: d["description"] for d in descriptions},
      "datetime": world.task.datetime.isoformat(),
    }

  def _execute(self, code: str) -> str:
    """AppWorld's execute, behind the code guard (code_guard.py) when it is on."""
    why = code_guard.refusal(code) if self.settings["code_guard"] else None
    if why is not None:
      return f"{FAILED_PREFIX} Traceback:\n{why}"
    try:
      return self.world.execute(code)
    except UnicodeEncodeError as e:
      if not _raised_in(e, ("save_logs",)):
        raise
      # The block ran and its state was saved; its log could not be written: text that
      # UTF-8 cannot hold (a lone surrogate the code printed). The log and the observation
      # take a replacement, and the episode goes on (else every later log fails too).
      entry = self.world.environment_io[-1]
      for key in ("input", "output"):
        entry[key] = entry[key].encode("utf-8", "replace").decode("utf-8")
      self.world.save_logs()
      self.world.requester.reset_request_count()
      return entry["output"]

  def install(self, library_code: str) -> dict:
    """Runs a skill library like agent code (same guards, timeout and logs), not as a step."""
    self.may_complete = COMPLETE_TASK in library_code
    output, _ = self.tracer.run(self._execute, library_code, library=True)
    output = truncate(output, self.settings["max_output_chars"])
    self.world.num_interactions -= 1
    return {"library_output": output, "library_ok": not output.startswith(FAILED_PREFIX)}

  def execute(self, code: str) -> dict:
    output, trace = self.tracer.run(self._execute, code)
    self.may_complete = self.may_complete or COMPLETE_TASK in code
    return {"output": truncate(output, self.settings["max_output_chars"]),
            "task_completed": self.may_complete and bool(self.world.task_completed()),
            "trace": trace}

  def serve(self, channel: Connection) -> None:
    """Answers the worker's requests until it closes the channel."""
    own_pid = os.getpid()
    while True:
      try:
        request = json.loads(channel.recv_bytes())
      except EOFError:
        return
      op, token = request.pop("op"), request.pop("token")
      try:
        answer = {"ok": True, **{"start": self.start, "install": self.install,
                                 "execute": self.execute}[op](**request)}
      except MemoryError as e:  # in AppWorld's handling of what the code made (its output)
        answer = {"ok": False, "out_of_memory": True,
                  "error": "MemoryError" + (f": {e}" if str(e) else "")}
      except Exception as e:  # noqa: BLE001 - AppWorld's refusals go back to the pool
        answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
      _end_if_forked_from(own_pid)  # a fork of agent code must not answer for the episode
      channel.send_bytes(json.dumps({**answer, "token": token}).encode())


def _raised_in(error: BaseException, functions: tuple[str, ...]) -> bool:
  """Whether one of `functions` is on `error`'s traceback."""
  tb = error.__traceback__
  while tb is not None:
    if tb.tb_frame.f_code.co_name in functions:
      return True
    tb = tb.tb_next
  return False


def _end_if_forked_from(pid: int) -> None:
  """Ends this process if it is not `pid` (the episode process) but a fork of it."""
  if os.getpid() != pid:
    os._exit(0)


def _saves_only_in(world, pid: int) -> None:
  """A process that agent code forks is a copy of the episode process, and AppWorld saves
  the world's databases and logs (deleting what is there first) after every execution: in
  such a copy, the first save ends the process instead, so that it never races the episode
  over the episode's files."""

  def only_in_pid(method):
    def guarded(*args, **kwargs):
      _end_if_forked_from(pid)
      return method(*args, **kwargs)
    return guarded

  world._save_state = only_in_pid(world._save_state)
  world.save_logs = only_in_pid(world.save_logs)


class Worker:
  """Serves the pool's requests: one episode process at a time, evaluations in forks."""

  def __init__(self, settings: dict[str, Any], data: str, apps: list[str]):
    self.settings = settings
    self.data = data
    self.apps = apps
    self.episode: episode_process.EpisodeProcess | None = None
    self.task_id = self.experiment = self.output_directory = None
    self.ended: str | None = None  # the observation of every execution once it has ended
    self.refused: str | None = None  # why the episode's state will not be scored
    self.task_completed = False

  def _end_episode_process(self) -> None:
    if self.episode is not None:
      self.episode.kill()
      self.episode = None

  def _agent_call(self, request: dict) -> dict | None:
    """A request that runs agent code, under a deadline this process keeps; None once the
    episode has ended (self.ended says why)."""
    s = self.settings
    try:
      answer = self.episode.call(request, s["timeout_seconds"] + s["kill_grace_s"])
      if answer.get("out_of_memory"):
        raise episode_process.EpisodeEnded(answer["error"], cause="memory")
    except episode_process.EpisodeEnded as e:
      self._end_episode_process()
      if e.cause == "timeout":
        why = (f"Execution timed out after {s['timeout_seconds']} seconds; the code was "
               f"still running {s['kill_grace_s']:g} s later and was stopped with its process")
      elif e.cause == "disk":
        why = (f"The episode's files took too much disk: {e}; the code was stopped with its "
               "process")
        # Its disk is freed now, whatever keep_outputs says; there is no state left to score.
        shutil.rmtree(self.output_directory, ignore_errors=True)
        self.refused = f"the episode wrote more than its disk budget ({e})"
      elif e.cause == "channel":
        why = (f"The code wrote to the episode's channel to the environment ({e}); it was "
               "stopped with its process")
        self.refused = f"the episode's code wrote to its channel to the environment ({e})"
      elif e.cause == "memory":
        why = (f"What the code made outgrew the episode's memory ({e}; the limit is "
               f"{s['memory_limit_mb']} MB); the code was stopped with its process")
      else:
        why = f"The code ended its own process ({e})"
      self.ended = f"{FAILED_PREFIX} Traceback:\n{why}. This episode has ended."
      return None
    if not answer["ok"]:
      # AppWorld raised in the process the episode's code runs in, after that code ran there
      # (its save or its logs: the code may have changed the modules they use). The code's
      # failure, not the environment's: else breaking its world would leave an episode out
      # of training.
      self._end_episode_process()
      self.refused = f"AppWorld failed in the process the episode's code ran in: {answer['error']}"
      self.ended = (f"{FAILED_PREFIX} Traceback:\nAppWorld failed after the code ran "
                    f"({answer['error']}). This episode has ended.")
      return None
    return answer

  def start(self, task_id: str, experiment: str, library_code: str | None) -> dict:
    from appworld.common.path_store import path_store

    self.close()
    missing = data_root.task_problems(self.data, task_id, self.apps)
    if os.path.isdir(os.path.join(episode_process.tasks_directory(self.data), task_id)) and missing:
      raise data_root.AppWorldDataError(
        f"the data of task {task_id} is incomplete (an environment fault, not the agent's): "
        f"missing or unreadable {missing}")
    self.task_id, self.experiment, self.ended, self.refused, self.task_completed = (
      task_id, experiment, None, None, False)
    self.output_directory = os.path.join(path_store.experiment_outputs, experiment, "tasks",
                                         task_id)
    read = [p for p in episode_process.episode_read_paths(self.data, task_id)
            if os.path.exists(p)]
    s = self.settings
    self.episode = episode_process.EpisodeProcess(
      Session(s).serve, read_paths=episode_process.sandbox_read_paths() + read,
      write_dir=self.output_directory, confine=s["sandbox"] != "off",
      hide=episode_process.tasks_view(self.data, task_id) if s["hide_data"] else None,
      max_write_bytes=None if s["max_output_mb"] is None else s["max_output_mb"] * 2**20)
    try:
      answer = self.episode.call({"op": "start", "task_id": task_id,
                                  "experiment": experiment}, None)
    except episode_process.EpisodeEnded as e:
      raise RuntimeError(f"the episode process could not open the world: {e}") from e
    if not answer.pop("ok"):
      raise RuntimeError(answer["error"])
    answer |= {"library_output": None, "library_ok": None}
    if library_code:
      installed = self._agent_call({"op": "install", "library_code": library_code})
      if installed is None:
        answer |= {"library_output": self.ended, "library_ok": False}
      else:
        answer |= {"library_output": installed["library_output"],
                   "library_ok": installed["library_ok"]}
    return answer

  def _require_episode(self) -> None:
    if self.task_id is None:
      raise RuntimeError("No live world: start an episode first.")

  def execute(self, code: str) -> dict:
    self._require_episode()
    if self.ended is not None:  # nothing runs any more: not a step
      return {"output": self.ended, "task_completed": self.task_completed, "executed": False,
              "trace": None}
    answer = self._agent_call({"op": "execute", "code": code})
    if answer is None:  # the code ended its episode: no call records came back
      return {"output": self.ended, "task_completed": self.task_completed, "executed": True,
              "trace": None}
    self.task_completed = answer["task_completed"]
    return {"output": answer["output"], "task_completed": self.task_completed,
            "executed": True, "trace": answer["trace"]}

  def evaluate(self) -> dict:
    """AppWorld's evaluation of the state the episode saved (evaluation.py); `refused`
    says why it was not scored when the episode's own files are to blame."""
    self._require_episode()
    s = self.settings
    if self.refused is not None:
      result = {"refused": self.refused}
    else:
      result = evaluation.evaluate(self.data, self.apps, self.task_id, self.experiment,
                                   os.path.join(self.output_directory, "dbs"),
                                   confine=s["sandbox"] != "off",
                                   timeout=s["evaluation_timeout_s"], scratch_dir=s["scratch_dir"])
    if "refused" in result:
      return {"success": False, "num_passed": 0, "num_failed": 0, "failed_requirements": [],
              "refused": result["refused"]}
    passed = len(result["passes"])
    return {"success": bool(result["success"]), "num_passed": passed,
            "num_failed": result["num_tests"] - passed,
            "failed_requirements": [f["requirement"] for f in result["failures"]]}

  def close(self) -> dict:
    self._end_episode_process()
    if self.output_directory is not None and not self.settings["keep_outputs"]:
      shutil.rmtree(self.output_directory, ignore_errors=True)
    self.task_id = self.experiment = self.output_directory = None
    # Evaluations run in forks and episodes in their own processes; this one should not
    # grow, but if it does, past half the limit the pool replaces it.
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


def _init_template(settings: dict[str, Any]) -> tuple[str, list[str]]:
  """Applies the memory limit (inherited by every fork), points AppWorld at the data, checks
  it and the sandbox, warms imports; returns (data root, apps). Ground truth is never loaded
  here: episode processes fork from the workers forked from this one."""
  if settings["memory_limit_mb"]:
    limit = settings["memory_limit_mb"] * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  logging.getLogger("httpx").setLevel(logging.WARNING)
  from appworld import AppWorld
  from appworld import evaluator  # noqa: F401 - warm import for the evaluation forks
  from appworld.apps import get_all_apps
  from appworld.common.constants import DB_VERSION
  data = settings["appworld_root"]
  apps = get_all_apps()
  data_root.check(data, DB_VERSION, apps)
  os.environ["APPWORLD_ROOT"] = _outputs_root(data, settings["outputs_root"])
  if settings["sandbox"] != "off":
    if (why := sandbox.unavailable()) is not None:
      raise sandbox.SandboxError(why)
    for secret in (data, os.environ["APPWORLD_ROOT"]):
      sandbox.check_secret_not_readable(episode_process.sandbox_read_paths(), secret)
  # The first world of a process pays for lazy imports (~seconds): pay it now, once for
  # every worker, not in each one's first episode.
  task_id = sorted(os.listdir(episode_process.tasks_directory(data)))[0]
  with AppWorld(task_id=task_id, experiment_name=f"{WARMUP_EXPERIMENT}_{os.getpid()}",
                load_ground_truth=False) as world:
    world.execute("apis.supervisor.show_profile()")
    shutil.rmtree(world.base_output_directory, ignore_errors=True)
  _build_before_forks(apps)
  # Forks share this process's memory until they write to it; the collector would write to
  # every object it scans.
  gc.freeze()
  return data, apps


def _build_before_forks(apps: list[str]) -> None:
  """Builds what AppWorld builds at first use and keeps per process, so that the episode and
  evaluation processes forked from this one inherit it instead of each building it again:
  every app's API docs, which each request is checked against (an app's OpenAPI schema at
  the first request to it: 0.1-0.4 s), and the imports of the evaluation's checks (pytest,
  ~0.1 s at the first check)."""
  from appworld import requester
  from appworld.common.utils import assert_plus

  build = getattr(requester, "_get_api_name_to_doc", None)  # AppWorld's cached builder
  if build is not None:
    for app in apps:
      build(app, include_private_apis=True)  # the arguments AppWorld's requests use
  assert_plus(0, "==", 0)


def _serve_channel(session: Worker, channel: Connection) -> None:
  while True:
    try:
      request = json.loads(channel.recv_bytes())
    except EOFError:
      return
    channel.send_bytes(json.dumps(session.handle(request)).encode())


def _serve_http(session: Worker, channel: Connection) -> None:
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
  channel.send_bytes(json.dumps({"port": server.server_address[1]}).encode())
  while True:
    ready, _, _ = select.select([server.socket, channel.fileno()], [], [])
    if channel.fileno() in ready:  # the pool closed the channel or died
      return
    server.handle_request()


def _run_worker(template: int, channel_fd: int, log_path: str | None,
                settings: dict[str, Any], data: str, apps: list[str]) -> None:
  """A fresh fork of the template becomes a worker: a session of its own, death with the
  template, its own log, a subreaper for what its episodes leave behind; then it serves its
  channel. Its own session, as each worker had when it was an interpreter of its own: where
  the kernel shares the CPU between sessions (autogroup), the template's one session would
  give all the pool's workers together the share of one."""
  os.setsid()
  episode_process.die_with_parent(template)
  log = os.open(log_path or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
  os.dup2(log, 1)
  os.dup2(log, 2)
  os.close(log)
  episode_process.become_subreaper()
  channel = Connection(channel_fd)
  session = Worker(settings, data, apps)
  channel.send_bytes(json.dumps({"ok": True}).encode())
  (_serve_http if settings["use_servers"] else _serve_channel)(session, channel)


def _fork_worker(control: socket.socket, channel_fd: int, log_path: str | None,
                 settings: dict[str, Any], data: str, apps: list[str]) -> int:
  """Forks a worker that serves `channel_fd`; returns its pid."""
  sys.stdout.flush()
  sys.stderr.flush()
  template = os.getpid()
  pid = os.fork()
  if pid == 0:  # the worker: never returns
    code = 1
    try:
      control.close()
      _run_worker(template, channel_fd, log_path, settings, data, apps)
      code = 0
    except BaseException as e:  # noqa: BLE001 - reported in its log, then exit
      print(f"worker failed: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
      sys.stderr.flush()
      os._exit(code)
  return pid


# How long the template waits for a worker the pool asks it to reap (one that closed its
# channel, or that the pool killed) before it kills it.
REAP_WAIT_S = 5.0


def _exit_code(pid: int, wait: bool) -> int | None:
  """A worker's exit code as subprocess gives it (-N: killed by signal N), reaping it; None
  while it runs (without `wait`). With `wait`, a worker still running after REAP_WAIT_S is
  killed: the pool asks only about workers that are ending or that it killed."""
  clock = lambda: time.clock_gettime(time.CLOCK_MONOTONIC)  # AppWorld may freeze the others
  deadline = clock() + (REAP_WAIT_S if wait else 0)
  while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
      return os.waitstatus_to_exitcode(status)
    if clock() >= deadline:
      if not wait:
        return None
      os.kill(pid, signal.SIGKILL)
      return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    time.sleep(0.01)


def _serve_template(control: socket.socket, settings: dict[str, Any], data: str,
                    apps: list[str]) -> None:
  """Answers the pool until it closes the channel. A request that fails (a fork refused by
  the process limit, a pid that is not a worker) gets an error, never ends the template:
  its workers would die with it."""
  while True:
    message, fds, _, _ = socket.recv_fds(control, 1 << 16, 1)
    if not message:  # the pool closed its end, or died
      return
    request = json.loads(message)
    try:
      if request["op"] == "fork":
        answer = {"pid": _fork_worker(control, fds[0], request["log_path"], settings, data,
                                      apps)}
      else:  # exit_code
        answer = {"exit_code": _exit_code(request["pid"], request["wait"])}
    except Exception as e:  # noqa: BLE001 - reported to the pool
      answer = {"error": f"{type(e).__name__}: {e}"}
    finally:
      for fd in fds:  # the worker's alone now: the pool sees its end close when it dies
        os.close(fd)
    control.send(json.dumps(answer).encode())


def main() -> None:
  control = socket.socket(fileno=os.dup(0))
  devnull = os.open(os.devnull, os.O_RDONLY)
  os.dup2(devnull, 0)
  os.close(devnull)
  settings = json.loads(control.recv(1 << 16))
  try:
    data, apps = _init_template(settings)
  except (data_root.AppWorldDataError, sandbox.SandboxError) as e:
    control.send(json.dumps({"ok": False, "fatal": str(e),
                             "sandbox": isinstance(e, sandbox.SandboxError)}).encode())
    return
  # Every worker's episodes hide the rest of the data where this machine allows it.
  confined = settings["sandbox"] != "off"
  settings["hide_data"] = confined and sandbox.hiding_available(
      episode_process.tasks_directory(data))
  protections = sandbox.protections(hidden=settings["hide_data"]) if confined else []
  control.send(json.dumps({"ok": True, "protections": protections}).encode())
  _serve_template(control, settings, data, apps)


if __name__ == "__main__":
  main()
