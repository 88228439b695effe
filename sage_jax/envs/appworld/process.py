"""The parent's handle on one worker process: spawn, call with a deadline, kill.

Workers are new interpreters (subprocess + `python -m`), never forks of the trainer, so
they inherit no JAX state and the trainer never imports appworld. Any way a worker can
fail (no answer in time, exit, broken pipe or socket) kills it and raises WorkerFault.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from multiprocessing.connection import Connection

import sage_jax
from sage_jax.envs.appworld import config as config_lib
from sage_jax.envs.appworld import data_root
from sage_jax.envs.appworld import sandbox

_LOG_TAIL_CHARS = 2000


class WorkerFault(RuntimeError):
  """The worker hung, died or broke the protocol; it has been killed."""


def _exit_reason(code: int | None) -> str:
  if code is None:
    return "still running"
  if code < 0:
    return f"killed by {signal.Signals(-code).name}"
  return f"exited with code {code}"


def child_environment(**overrides: str) -> dict[str, str]:
  """This process's environment with `overrides`, and this package importable in a Python
  child started with `-m sage_jax...` whatever its working directory."""
  env = dict(os.environ, **overrides)
  package_parent = os.path.dirname(os.path.abspath(list(sage_jax.__path__)[0]))
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
  return env


class WorkerProcess:
  """One spawned worker, talked to over a pipe or HTTP on 127.0.0.1."""

  def __init__(self, config: config_lib.EnvPoolConfig, name: str):
    self.name = name
    self._log_path = (os.path.join(config.log_dir, f"{name}.log") if config.log_dir else None)
    command = [sys.executable, "-m", "sage_jax.envs.appworld.worker"]
    if config.use_servers:
      command.append("--server")
    env = child_environment()
    if self._log_path:
      os.makedirs(config.log_dir, exist_ok=True)
      stderr = open(self._log_path, "ab")
    else:
      stderr = subprocess.DEVNULL
    # A session of its own: a Ctrl-C meant for the trainer does not kill workers mid-call.
    self._proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=stderr, env=env, start_new_session=True)
    if self._log_path:
      stderr.close()
    self._to = Connection(os.dup(self._proc.stdin.fileno()), readable=False)
    self._from = Connection(os.dup(self._proc.stdout.fileno()), writable=False)
    self._proc.stdin.close()
    self._proc.stdout.close()
    self._url = None
    settings = dataclasses.asdict(config) | {"appworld_root": config.data_root()}
    self._to.send_bytes(json.dumps(settings).encode())
    hello = self._receive(config.start_timeout_s, "starting")
    if not hello["ok"]:
      self.kill()
      raise (sandbox.SandboxError if hello["sandbox"] else data_root.AppWorldDataError)(
        hello["fatal"])
    self.protections: list[str] = hello["protections"]
    if config.use_servers:
      port = self._receive(config.start_timeout_s, "starting its server")["port"]
      self._url = f"http://127.0.0.1:{port}/"

  @property
  def pid(self) -> int:
    return self._proc.pid

  @property
  def alive(self) -> bool:
    return self._proc.poll() is None

  def kill(self) -> None:
    if self.alive:
      self._proc.kill()
    self._proc.wait()
    self._to.close()
    self._from.close()

  def _fault(self, what: str) -> WorkerFault:
    """Kills the worker; the error says why it died, with the end of its log."""
    self.kill()
    message = f"environment worker {self.name} {what} ({_exit_reason(self._proc.returncode)})"
    if self._log_path and os.path.exists(self._log_path):
      with open(self._log_path, errors="replace") as f:
        tail = f.read()[-_LOG_TAIL_CHARS:].strip()
      if tail:
        message += f"; its log ends with:\n{tail}"
    return WorkerFault(message)

  def _receive(self, timeout: float, doing: str) -> dict:
    try:
      if not self._from.poll(timeout):
        self._proc.kill()  # so that the reason below reads "killed by SIGKILL"
        raise self._fault(f"gave no answer within {timeout:g} s while {doing}")
      return json.loads(self._from.recv_bytes())
    except (EOFError, OSError) as e:
      self._proc.wait()
      raise self._fault(f"died while {doing}") from e

  def call(self, request: dict, timeout: float) -> dict:
    """Sends one request and waits at most `timeout` seconds for its answer."""
    doing = f"running {request['op']!r}"
    if self._url is None:
      try:
        self._to.send_bytes(json.dumps(request).encode())
      except OSError as e:
        self._proc.wait()
        raise self._fault(f"died before {doing}") from e
      return self._receive(timeout, doing)
    http_request = urllib.request.Request(self._url, data=json.dumps(request).encode(),
                                          headers={"Content-Type": "application/json"})
    try:
      with urllib.request.urlopen(http_request, timeout=timeout) as response:
        return json.loads(response.read())
    except TimeoutError as e:
      self._proc.kill()
      raise self._fault(f"gave no answer within {timeout:g} s while {doing}") from e
    except (urllib.error.URLError, ConnectionError, OSError) as e:
      self._proc.kill()
      raise self._fault(f"died while {doing}") from e
