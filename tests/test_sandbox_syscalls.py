"""Agent code opens no socket but TCP and starts no process: the seccomp filter of sandbox.py.

Landlock governs TCP only (MPTCP, UDP and pathname UNIX sockets reach listeners outside), and
the memory limit holds per process (forks multiply it). The code guard is off here, as in
tests/test_appworld_sandbox.py, so that the kernel layer is shown to hold alone: the code
reaches the real system calls (posix, socket, ctypes) through __import__.
"""

import errno
import json
import os
import resource
import socket
import tempfile

import pytest

from sage_jax.envs import appworld
from sage_jax.envs.appworld import sandbox
from tests.appworld_fixtures import all_task_ids
from tests.appworld_fixtures import mini_root  # noqa: F401 - pytest fixture
from tests.appworld_fixtures import pool_config

# Agent code's helper: prints `name` and OK, or the errno's name of the OSError it met.
ATTEMPT = """
errno, socket = __import__('errno'), __import__('socket')
def attempt(name, call):
    try:
        call()
        print(name, 'OK')
    except OSError as e:
        print(name, errno.errorcode.get(e.errno, e))
"""
MPTCP = 262  # IPPROTO_MPTCP: a TCP stream under another protocol number
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}.get(os.uname().machine)


@pytest.fixture(scope="module")
def pool(mini_root, tmp_path_factory):  # noqa: F811
  config = pool_config(mini_root, str(tmp_path_factory.mktemp("syscall_outputs")),
                       num_workers=1, code_guard=False)
  with appworld.EnvPool(config) as pool:
    yield pool


def _run(pool, mini_root, experiment: str, code: str) -> str:  # noqa: F811
  with pool.episode(all_task_ids(mini_root)[0], experiment) as ep:
    return ep.execute(ATTEMPT + code).result()


def _tcp_listener() -> socket.socket:
  listener = socket.create_server(("127.0.0.1", 0))
  listener.settimeout(0.5)
  return listener


def _nothing_came(wait) -> bool:
  """Whether `wait` (a listener's accept or recv, 0.5 s timeout) times out."""
  try:
    wait()
  except TimeoutError:
    return True
  return False


def test_udp_reaches_no_listener_outside(pool, mini_root):  # noqa: F811
  listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
  listener.bind(("127.0.0.1", 0))
  listener.settimeout(0.5)
  code = ("attempt('udp', lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM)"
          f".sendto(b'x', {listener.getsockname()!r}))")
  observation = _run(pool, mini_root, "udp", code)
  assert "udp EPERM" in observation, observation
  assert _nothing_came(lambda: listener.recv(1))


def test_mptcp_reaches_no_tcp_listener_outside(pool, mini_root):  # noqa: F811
  listener = _tcp_listener()
  code = (f"attempt('mptcp', lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM, {MPTCP})"
          f".connect({listener.getsockname()!r}))")
  observation = _run(pool, mini_root, "mptcp", code)
  assert "mptcp EPERM" in observation, observation
  assert _nothing_came(listener.accept)


def test_unix_socket_reaches_no_listener_outside(pool, mini_root, tmp_path):  # noqa: F811
  path = str(tmp_path / "outside.sock")
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  listener.bind(path)
  listener.listen()
  listener.settimeout(0.5)
  code = f"attempt('unix', lambda: socket.socket(socket.AF_UNIX).connect({path!r}))"
  observation = _run(pool, mini_root, "unix", code)
  assert "unix EPERM" in observation, observation
  assert _nothing_came(listener.accept)


@pytest.mark.skipif(sandbox.landlock_abi() < 4, reason="Landlock TCP rules need ABI >= 4")
def test_tcp_is_still_governed_by_landlock(pool, mini_root):  # noqa: F811
  """A TCP socket is made (the filter leaves TCP to Landlock), and its connect refused."""
  listener = _tcp_listener()
  code = ("s = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC, "
          "socket.IPPROTO_TCP)\nprint('socket made')\n"
          f"attempt('tcp', lambda: s.connect({listener.getsockname()!r}))")
  observation = _run(pool, mini_root, "tcp", code)
  assert "socket made" in observation and "tcp EACCES" in observation, observation
  assert _nothing_came(listener.accept)


