"""The worker's forks: one confined process per episode, one per evaluation.

The worker process itself never runs agent code and never loads a task's ground truth; it
forks (imports stay warm):

- an *episode process* per episode, which opens the world without its ground truth, is
  confined by the sandbox (it reads the system, its own task's specs and DBs and the base
  DBs and API docs; it writes beneath its experiment directory only) and runs the agent's
  code. Whatever the code guard's setting, a format field that its code hands to
  `string.Formatter` reaches no attribute that the guard refuses (a subclass of it is handed
  the object a field names: `code_guard.guard_format_fields`). Its time limit is kept by
  the worker, outside its reach: code that is still running `grace_s` after AppWorld's own
  timeout (because it switched the alarm off, or spins in C) is killed with its process,
  and the episode ends there. So is an episode whose directory grows past its disk budget
  (checked while its code runs and after each request; one file can never exceed the
  budget: RLIMIT_FSIZE). Every file descriptor but its channel to the worker is closed, so
  it cannot answer the pool in the worker's name. The channel itself is within the code's
  reach: each request carries a fresh random token that only a true answer repeats, and an
  answer is read with a size limit and under the request's deadline, so a message the code
  writes there ends the episode instead of being taken as an answer.
- an *evaluation process* per evaluation, which scores the world's state that the episode
  process saved with AppWorld's own evaluator (evaluation.py). That state is the agent's to
  forge, so this process is confined too (it reads the task, the data it needs and the saved
  state; it writes only its own scratch directory) and the worker kills it at its own
  deadline. Its memory, which held the answers, dies with it, so no later episode fork
  inherits them.

Both run in a process group of their own and die with the worker (PR_SET_PDEATHSIG), so
killing the worker leaves none of them behind.
"""

import ctypes
import fcntl
import json
import os
import resource
import secrets
import select
import signal
import socket
import stat
import struct
import sys
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

import sage_jax
from sage_jax.envs.appworld import code_guard
from sage_jax.envs.appworld import sandbox


_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36
_libc = ctypes.CDLL(None, use_errno=True)


class EvaluationTimeout(Exception):
  """The evaluation process was still running at its deadline and was killed."""


class EpisodeEnded(Exception):
  """The episode process is gone, killed for `cause`: "timeout" (still running at its
  deadline), "disk" (its directory outgrew the disk budget), "channel" (its code wrote to
  the channel to the worker), "memory" (what its code made outgrew the process's memory, in
  AppWorld's handling of it), or None (its code ended it)."""

  def __init__(self, message: str, cause: str | None = None):
    super().__init__(message)
    self.cause = cause


# The largest answer read from an episode process: an output is truncated to
# max_output_chars before it is sent, so only a message the code wrote comes near it.
MAX_ANSWER_BYTES = 256 * 2**20


# How often the worker measures an episode's directory while its code runs.
DISK_CHECK_INTERVAL_S = 0.25
_BLOCK = 4096  # what an entry costs at least: a flood of empty files fills a disk too


def _disk_usage(directory: str) -> int:
  """Bytes that `directory` takes on disk: allocated blocks of every entry beneath it, at
  least one block each; links are not followed."""
  total, stack = 0, [directory]
  while stack:
    try:
      entries = list(os.scandir(stack.pop()))
    except OSError:
      continue  # removed meanwhile, or not a directory any more
    for entry in entries:
      try:
        st = entry.stat(follow_symlinks=False)
      except OSError:
        continue
      total += max(st.st_blocks * 512, _BLOCK)
      if stat.S_ISDIR(st.st_mode):
        stack.append(entry.path)
  return total


def _describe_exit(status: int) -> str:
  if os.WIFSIGNALED(status):
    return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
  return f"exited with code {os.WEXITSTATUS(status)}"


def _restrict_inherited_fds(keep: int) -> None:
  """Leaves the fork only stdio, `keep`, and its regular files re-opened read-only.

  Closes the worker's pipes and sockets (the fork must not answer the pool in the worker's
  name) and turns the DB files AppWorld keeps open across worlds into read-only descriptors
  under the same numbers, so that code cannot write into the shared data through them.
  """
  devnull = os.open(os.devnull, os.O_RDONLY)
  os.dup2(devnull, 0)
  os.close(devnull)
  for name in os.listdir("/proc/self/fd"):
    fd = int(name)
    if fd <= 2 or fd == keep:
      continue
    try:
      mode = os.fstat(fd).st_mode
    except OSError:
      continue  # the descriptor of the listing itself, now closed
    if stat.S_ISREG(mode) and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY:
      read_only = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
      os.dup2(read_only, fd, inheritable=False)
      os.close(read_only)
    elif not stat.S_ISREG(mode):
      os.close(fd)


def _enter_fork(worker: int, keep: int, read_paths: list[str], write_dir: str,
                confine: bool, hide: tuple[str, list[str]] | None) -> None:
  """What a fresh fork of the worker does first: a process group of its own (the worker
  kills whatever it forks, too), death with the worker, only `keep` of the worker's
  descriptors, (when `hide`) a view of a directory with only some of its paths
  (`sandbox.hide`), and (when `confine`) the sandbox."""
  os.setpgid(0, 0)
  die_with_parent(worker)
  _restrict_inherited_fds(keep=keep)
  if hide is not None:
    sandbox.hide(*hide)
  os.chdir(write_dir)
  if confine:
    sandbox.confine(read_paths, [write_dir])


