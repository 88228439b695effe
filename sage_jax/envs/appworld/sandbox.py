"""OS confinement of the process that runs agent code: Landlock, seccomp, no new privileges,
no capabilities.

Python-level guards (AppWorld's blocked names) fall to a disguised import; these limits are
set by the kernel on the episode process before any agent code runs and cannot be lifted by
it or by any process it starts:

- files: read only the Python installation and the paths granted (the task's own public
  files); write only beneath the episode's experiment directory; execute no program;
- network: no TCP bind or connect (Landlock ABI >= 4), and no socket but TCP over IPv4 or
  IPv6 (seccomp): Landlock governs only TCP, so UDP, MPTCP, raw, netlink and UNIX sockets
  would reach whatever listens outside; no io_uring either, whose operations bypass both;
- processes: none started (seccomp: no fork, vfork, clone but of a thread, exec), since the
  memory limit (RLIMIT_AS) holds per process and root ignores RLIMIT_NPROC; threads work;
- signals and abstract UNIX sockets: none to processes outside the sandbox, so agent code
  cannot stop its supervisor or the trainer (Landlock ABI >= 6; signals to any process but
  itself are refused by seccomp too);
- other processes: no resource limits, scheduling, nice or I/O priority set on any process
  but itself (seccomp), which root may otherwise do to every process of the machine (a CPU
  time limit on the trainer gets it killed);
- privileges: no_new_privs, and every capability dropped, so a process running as root
  cannot raise its resource limits again or bypass file modes;
- metadata (`hide`, where unprivileged user and mount namespaces are allowed): the data's
  tasks directory shows only the task's public files, so no answer can even be `stat`ed.

Landlock needs Linux >= 5.13 with it enabled (no root needed), seccomp an x86_64 or aarch64
kernel with seccomp filters. `protections()` says what the running kernel gives; the pool
reports it and refuses to start without either unless `EnvPoolConfig.sandbox` is "off".
"""

import ctypes
import errno
import os
import socket
import sys
import sysconfig

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # all Linux arches
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
_SYS_CAPSET = {"x86_64": 126, "aarch64": 91}.get(os.uname().machine)
_CAP_VERSION_3 = 0x20080522

# seccomp: the audit arch a filter checks first and the system calls it knows, by machine.
_AUDIT_ARCH_X86_64 = 0xC000003E
_SECCOMP_ARCH = {
  "x86_64": (_AUDIT_ARCH_X86_64, dict(
    seccomp=317, socket=41, socketpair=53, clone=56, clone3=435, fork=57, vfork=58, execve=59,
    execveat=322, io_uring_setup=425, prlimit64=302, sched_setaffinity=203,
    sched_setparam=142, sched_setscheduler=144, sched_setattr=314, setpriority=141,
    ioprio_set=251, kill=62, tkill=200, tgkill=234, rt_sigqueueinfo=129,
    rt_tgsigqueueinfo=297, pidfd_open=434, pidfd_send_signal=424)),
  "aarch64": (0xC00000B7, dict(  # aarch64 has no fork or vfork: glibc calls clone
    seccomp=277, socket=198, socketpair=199, clone=220, clone3=435, execve=221, execveat=281,
    io_uring_setup=425, prlimit64=261, sched_setaffinity=122, sched_setparam=118,
    sched_setscheduler=119, sched_setattr=274, setpriority=140, ioprio_set=30, kill=129,
    tkill=130, tgkill=131, rt_sigqueueinfo=138, rt_tgsigqueueinfo=240, pidfd_open=434,
    pidfd_send_signal=424)),
}.get(os.uname().machine)
# Calls that act on the process their first argument names (0: the caller): allowed on the
# episode process itself only. Every process here runs as root, so without this rule agent
# code could set another's resource limits (prlimit64: the trainer's CPU time, which the
# kernel then kills it for) or scheduling, whatever Landlock scopes.
_OWN_OR_ZERO = ("prlimit64", "sched_setaffinity", "sched_setparam", "sched_setscheduler",
                "sched_setattr")
