"""OS confinement of the process that runs agent code: Landlock, no new privileges, no caps.

Python-level guards (AppWorld's blocked names) fall to a disguised import; these limits are
set by the kernel on the episode process before any agent code runs and cannot be lifted by
it or by any process it starts:

- files: read only the Python installation and the paths granted (the task's own public
  files); write only beneath the episode's experiment directory; execute no program;
- network: no TCP bind or connect (Landlock ABI >= 4);
- signals and abstract UNIX sockets: none to processes outside the sandbox, so agent code
  cannot stop its supervisor or the trainer (Landlock ABI >= 6);
- privileges: no_new_privs, and every capability dropped, so a process running as root
  cannot raise its resource limits again or bypass file modes.

Landlock needs Linux >= 5.13 with it enabled (no root needed). `protections()` says what
the running kernel gives; the pool reports it and refuses to start without file confinement
unless `EnvPoolConfig.sandbox` is "off".
"""

import ctypes
import os
import sys
import sysconfig

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # all Linux arches
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
_SYS_CAPSET = {"x86_64": 126, "aarch64": 91}.get(os.uname().machine)
_CAP_VERSION_3 = 0x20080522

# Landlock file-system rights (bit = 1 << n) and the ABI that introduced them.
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1, 2, 4, 8
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR, MAKE_REG = 16, 32, 64, 128, 256
MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = 512, 1024, 2048, 4096
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
_FILE_ONLY = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV  # rights a file can hold
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1, 2

READ = READ_FILE | READ_DIR
WRITE = READ | WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_DIR | MAKE_REG | REFER | TRUNCATE


UNAVAILABLE = ("Landlock is not available on this kernel (needs Linux >= 5.13 with landlock "
               "in its LSM list); set EnvPoolConfig.sandbox='off' to run agent code "
               "unconfined, where it can read every task's answers.")


class SandboxError(RuntimeError):
  """The sandbox asked for cannot be set up on this machine."""


class _RulesetAttr(ctypes.Structure):
  _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
              ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
  _pack_ = 1
  _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _syscall(number: int, *args) -> int:
  result = _libc.syscall(number, *args)
  if result < 0:
    errno = ctypes.get_errno()
    raise OSError(errno, os.strerror(errno))
  return result


def landlock_abi() -> int:
  """The kernel's Landlock ABI version; 0 when Landlock is missing or disabled."""
  try:
    return _syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0),
                    ctypes.c_uint32(_CREATE_RULESET_VERSION))
  except OSError:
    return 0


def protections(abi: int | None = None) -> list[str]:
  """What confine() enforces on this kernel, in words (empty: nothing)."""
  abi = landlock_abi() if abi is None else abi
  if abi < 1:
    return []
  found = ["files (read: system + task's public files; write: episode directory; no exec)"]
  if abi >= 4:
    found.append("no TCP")
  if abi >= 6:
    found.append("no signals or abstract sockets out of the sandbox")
  return found + ["no new privileges, no capabilities"]


def system_read_paths() -> list[str]:
  """What a Python process needs to read: its installation and the system libraries."""
  paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sysconfig.get_paths()["stdlib"],
           sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
           "/usr", "/lib", "/lib64", "/etc/localtime", "/dev/null", "/dev/urandom"}
  return sorted(os.path.realpath(p) for p in paths if os.path.exists(p))


def _beneath(path: str, parent: str) -> bool:
  return path == parent or path.startswith(parent.rstrip("/") + "/")


def check_secret_not_readable(read_paths: list[str], secret_root: str) -> None:
  """Refuses a grant that would expose `secret_root` (e.g. data stored inside the venv)."""
  secret = os.path.realpath(secret_root)
  for path in read_paths:
    if _beneath(secret, os.path.realpath(path)):
      raise SandboxError(f"The AppWorld data at {secret} lies inside {path}, which agent code "
                         "must read (the Python installation); move the data elsewhere.")


def _drop_capabilities() -> None:
  if os.getuid() != 0 and os.geteuid() != 0:
    return  # an unprivileged process has no capabilities to drop
  if _SYS_CAPSET is None:
    raise SandboxError(f"cannot drop capabilities on {os.uname().machine}")
  header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
  data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2 words: all zero
  _syscall(_SYS_CAPSET, header, data)


def confine(read_paths: list[str], write_paths: list[str]) -> None:
  """Restricts this process (and every process it starts) for good; see the module doc.

  Paths must exist. A file path grants only file rights on that file.
  """
  abi = landlock_abi()
  if abi < 1:
    raise SandboxError(UNAVAILABLE)
  fs = max(v for k, v in _FS_BY_ABI.items() if k <= abi)
  attr = _RulesetAttr(handled_access_fs=fs,
                      handled_access_net=_NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 else 0,
                      scoped=_SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0)
  size = 24 if abi >= 6 else 16 if abi >= 4 else 8
  ruleset = _syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size),
                     ctypes.c_uint32(0))
  try:
    for paths, access in ((read_paths, READ), (write_paths, WRITE)):
      for path in paths:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
          allowed = access & fs if os.path.isdir(path) else access & fs & _FILE_ONLY
          rule = _PathBeneathAttr(allowed_access=allowed, parent_fd=fd)
          _syscall(_SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH),
                   ctypes.byref(rule), ctypes.c_uint32(0))
        finally:
          os.close(fd)
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), ctypes.c_ulong(0),
                   ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
      raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    _syscall(_SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0))
  finally:
    os.close(ruleset)
  _drop_capabilities()