def die_with_parent(parent: int) -> None:
  """This fork is killed when `parent` dies (PR_SET_PDEATHSIG); it ends at once if that
  happened before it asked."""
  _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
  if os.getppid() != parent:
    os._exit(1)


def tasks_directory(data: str) -> str:
  return os.path.join(data, "data", "tasks")


def tasks_view(data: str, task_id: str) -> tuple[str, list[str]]:
  """The data root's tasks directory, and the only paths of it an episode process sees
  where the machine lets it hide the rest (`sandbox.hide`): its own task's public files."""
  tasks = tasks_directory(data)
  return tasks, [os.path.join(tasks, task_id, "specs.json"),
                 os.path.join(tasks, task_id, "dbs")]


def episode_read_paths(data: str, task_id: str) -> list[str]:
  """What an episode process may read of the data root: its own task's public files."""
  return ([os.path.join(data, "data", "base_dbs"), os.path.join(data, "data", "api_docs")]
          + tasks_view(data, task_id)[1])


def sandbox_read_paths() -> list[str]:
  """The installation a fork of this process needs, with the source files of this package's
  modules loaded here, and no other file of the package, even where the package is installed
  inside the installation: the mini world's builder and scenarios hold its gold procedures.
  A fork imports nothing more of the package."""
  package = os.path.dirname(os.path.abspath(sage_jax.__file__))
  loaded = {os.path.abspath(m.__file__) for m in list(sys.modules.values())
            if getattr(m, "__file__", None)
            and os.path.abspath(m.__file__).startswith(package + os.sep)}
  return sandbox.withhold(sandbox.system_read_paths(), package) + sorted(loaded)