# Each starts a process, by the routes agent code has: the real fork, the real Popen class
# (AppWorld replaces the names in subprocess with no-ops), posix_spawn (glibc's clone).
STARTS = {
  "fork": "o = __import__('posix')\nattempt('start', lambda: o.fork() == 0 and o._exit(0))",
  "subprocess": ("__import__('subprocess')\n"
                 "popen = [c for c in object.__subclasses__() if c.__name__ == 'Popen'"
                 " and c.__module__ == 'subprocess'][0]\n"
                 "attempt('start', lambda: popen(['/bin/true']).wait())"),
  "posix_spawn": ("attempt('start', lambda: __import__('posix').posix_spawn('/bin/true', "
                  "['true'], {}))"),
}


@pytest.mark.parametrize("route", sorted(STARTS))
def test_agent_code_starts_no_process(pool, mini_root, route):  # noqa: F811
  # EPERM: refused at the fork. A fork allowed would end in EACCES (Landlock refuses the
  # exec) or OK, with a process of its own, and a memory limit of its own, meanwhile.
  observation = _run(pool, mini_root, f"start_{route}", STARTS[route])
  assert "start EPERM" in observation, observation


def test_agent_code_cannot_set_up_io_uring(pool, mini_root):  # noqa: F811
  """io_uring's own socket and connect operations would pass by the socket filter."""
  code = ("ctypes = __import__('ctypes')\nlibc = ctypes.CDLL(None, use_errno=True)\n"
          "params = ctypes.create_string_buffer(120)\n"  # struct io_uring_params, zeroed
          "fd = libc.syscall(425, 1, params)\n"  # io_uring_setup: 425 on x86_64 and aarch64
          "print('io_uring', fd, errno.errorcode.get(ctypes.get_errno()))")
  observation = _run(pool, mini_root, "io_uring", code)
  assert "io_uring -1 EPERM" in observation, observation


def test_threads_still_run_under_the_filter(pool, mini_root):  # noqa: F811
  """clone for a thread passes (clone3 gets ENOSYS: glibc falls back to clone), and the
  thread is filtered too."""
  code = ("threading = __import__('threading')\nfutures = __import__('concurrent.futures')\n"
          "out = []\nt = threading.Thread(target=lambda: out.append(sum(range(10))))\n"
          "t.start()\nt.join()\n"
          "with futures.futures.ThreadPoolExecutor(4) as ex:\n"
          "    out += ex.map(abs, [-1, -2, -3, -4])\n"
          "    ex.submit(attempt, 'udp in a thread', lambda: socket.socket(socket.AF_INET, "
          "socket.SOCK_DGRAM)).result()\n"
          "print('THREADS', out)")
  observation = _run(pool, mini_root, "threads", code)
  assert "THREADS [45, 1, 2, 3, 4]" in observation, observation
  assert "udp in a thread EPERM" in observation, observation