# Signals and process handles: to the episode process itself only (kill's 0 is a group).
_OWN_ONLY = ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_open")
_PRIO_PROCESS, _IOPRIO_WHO_PROCESS = 0, 1
_X32_SYSCALL_BIT = 0x40000000  # x86_64's x32 calls share its audit arch: all refused
_SECCOMP_SET_MODE_FILTER, _SECCOMP_GET_ACTION_AVAIL = 1, 2
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_LD_ABS, _JEQ, _JGE, _JSET, _AND, _RET = 0x20, 0x15, 0x35, 0x45, 0x54, 0x06  # BPF opcodes
_CLONE_THREAD, _SOCK_TYPE_MASK = 0x10000, 0xF

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
NO_SECCOMP = (f"seccomp filters are not available on this {os.uname().machine} kernel (needs "
              "x86_64 or aarch64 with CONFIG_SECCOMP_FILTER), so agent code could open "
              "non-TCP sockets and start processes; set EnvPoolConfig.sandbox='off' to run "
              "agent code unconfined, where it can read every task's answers.")


class SandboxError(RuntimeError):
  """The sandbox asked for cannot be set up on this machine."""


class _RulesetAttr(ctypes.Structure):
  _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
              ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
  _pack_ = 1
  _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _SockFilter(ctypes.Structure):
  _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
              ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
  _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _syscall(number: int, *args) -> int:
  result = _libc.syscall(number, *args)
  if result < 0:
    errno = ctypes.get_errno()
    raise OSError(errno, os.strerror(errno))
  return result


_CLONE_NEWNS, _CLONE_NEWUSER = 0x00020000, 0x10000000
_MS_RDONLY, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
  encode = lambda text: None if text is None else text.encode()
  if _libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)) != 0:
    errno = ctypes.get_errno()
    raise OSError(errno, f"mount {target}: {os.strerror(errno)}")


def _enter_mount_namespace() -> None:
  """User and mount namespaces of this process's own, with this user's ids mapped to
  themselves, and no mount it makes seen outside."""
  uid, gid = os.getuid(), os.getgid()
  if _libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS) != 0:
    errno = ctypes.get_errno()
    raise OSError(errno, f"unshare: {os.strerror(errno)}")
  for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                     ("gid_map", f"{gid} {gid} 1")):
    with open(f"/proc/self/{name}", "w") as f:
      f.write(text)
  _mount(None, "/", None, _MS_REC | _MS_PRIVATE)


def hiding_available(directory: str) -> bool:
  """Whether `hide` works on `directory` here: it needs unprivileged user and mount
  namespaces (a container's seccomp profile or the distribution may refuse them). Tried in
  a fork."""
  pid = os.fork()
  if pid == 0:
    code = 1
    try:
      hide(directory, [])
      code = 0
    finally:
      os._exit(code)
  return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def hide(directory: str, keep: list[str]) -> None:
  """Covers `directory` with an empty file system, for this process and what it starts, and
  binds back at their places only the paths of `keep` (beneath it; those missing are
  skipped). Landlock refuses reads, not a path's metadata: without this, agent code could
  still `stat` every task's answer files and learn their sizes. Call it before `confine`
  (which drops the capabilities that could undo it), while this process has one thread."""
  directory = os.path.realpath(directory)
  kept = [os.path.realpath(p) for p in keep if os.path.exists(p)]
  outside = [p for p in kept if not _beneath(p, directory) or p == directory]
  if outside:
    raise ValueError(f"paths to keep must lie beneath {directory}: {outside}")
  _enter_mount_namespace()
  fds = [os.open(p, os.O_PATH | os.O_CLOEXEC) for p in kept]  # this namespace's mounts
  try:
    _mount("tmpfs", directory, "tmpfs", 0, "mode=0755,size=64k")
    for path, fd in zip(kept, fds):
      os.makedirs(os.path.dirname(path), exist_ok=True)
      if os.path.isdir(f"/proc/self/fd/{fd}"):
        os.mkdir(path)
      else:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o444))
      _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
    _mount(None, directory, None, _MS_REMOUNT | _MS_RDONLY)
  finally:
    for fd in fds:
      os.close(fd)


