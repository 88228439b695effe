"""Run directories on a local disk or in an object store (`gs://`, or any URL `etils.epath`
handles: `s3://`, `az://`, `hf://`).

Everything a run writes into or reads from its workdir goes through an `epath.Path` made
by `path`; orbax writes the checkpoint arrays itself (tensorstore speaks `gs://`). An
object store has no rename and no append, so:

- a file is written whole, in one upload, which readers see complete or not at all (a local
  file goes through a temporary file and a rename for the same effect): `write_text`,
  `write_bytes`;
- a file that grows (metrics.jsonl, TensorBoard's events) is written in a local directory
  and copied up whole after each change: `LocalMirror`;
- a writer that only writes local files (safetensors) writes into a local directory that
  then replaces the remote one: `staged_dir`;
- host-local things (AppWorld's outputs, process logs) stay on the host: `local_subdir`.

A local (or NFS) workdir is held by one run at a time (`WorkdirLock`); an object store has no
lock to take, so two runs on one `gs://` workdir are not stopped.

gcsfs caches directory listings, which go stale when tensorstore or another host writes
into the bucket; listings are read rarely here (checkpoint steps, a step's files), so
that cache is off for gcs:// unless configured otherwise (`FSSPEC_GCS_USE_LISTINGS_CACHE`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
from typing import Any, Iterator

from etils import epath

PathLike = str | os.PathLike


# The file in a local workdir that `WorkdirLock` locks; it names the holder.
LOCK_FILE = "workdir.lock"


class WorkdirError(ValueError):
  """A workdir, or a file in it, that cannot be used; the message names it and the
  problem."""


def is_remote(p: PathLike) -> bool:
  """Whether `p` is a URL (scheme://...) rather than a local path."""
  return "://" in os.fspath(p)


def path(p: PathLike) -> epath.Path:
  """`p` as an epath.Path; a local relative path becomes absolute."""
  if not is_remote(p):
    return epath.Path(os.path.abspath(p))
  scheme = os.fspath(p).split("://", 1)[0]
  try:
    result = epath.Path(p)
  except KeyError:  # epath's registry of schemes
    raise WorkdirError(f"{p}: unknown scheme {scheme}://; use a local path or a URL that "
                       f"etils.epath handles (gs://, s3://, az://, hf://)") from None
  if scheme == "gs":
    import fsspec
    fsspec.config.conf.setdefault("gcs", {}).setdefault("use_listings_cache", False)
  return result


def open_workdir(workdir: PathLike, flag: str = "") -> epath.Path:
  """The run's workdir, checked now rather than at the first checkpoint an hour later: a
  local one is created; a remote one's bucket must answer (its filesystem package installed,
  the bucket there and visible with these credentials). `flag`, the command-line flag that
  gave `workdir`, starts the error's message."""
  try:
    return _open_dir(workdir)
  except WorkdirError as e:
    if not flag:
      raise
    raise WorkdirError(f"{flag}={e}") from None


def _open_dir(workdir: PathLike) -> epath.Path:
  root = path(workdir)
  if not is_remote(root):
    if root.exists() and not root.is_dir():
      raise WorkdirError(f"{workdir}: not a directory")
    try:
      root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise WorkdirError(f"{workdir}: cannot be made: {e.strerror or e}") from e
    try:  # a read-only mount, another user's directory
      fd, probe = tempfile.mkstemp(prefix=".write_test-", dir=root)
      os.close(fd)
      os.remove(probe)
    except OSError as e:
      raise WorkdirError(f"{workdir}: cannot be written to ({e.strerror or e}); use a "
                         "directory this user can write") from e
    return root
  scheme, rest = os.fspath(root).split("://", 1)
  bucket = epath.Path(f"{scheme}://{rest.split('/', 1)[0]}")
  try:
    found = bucket.exists()
  except ImportError as e:  # fsspec names the package to install
    raise WorkdirError(f"{workdir}: {scheme}:// needs its fsspec filesystem: {e}") from e
  if not found:
    raise WorkdirError(f"{workdir}: bucket {bucket} does not exist or cannot be reached "
                       f"with these credentials")
  return root


class WorkdirLock:
  """Process 0's hold on a local (or NFS) workdir while a run or an evaluation writes into
  it: an exclusive flock on `<workdir>/workdir.lock`, which names the holder. Another run on
  the same workdir (a resubmitted job overlapping a live one) fails here, before it writes or
  starts anything; the kernel drops the lock when the process ends, however it ends, so a
  crashed or killed run leaves no stale lock (the file stays). Nothing is held for a remote
  workdir (no lock to take) or with `hold` False (the other processes of a run, which share
  the workdir). `flag`, the command-line flag that gave the workdir, starts the error."""

  def __init__(self, workdir: PathLike, flag: str = "", hold: bool = True):
    self._file = None
    if not hold or is_remote(workdir):
      return
    lock_path = os.path.join(os.fspath(path(workdir)), LOCK_FILE)
    name = f"{flag}={workdir}" if flag else os.fspath(workdir)
    try:
      f = open(lock_path, "a+", encoding="utf-8")
    except OSError as e:  # another user's lock file
      raise WorkdirError(f"{name}: {lock_path} cannot be opened ({e.strerror or e})") from e
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      f.seek(0)
      holder = f.read().strip() or "another process"
      f.close()
      raise WorkdirError(f"{name}: in use by another run ({holder}; {lock_path}): wait for "
                         f"it to end or stop it, or use another {flag or 'workdir'}") from None
    f.truncate(0)
    f.write(f"pid {os.getpid()} on host {socket.gethostname()}, since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    self._file = f

  def release(self) -> None:
    """Lets another run take the workdir; idempotent."""
    if self._file is not None:
      self._file.close()
      self._file = None

  def __enter__(self) -> WorkdirLock:
    return self

  def __exit__(self, *exc_info) -> None:
    self.release()


def read_json(p: PathLike) -> Any | None:
  """The JSON value of file `p`, or None if there is none; a file that is not valid JSON (cut
  short, edited) raises WorkdirError naming it."""
  p = path(p)
  if not p.exists():
    return None
  try:
    return json.loads(p.read_text(encoding="utf-8"))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise WorkdirError(f"{p}: not valid JSON ({e}); repair or remove it") from e


def write_text(p: PathLike, text: str) -> None:
  """Writes `p` whole: a reader never sees part of it (see the module doc)."""
  write_bytes(p, text.encode("utf-8"))


def write_bytes(p: PathLike, data: bytes) -> None:
  """`write_text` for bytes."""
  p = path(p)
  if is_remote(p):
    p.write_bytes(data)
    return
  p.parent.mkdir(parents=True, exist_ok=True)
  tmp = p.with_name(f"{p.name}.tmp-{os.getpid()}")
  with open(tmp, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, p)


def write_json(p: PathLike, value: Any, **dump_kwargs) -> None:
  write_text(p, json.dumps(value, indent=2, **dump_kwargs))


def local_subdir(workdir: PathLike, name: str) -> str | None:
  """`workdir/name` for files that must stay on this host, or None for a remote workdir
  (the caller then uses a local directory of its own)."""
  return None if is_remote(workdir) else os.path.join(os.path.abspath(workdir), name)


def copy_tree(src: PathLike, dst: PathLike) -> None:
  """Copies every file under `src` to the same relative path under `dst` (either may be
  remote)."""
  src, dst = path(src), path(dst)
  if not is_remote(dst):
    dst.mkdir(parents=True, exist_ok=True)
  for entry in src.iterdir():
    if entry.is_dir():
      copy_tree(entry, dst / entry.name)
    else:
      (dst / entry.name).write_bytes(entry.read_bytes())


def file_sizes(root: PathLike) -> dict[str, int]:
  """Relative path -> size in bytes of every file under `root`."""
  root = path(root)
  sizes = {}
  for entry in root.iterdir():
    if entry.is_dir():
      sizes.update({f"{entry.name}/{k}": v for k, v in file_sizes(entry).items()})
    else:
      sizes[entry.name] = entry.stat().length
  return sizes


@contextlib.contextmanager
def staged_dir(target: PathLike, *, writer: bool = True) -> Iterator[str]:
  """A local directory to write `target` with writers that only write local files: `target`
  itself when local; else a temporary one whose files replace `target`'s at the end, by
  the `writer` process only (not atomically: an interrupted upload leaves a partial
  directory, which the next one replaces)."""
  if not is_remote(target):
    yield os.fspath(path(target))
    return
  with tempfile.TemporaryDirectory(prefix="sage_jax_stage_") as tmp:
    local = os.path.join(tmp, "out")
    yield local
    if writer:
      remote = path(target)
      remote.rmtree(missing_ok=True)
      copy_tree(local, remote)


class LocalMirror:
  """A local directory standing in for `target` for writers that append to local files:
  `sync()` copies each file changed since the last sync up to `target`, whole (an object
  store cannot append, and one upload is atomic). A local `target` is used directly, and
  `sync()` does nothing."""

  def __init__(self, target: PathLike):
    self.target = path(target)
    self.remote = is_remote(self.target)
    self.local = (tempfile.mkdtemp(prefix="sage_jax_mirror_") if self.remote
                  else os.fspath(self.target))
    os.makedirs(self.local, exist_ok=True)
    self._synced: dict[str, tuple[int, int]] = {}

  def sync(self) -> None:
    if not self.remote:
      return
    for directory, _, files in os.walk(self.local):
      for name in files:
        local = os.path.join(directory, name)
        stat = os.stat(local)
        relative = os.path.relpath(local, self.local)
        if self._synced.get(relative) != (stat.st_size, stat.st_mtime_ns):
          (self.target / relative).write_bytes(epath.Path(local).read_bytes())
          self._synced[relative] = (stat.st_size, stat.st_mtime_ns)

  def close(self) -> None:
    self.sync()
    if self.remote:
      shutil.rmtree(self.local, ignore_errors=True)
