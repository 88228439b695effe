"""The pool's handles on its worker processes: the template that forks them, and each
worker (call with a deadline, kill).

The template is a new interpreter (subprocess + `python -m`), never a fork of the trainer,
so neither it nor the workers forked from it inherit JAX state, and the trainer never
imports appworld (worker.py). Any way a worker can fail (no answer in time, exit, broken
socket, an answer that is not JSON) kills it and raises WorkerFault.
"""

import dataclasses
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from multiprocessing.connection import Connection

import sage_jax
from sage_jax.envs.appworld import config as config_lib
from sage_jax.envs.appworld import data_root
from sage_jax.envs.appworld import sandbox

_LOG_TAIL_CHARS = 2000


class WorkerFault(RuntimeError):
  """The worker hung, died or broke the protocol; it has been killed."""


def _exit_reason(code: int) -> str:
  if code < 0:
    return f"killed by {signal.Signals(-code).name}"
  return f"exited with code {code}"


def _log_tail(path: str | None) -> str:
  """"; its log ends with: ..." when the log at `path` has anything to say."""
  if path and os.path.exists(path):
    with open(path, errors="replace") as f:
      tail = f.read()[-_LOG_TAIL_CHARS:].strip()
    if tail:
      return f"; its log ends with:\n{tail}"
  return ""


def _decode(answer: bytes, doing: str, fault: Callable[[str], WorkerFault]) -> dict:
  """An answer as JSON; anything else breaks the protocol: `fault` (which kills the process
  that sent it) names it."""
  try:
    return json.loads(answer)
  except ValueError as e:  # not JSON (UnicodeDecodeError is one too)
    raise fault(f"gave an answer that is not JSON while {doing}: {answer[:200]!r}") from e


def child_environment(**overrides: str) -> dict[str, str]:
  """This process's environment with `overrides`, and this package importable in a Python
  child started with `-m sage_jax...` whatever its working directory."""
  env = dict(os.environ, **overrides)
  package_parent = os.path.dirname(os.path.abspath(list(sage_jax.__path__)[0]))
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
  return env


class WorkerTemplate:
  """The process the pool's workers are forked from (worker.py): it starts once per pool,
  with AppWorld imported and warm, and forks a worker per `fork`. Thread-safe.

  `scratch_dir`: where the workers' evaluations copy the states they evaluate (None: the
  system's temporary directory)."""

  def __init__(self, config: config_lib.EnvPoolConfig, scratch_dir: str | None = None):
    self._config = config
    self._log_path = (os.path.join(config.log_dir, "template.log") if config.log_dir
                      else None)
    if self._log_path:
      os.makedirs(config.log_dir, exist_ok=True)
      log = open(self._log_path, "ab")
    else:
      log = subprocess.DEVNULL
    # Packets keep each request whole, with the descriptors it carries.
    self._socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # A session of its own: a Ctrl-C meant for the trainer does not kill workers mid-call.
    self._proc = subprocess.Popen([sys.executable, "-m", "sage_jax.envs.appworld.worker"],
                                  stdin=theirs.fileno(), stdout=log, stderr=log,
                                  env=child_environment(), start_new_session=True)
    theirs.close()
    if self._log_path:
      log.close()
    self._lock = threading.Lock()
    settings = dataclasses.asdict(config) | {"appworld_root": config.data_root(),
                                             "scratch_dir": scratch_dir}
    hello = self._request(settings, config.start_timeout_s, "starting")
    if not hello["ok"]:
      self.close()
      raise (sandbox.SandboxError if hello["sandbox"] else data_root.AppWorldDataError)(
        hello["fatal"])
    self.protections: list[str] = hello["protections"]

  @property
  def alive(self) -> bool:
    return self._proc.poll() is None

  def close(self) -> None:
    """Ends the template (its workers die with it); idempotent."""
    self._socket.close()
    if self.alive:
      self._proc.kill()
    self._proc.wait()

  def _request(self, message: dict, timeout: float, doing: str,
               fds: tuple[int, ...] = ()) -> dict:
    with self._lock:
      try:
        data = json.dumps(message).encode()
        if fds:
          socket.send_fds(self._socket, [data], list(fds))
        else:
          self._socket.send(data)
        if not select.select([self._socket], [], [], timeout)[0]:
          self._proc.kill()
          raise self._fault(f"gave no answer within {timeout:g} s while {doing}")
        answer = self._socket.recv(1 << 16)
      except OSError as e:
        raise self._fault(f"died while {doing}") from e
      if not answer:
        raise self._fault(f"died while {doing}")
      answer = _decode(answer, doing, self._fault)
    if "error" in answer:  # this request failed; the template and its other workers are fine
      raise WorkerFault(f"the environment workers' template process failed {doing}: "
                        f"{answer['error']}")
    return answer

  def _fault(self, what: str) -> WorkerFault:
    self.close()
    return WorkerFault(f"the environment workers' template process {what} "
                       f"({_exit_reason(self._proc.returncode)}){_log_tail(self._log_path)}")

  def fork(self, name: str, log_path: str | None) -> tuple[int, Connection]:
    """A new worker (logging to `log_path`, if any): its pid, and the pool's end of its
    channel."""
    ours, theirs = socket.socketpair()
    try:
      answer = self._request({"op": "fork", "log_path": log_path},
                             self._config.start_timeout_s, f"forking worker {name}",
                             fds=(theirs.fileno(),))
    except BaseException:
      ours.close()
      raise
    finally:
      theirs.close()
    return answer["pid"], Connection(ours.detach())

  def exit_code(self, pid: int, wait: bool) -> int | None:
    """A worker's exit code (-N: killed by signal N), reaping it; None while it runs. With
    `wait`, the template waits for its end (a few seconds, then kills it). Raises
    WorkerFault when the template cannot tell (it is gone, and its workers with it)."""
    if not self.alive:
      raise WorkerFault(f"the environment workers' template process is gone "
                        f"({_exit_reason(self._proc.returncode)})")
    return self._request({"op": "exit_code", "pid": pid, "wait": wait},
                         self._config.start_timeout_s, f"reaping worker {pid}")["exit_code"]