def landlock_abi() -> int:
  """The kernel's Landlock ABI version; 0 when Landlock is missing or disabled."""
  try:
    return _syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0),
                    ctypes.c_uint32(_CREATE_RULESET_VERSION))
  except OSError:
    return 0


def seccomp_available() -> bool:
  """Whether this kernel and machine take confine()'s seccomp filter."""
  if _SECCOMP_ARCH is None:
    return False
  action = ctypes.c_uint32(_RET_ERRNO)
  try:
    _syscall(_SECCOMP_ARCH[1]["seccomp"], ctypes.c_uint(_SECCOMP_GET_ACTION_AVAIL),
             ctypes.c_uint(0), ctypes.byref(action))
  except OSError:
    return False
  return True


def unavailable() -> str | None:
  """Why confine() would refuse on this machine; None when it can confine."""
  if landlock_abi() < 1:
    return UNAVAILABLE
  return None if seccomp_available() else NO_SECCOMP


def protections(abi: int | None = None, hidden: bool = False) -> list[str]:
  """What confine() enforces on this kernel, in words (empty: nothing, it refuses); `hidden`:
  whether the other files of the data are hidden as well (`hide`)."""
  abi = landlock_abi() if abi is None else abi
  if abi < 1 or not seccomp_available():
    return []
  found = ["files (read: system + task's public files; write: episode directory; no exec)"]
  if hidden:
    found.append("the data's other files hidden, their sizes too (mount namespace)")
  if abi >= 4:
    found.append("no TCP")
  if abi >= 6:
    found.append("no signals or abstract sockets out of the sandbox")
  return found + ["no socket but TCP, no io_uring", "no new processes (threads only)",
                  "no new privileges, no capabilities"]


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


def withhold(read_paths: list[str], withheld: str) -> list[str]:
  """`read_paths` with `withheld` left out of them (the package that holds the mini world's
  gold procedures, installed inside the Python installation). Landlock only grants, so a
  grant that holds it is replaced by the entries of each directory down to it but the one
  on the way; those directories themselves can no longer be listed."""
  withheld = os.path.realpath(withheld)
  kept, pending, seen = [], list(read_paths), set()
  while pending:
    path = os.path.realpath(pending.pop())
    if path in seen or path == withheld:
      continue
    seen.add(path)
    if _beneath(withheld, path):
      pending += [os.path.join(path, name) for name in os.listdir(path)]
    else:
      kept.append(path)
  return sorted(kept)


def _drop_capabilities() -> None:
  if os.getuid() != 0 and os.geteuid() != 0:
    return  # an unprivileged process has no capabilities to drop
  if _SYS_CAPSET is None:
    raise SandboxError(f"cannot drop capabilities on {os.uname().machine}")
  header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
  data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2 words: all zero
  _syscall(_SYS_CAPSET, header, data)