def test_agent_code_sets_no_other_process_limits_priority_or_signal(pool, mini_root):  # noqa: F811
  """Every process here runs as root: without the filter, agent code could lower the
  trainer's limits (a CPU-time limit gets it killed), scheduling or priority, whatever
  Landlock scopes. Its own stay its to set. The trainer here is this test's process."""
  trainer = os.getpid()
  before = resource.getrlimit(resource.RLIMIT_NOFILE)
  code = (f"resource, posix, ctypes = (__import__(m) for m in ('resource', 'posix', 'ctypes'))\n"
          f"libc = ctypes.CDLL(None, use_errno=True)\n"
          f"def check(name, result):\n"
          f"    print(name, 'OK' if result == 0 else errno.errorcode.get(ctypes.get_errno()))\n"
          f"soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
          f"for pid, who in (({trainer}, 'other'), (posix.getppid(), 'worker'), (0, 'own'),\n"
          f"                 (posix.getpid(), 'own')):\n"
          f"    attempt(f'{{who}} prlimit', lambda: resource.prlimit(pid, resource.RLIMIT_NOFILE,"
          f" (soft - 24, hard)))\n"
          f"    attempt(f'{{who}} affinity', lambda: posix.sched_setaffinity(pid, {{0}}))\n"
          f"    attempt(f'{{who}} nice', lambda: posix.setpriority(posix.PRIO_PROCESS, pid, 1))\n"
          f"    check(f'{{who}} ioprio', libc.syscall({_IOPRIO_SET}, 1, pid, 0))\n"
          f"attempt('user nice', lambda: posix.setpriority(posix.PRIO_USER, 0, 2))\n"
          f"attempt('other kill', lambda: posix.kill({trainer}, 0))\n"
          f"attempt('group kill', lambda: posix.kill(0, 0))\n"
          f"attempt('own kill', lambda: posix.kill(posix.getpid(), 0))\n")
  observation = _run(pool, mini_root, "other_processes", code)
  for call in ("prlimit", "affinity", "nice", "ioprio"):
    assert f"other {call} EPERM" in observation and f"worker {call} EPERM" in observation, (
        observation)
    assert observation.count(f"own {call} OK") == 2, observation
  for refused in ("user nice", "other kill", "group kill"):
    assert f"{refused} EPERM" in observation, observation
  assert "own kill OK" in observation, observation
  assert resource.getrlimit(resource.RLIMIT_NOFILE) == before


def test_without_seccomp_confinement_refuses_and_says_how_to_opt_out(monkeypatch):
  monkeypatch.setattr(sandbox, "landlock_abi", lambda: 6)
  monkeypatch.setattr(sandbox, "seccomp_available", lambda: False)
  assert sandbox.protections() == []
  with pytest.raises(sandbox.SandboxError, match="seccomp.*sandbox='off'"):
    sandbox.confine([], [])


def test_on_another_machine_seccomp_is_unavailable(monkeypatch):
  monkeypatch.setattr(sandbox, "_SECCOMP_ARCH", None)
  assert not sandbox.seccomp_available()


@pytest.mark.skipif(not sandbox.hiding_available(tempfile.gettempdir()),
                    reason="this kernel refuses unprivileged user and mount namespaces")
def test_hide_shows_a_process_only_the_paths_it_keeps(tmp_path):
  """In a fork: the directory holds only the kept paths, at their places and with their
  contents; the rest is gone even for `stat`, and nothing new can be made there. Outside
  the fork, nothing changed."""
  tasks = tmp_path / "tasks"
  (tasks / "own" / "dbs").mkdir(parents=True)
  (tasks / "own" / "dbs" / "world.db").write_text("db")
  (tasks / "own" / "specs.json").write_text("{}")
  (tasks / "own" / "ground_truth").mkdir()
  (tasks / "own" / "ground_truth" / "answer.json").write_text("42")
  (tasks / "other").mkdir()
  with pytest.raises(ValueError, match="beneath"):
    sandbox.hide(str(tasks / "own"), [str(tasks / "other")])
  seen = os.pipe()
  pid = os.fork()
  if pid == 0:  # never returns
    try:
      sandbox.hide(str(tasks), [str(tasks / "own" / "specs.json"), str(tasks / "own" / "dbs"),
                                str(tasks / "own" / "missing")])
      try:
        (tasks / "new").write_text("x")
        wrote = "wrote"
      except OSError as e:
        wrote = errno.errorcode[e.errno]
      view = {"tasks": sorted(os.listdir(tasks)), "own": sorted(os.listdir(tasks / "own")),
              "db": (tasks / "own" / "dbs" / "world.db").read_text(),
              "answer": os.path.exists(tasks / "own" / "ground_truth" / "answer.json"),
              "write": wrote}
      os.write(seen[1], json.dumps(view).encode())
    finally:
      os._exit(0)
  os.close(seen[1])
  os.waitpid(pid, 0)
  with os.fdopen(seen[0]) as f:
    view = json.loads(f.read())
  assert view == {"tasks": ["own"], "own": ["dbs", "specs.json"], "db": "db",
                  "answer": False, "write": "EROFS"}
  assert sorted(os.listdir(tasks)) == ["other", "own"] and not (tasks / "new").exists()
  assert (tasks / "own" / "ground_truth" / "answer.json").read_text() == "42"