class WorkerProcess:
  """One worker, forked from the pool's template, talked to over a socket or HTTP on
  127.0.0.1."""

  def __init__(self, template: WorkerTemplate, config: config_lib.EnvPoolConfig, name: str):
    self.name = name
    self._template = template
    self._log_path = (os.path.join(config.log_dir, f"{name}.log") if config.log_dir else None)
    self.pid, self._channel = template.fork(name, self._log_path)
    self._ended = False
    self._reason = "still running"  # how it ended, once it has
    self._url = None
    self._receive(config.start_timeout_s, "starting")
    if config.use_servers:
      port = self._receive(config.start_timeout_s, "starting its server")["port"]
      self._url = f"http://127.0.0.1:{port}/"

  def _reap(self, wait: bool) -> None:
    """Asks the template whether (with `wait`: how) the worker ended; once it has, it is
    `_ended`, and `_reason` says how."""
    try:
      code = self._template.exit_code(self.pid, wait)
    except WorkerFault as e:
      self._ended, self._reason = True, f"exit status unknown: {e}"
      return
    if code is not None:
      self._ended, self._reason = True, _exit_reason(code)

  @property
  def alive(self) -> bool:
    if not self._ended:
      self._reap(wait=False)
    return not self._ended

  def kill(self) -> None:
    if self.alive:
      try:  # not reaped yet (alive above), so its pid is not another process's
        os.kill(self.pid, signal.SIGKILL)
      except ProcessLookupError:  # its template died just now, and init reaped it
        pass
      self._reap(wait=True)
    self._channel.close()

  def _fault(self, what: str) -> WorkerFault:
    """Kills the worker; the error says why it died, with the end of its log."""
    self.kill()
    return WorkerFault(f"environment worker {self.name} {what} ({self._reason})"
                       f"{_log_tail(self._log_path)}")

  def _receive(self, timeout: float, doing: str) -> dict:
    try:
      if not self._channel.poll(timeout):
        raise self._fault(f"gave no answer within {timeout:g} s while {doing}")
      return _decode(self._channel.recv_bytes(), doing, self._fault)
    except (EOFError, OSError) as e:
      raise self._died(f"died while {doing}") from e

  def _died(self, what: str) -> WorkerFault:
    """The fault of a worker whose end of the channel closed: it is gone or going, with an
    exit code of its own."""
    if not self._ended:
      self._reap(wait=True)
    return self._fault(what)

  def call(self, request: dict, timeout: float) -> dict:
    """Sends one request and waits at most `timeout` seconds for its answer."""
    doing = f"running {request['op']!r}"
    if self._url is None:
      try:
        self._channel.send_bytes(json.dumps(request).encode())
      except OSError as e:
        raise self._died(f"died before {doing}") from e
      return self._receive(timeout, doing)
    http_request = urllib.request.Request(self._url, data=json.dumps(request).encode(),
                                          headers={"Content-Type": "application/json"})
    try:
      with urllib.request.urlopen(http_request, timeout=timeout) as response:
        answer = response.read()
    except TimeoutError as e:
      raise self._fault(f"gave no answer within {timeout:g} s while {doing}") from e
    except (urllib.error.URLError, ConnectionError, OSError) as e:
      raise self._fault(f"died while {doing}") from e
    return _decode(answer, doing, self._fault)