def _seccomp_program(arch: int, calls: dict[str, int],
                     pid: int) -> list[tuple[int, int, int, int]]:
  """The filter of process `pid`, as BPF (code, jt, jf, k). It refuses with EPERM every
  socket but TCP over IPv4/IPv6 (which Landlock governs), socketpair but AF_UNIX, io_uring,
  exec, and every clone but a thread's; clone3 (whose flags the filter cannot read) gets
  ENOSYS, so that glibc falls back to clone for threads. Resource limits, scheduling,
  priorities and signals reach `pid` alone (`_OWN_OR_ZERO`, `_OWN_ONLY`; tkill, whose thread
  id the filter cannot tie to a process, and pidfd_send_signal, whose pidfd may be another's
  /proc directory, are refused). Foreign arches and x32 calls are refused."""
  def load_arg(i: int) -> tuple:  # its low 32 bits (little-endian): all these are ints
    return (_LD_ABS, 16 + 8 * i)

  # (code, k, label if true, label if false); a label names the instruction after it.
  listing = [(_LD_ABS, 4), (_JEQ, arch, None, "eperm"), (_LD_ABS, 0)]
  if arch == _AUDIT_ARCH_X86_64:
    listing.append((_JGE, _X32_SYSCALL_BIT, "eperm", None))
  listing += [(_JEQ, calls["socket"], "socket", None),
              (_JEQ, calls["socketpair"], "socketpair", None),
              (_JEQ, calls["clone"], "clone", None), (_JEQ, calls["clone3"], "enosys", None)]
  listing += [(_JEQ, calls[name], "eperm", None) for name in
              ("fork", "vfork", "execve", "execveat", "io_uring_setup", "tkill",
               "pidfd_send_signal") if name in calls]
  listing += [(_JEQ, calls[name], "own_or_zero", None) for name in _OWN_OR_ZERO]
  listing += [(_JEQ, calls[name], "own", None) for name in _OWN_ONLY]
  listing += [(_JEQ, calls["setpriority"], "priority", None),
              (_JEQ, calls["ioprio_set"], "ioprio", None)]
  listing += [
    (_RET, _RET_ALLOW),
    "own_or_zero", load_arg(0), (_JEQ, 0, "allow", "own_pid"),
    "own", load_arg(0), "own_pid", (_JEQ, pid, "allow", "eperm"),
    "priority", load_arg(0), (_JEQ, _PRIO_PROCESS, "who", "eperm"),
    "ioprio", load_arg(0), (_JEQ, _IOPRIO_WHO_PROCESS, "who", "eperm"),
    "who", load_arg(1), (_JEQ, 0, "allow", None), (_JEQ, pid, "allow", "eperm"),
    "socket", load_arg(0), (_JEQ, socket.AF_INET, "type", None),
    (_JEQ, socket.AF_INET6, None, "eperm"),
    "type", load_arg(1), (_AND, _SOCK_TYPE_MASK), (_JEQ, socket.SOCK_STREAM, None, "eperm"),
    load_arg(2), (_JEQ, 0, "allow", None), (_JEQ, socket.IPPROTO_TCP, "allow", "eperm"),
    "socketpair", load_arg(0), (_JEQ, socket.AF_UNIX, "allow", "eperm"),
    "clone", load_arg(0), (_JSET, _CLONE_THREAD, "allow", "eperm"),
    "allow", (_RET, _RET_ALLOW),
    "eperm", (_RET, _RET_ERRNO | errno.EPERM),
    "enosys", (_RET, _RET_ERRNO | errno.ENOSYS)]
  labels, program = {}, []
  for item in listing:
    if isinstance(item, str):
      labels[item] = len(program)
    else:
      program.append(item + (None, None)[len(item) - 2:])

  def jump(label: str | None, i: int) -> int:
    return 0 if label is None else labels[label] - i - 1

  return [(code, jump(yes, i), jump(no, i), k) for i, (code, k, yes, no) in enumerate(program)]


def _install_seccomp() -> None:
  arch, calls = _SECCOMP_ARCH
  program = _seccomp_program(arch, calls, os.getpid())
  instructions = (_SockFilter * len(program))(*(_SockFilter(*op) for op in program))
  fprog = _SockFprog(len(program), instructions)
  _syscall(calls["seccomp"], ctypes.c_uint(_SECCOMP_SET_MODE_FILTER), ctypes.c_uint(0),
           ctypes.byref(fprog))


def confine(read_paths: list[str], write_paths: list[str]) -> None:
  """Restricts this process (and every process it starts) for good; see the module doc.

  Paths must exist. A file path grants only file rights on that file. Call it while this
  process has one thread: both Landlock and seccomp bind the calling thread (and what it
  starts) only.
  """
  if (why := unavailable()) is not None:
    raise SandboxError(why)
  abi = landlock_abi()
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
  _install_seccomp()