class EpisodeProcess:
  """A forked process that holds one episode's world; `serve` runs in the fork.
  `max_write_bytes`: its disk budget beneath `write_dir` (None: unlimited). `hide`:
  (directory, paths kept) to show the fork only those paths of the directory."""

  def __init__(self, serve: Callable[[Connection], None], *, read_paths: list[str],
               write_dir: str, confine: bool, max_write_bytes: int | None = None,
               hide: tuple[str, list[str]] | None = None):
    os.makedirs(write_dir, exist_ok=True)
    self.write_dir, self.max_write_bytes = write_dir, max_write_bytes
    parent, child = socket.socketpair()
    sys.stdout.flush()
    sys.stderr.flush()
    worker = os.getpid()
    pid = os.fork()
    if pid == 0:  # the episode process: never returns
      code = 1
      try:
        parent.close()
        _enter_fork(worker, child.fileno(), read_paths, write_dir, confine, hide)
        code_guard.guard_format_fields()
        if max_write_bytes is not None:
          # A write past the budget fails (EFBIG: an OSError the code sees) instead of
          # killing the process with SIGXFSZ.
          signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
          resource.setrlimit(resource.RLIMIT_FSIZE, (max_write_bytes, max_write_bytes))
        serve(Connection(child.detach()))
        code = 0
      except BaseException as e:  # noqa: BLE001 - reported on stderr, then exit
        print(f"episode process failed: {type(e).__name__}: {e}", file=sys.stderr)
      finally:
        sys.stderr.flush()
        os._exit(code)
    child.close()
    self.pid = pid
    self._conn = Connection(parent.detach())
    self._status: int | None = None

  def call(self, request: dict, timeout: float | None) -> dict:
    """One request; raises EpisodeEnded when the process is killed at `timeout`, or over
    its disk budget (while the request runs or once it is answered), or dies."""
    if self._status is not None:
      raise EpisodeEnded(_describe_exit(self._status))
    token = secrets.token_hex(16)
    try:
      self._conn.send_bytes(json.dumps({**request, "token": token}).encode())
      deadline = None if timeout is None else time.monotonic() + timeout
      while True:
        left = None if deadline is None else deadline - time.monotonic()
        if self.max_write_bytes is not None:
          left = DISK_CHECK_INTERVAL_S if left is None else min(left, DISK_CHECK_INTERVAL_S)
        answered = self._conn.poll(None if left is None else max(left, 0.0))
        self._check_disk()
        if answered:
          return self._answer(token, deadline)
        if deadline is not None and time.monotonic() >= deadline:
          self.kill()
          raise EpisodeEnded(f"still running {timeout:g} s after it started", cause="timeout")
    except (EOFError, OSError) as e:
      self.kill()
      raise EpisodeEnded(_describe_exit(self._status)) from e

  def _answer(self, token: str, deadline: float | None) -> dict:
    """The answer to the request sent with `token`; anything else on the channel is the
    code's, and ends the episode."""
    try:
      answer = json.loads(_read_message(self._conn.fileno(), deadline, MAX_ANSWER_BYTES))
      forged = not isinstance(answer, dict) or answer.pop("token", None) != token
      why = "a message that is not the answer" if forged else None
    except _BadMessage as e:
      why = str(e)
    except ValueError:  # not JSON (UnicodeDecodeError is one too)
      why = "a message that is not the answer"
    if why is not None:
      self.kill()
      raise EpisodeEnded(why, cause="channel")
    return answer

  def _check_disk(self) -> None:
    if self.max_write_bytes is None:
      return
    used = _disk_usage(self.write_dir)
    if used > self.max_write_bytes:
      self.kill()
      raise EpisodeEnded(f"its directory took {used / 2**20:.1f} MB, more than its "
                         f"{self.max_write_bytes / 2**20:g} MB budget", cause="disk")

  def kill(self) -> None:
    """Kills the process and everything it forked; idempotent."""
    if self._status is None:
      try:
        os.killpg(self.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      self._status = os.waitpid(self.pid, 0)[1]
      self._conn.close()
      kill_orphans()


def become_subreaper() -> None:
  """Makes processes that agent code forked and left behind (even in a session of their
  own) children of this worker when their parent dies, so that kill_orphans finds them."""
  if _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def kill_orphans() -> None:
  """Kills and reaps every child left to this process (it has none of its own between
  episodes), until no new one appears."""
  while children := [pid for pid in _children_of(os.getpid())]:
    for pid in children:
      try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
      except (ProcessLookupError, ChildProcessError):
        pass


def _children_of(parent: int) -> list[int]:
  found = []
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        with open(f"/proc/{name}/stat") as f:
          if int(f.read().rpartition(")")[2].split()[1]) == parent:
            found.append(int(name))
      except (OSError, ValueError, IndexError):
        pass  # gone meanwhile
  return found


def run_in_fork(function: Callable[[], Any], *, read_paths: list[str], write_dir: str,
                confine: bool, timeout: float) -> Any:
  """`function()` in a forked process (set up like an episode process, see _enter_fork)
  whose memory dies with it; returns its JSON result.

  Raises EvaluationTimeout when it is killed, with its group, `timeout` seconds after it
  started, and RuntimeError naming the exit status (or the exception) when it fails.
  """
  os.makedirs(write_dir, exist_ok=True)
  reader, writer = os.pipe()
  sys.stdout.flush()
  sys.stderr.flush()
  worker = os.getpid()
  pid = os.fork()
  if pid == 0:  # never returns
    code = 1
    try:
      os.close(reader)
      _enter_fork(worker, writer, read_paths, write_dir, confine, None)
      try:
        answer = {"ok": True, "value": function()}
      except Exception as e:  # noqa: BLE001 - sent back to the worker
        answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
      with os.fdopen(writer, "w") as f:
        json.dump(answer, f)
      code = 0
    except BaseException as e:  # noqa: BLE001 - reported on stderr, then exit
      print(f"evaluation process failed: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
      sys.stderr.flush()
      os._exit(code)
  os.close(writer)
  try:
    text = _read_until(reader, time.monotonic() + timeout)
  finally:
    os.close(reader)
    try:
      os.killpg(pid, signal.SIGKILL)  # at the deadline, or whatever it left running
    except ProcessLookupError:
      pass
    status = os.waitpid(pid, 0)[1]
  if text is None:
    raise EvaluationTimeout(f"still running {timeout:g} s after it started")
  if not text:
    raise RuntimeError(f"the evaluation process {_describe_exit(status)}")
  answer = json.loads(text)
  if not answer["ok"]:
    raise RuntimeError(answer["error"])
  return answer["value"]


class _BadMessage(Exception):
  """A message on an episode's channel that no answer can be (its size, or its end)."""


def _read_message(fd: int, deadline: float | None, limit: int) -> bytes:
  """One message in `multiprocessing.connection`'s framing (a 4-byte big-endian size, or -1
  and an 8-byte one), read directly from `fd`: of at most `limit` bytes, whole before
  `deadline` (a true answer is written at once; a size the code wrote with no message
  behind it would block `recv_bytes` for good). Raises EOFError at the channel's end."""
  size = struct.unpack("!i", _read_exactly(fd, 4, deadline))[0]
  if size == -1:
    size = struct.unpack("!Q", _read_exactly(fd, 8, deadline))[0]
  if not 0 <= size <= limit:
    raise _BadMessage(f"a message of {size} bytes (an answer holds at most {limit})")
  return _read_exactly(fd, size, deadline)


def _read_exactly(fd: int, size: int, deadline: float | None) -> bytes:
  chunks, missing = [], size
  while missing:
    left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
    if not select.select([fd], [], [], left)[0]:
      raise _BadMessage(f"a message cut short ({size - missing} of its {size} bytes came)")
    chunk = os.read(fd, min(missing, 1 << 20))
    if not chunk:
      raise EOFError("the episode process closed its channel")
    chunks.append(chunk)
    missing -= len(chunk)
  return b"".join(chunks)


def _read_until(fd: int, deadline: float) -> bytes | None:
  """Everything `fd` gives until its end; None when the deadline comes first."""
  chunks = []
  while True:
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([fd], [], [], left)[0]:
      return None
    chunk = os.read(fd, 1 << 16)
    if not chunk:
      return b"".join(chunks)
    chunks.append(chunk)
