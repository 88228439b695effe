"""Where the mini AppWorld lives, and building it once per builder version.

Pure Python: the build runs `python -m sage_jax.envs.appworld.build_mini` in a child
process, so calling `ensure_mini_world()` from the trainer never imports appworld.

The cached world is shared by every test, demo and run on the machine, so it is kept
read-only on disk and checked against the digest stored at build time on every use: a
world that something wrote into is rebuilt, not trusted.
"""

import hashlib
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile

from sage_jax import assets

# Bump whenever the builder's output changes; it keys the cache.
BUILDER_VERSION = "2"
DEFAULT_SEED = 0
MINI_WORLD_ENTRY = f"appworld_mini/{BUILDER_VERSION}"  # its place under the cache root
MANIFEST = "mini_world.json"  # written last by the builder: its presence marks a full build
DIGEST = "data.sha256"  # digest of every other file and directory, written at caching


def mini_world_root() -> str:
  """The APPWORLD_ROOT of the cached mini world (it may not be built yet)."""
  return str(assets.cache_root() / MINI_WORLD_ENTRY)


def data_digest(root: str) -> str:
  """SHA-256 over what `root` holds but DIGEST: the relative path of every directory, and
  the relative path and bytes of every file (so an emptied directory that a writer left
  behind differs too)."""
  entries = []
  for d, dirs, files in os.walk(root):
    entries += [(os.path.relpath(os.path.join(d, name), root), None) for name in dirs]
    entries += [(os.path.relpath(os.path.join(d, name), root), os.path.join(d, name))
                for name in files]
  digest = hashlib.sha256()
  for relative, path in sorted(entries):
    if path is None:
      digest.update(relative.encode() + b"/\0")
    elif relative != DIGEST:
      digest.update(relative.encode() + b"\0")
      with open(path, "rb") as f:
        digest.update(hashlib.sha256(f.read()).digest())
  return digest.hexdigest()


def damage(root: str) -> str | None:
  """Why the cached world at `root` cannot be trusted, or None when it is intact."""
  if not os.path.exists(os.path.join(root, MANIFEST)):
    return "incomplete (no manifest)"
  try:
    with open(os.path.join(root, DIGEST)) as f:
      stored = f.read().strip()
  except FileNotFoundError:
    return "no stored digest"
  try:
    digest = data_digest(root)
  except FileNotFoundError as e:  # another process moved a damaged world aside meanwhile
    return f"{e.filename} went away while it was read"
  if digest != stored:
    return "its files or directories differ from the digest stored when it was built"
  return None


def _make_read_only(root: str) -> None:
  for d, dirs, files in os.walk(root):
    for name in files:
      os.chmod(os.path.join(d, name), 0o444)
  for d, _, _ in os.walk(root, topdown=False):
    os.chmod(d, 0o555)


def _remove(root: str) -> None:
  """rmtree of a tree that may be read-only."""
  for d, _, _ in os.walk(root):
    os.chmod(d, stat.S_IRWXU)
  shutil.rmtree(root, ignore_errors=True)


def build_command(out: str) -> list[str]:
  """The build command as the README gives it (its default seed is DEFAULT_SEED)."""
  return [sys.executable, "-m", "sage_jax.envs.appworld.build_mini", f"--out={out}"]


def ensure_mini_world() -> str:
  """Builds the mini world into the cache unless an intact one is there; returns its root.

  The build goes to a fresh temporary directory that is digested, made read-only and
  renamed into place, so a reader never sees a half-built world. Processes that find no
  intact world wait for one another (`assets.build_lock`), so one builds and the others
  find its world; where the filesystem has no locks, they build at once and the first
  rename wins. A damaged cached world is moved aside, rebuilt and then removed.
  """
  root = mini_world_root()
  if os.path.exists(root) and damage(root) is None:
    return root
  parent = os.path.dirname(root)
  with assets.build_lock(assets.lock_path(MINI_WORLD_ENTRY)):
    if os.path.exists(root):
      problem = damage(root)
      if problem is None:  # built, or rebuilt, while this process waited
        return root
      logging.warning("The cached mini AppWorld at %s is damaged (%s): rebuilding it.", root,
                      problem)
      aside = tempfile.mkdtemp(dir=parent, prefix=f".{BUILDER_VERSION}-damaged-")
      try:
        os.rename(root, os.path.join(aside, "world"))
      except FileNotFoundError:  # another process moved it first
        pass
      _remove(aside)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(dir=parent, prefix=f".{BUILDER_VERSION}-building-")
    try:
      command = build_command(staging)
      done = subprocess.run(command, capture_output=True, text=True)
      if done.returncode != 0:
        raise RuntimeError(f"Building the mini AppWorld failed ({' '.join(command)}):\n"
                           + (done.stdout + done.stderr)[-4000:])
      with open(os.path.join(staging, DIGEST), "w") as f:
        f.write(data_digest(staging) + "\n")
      _make_read_only(staging)
      try:
        os.rename(staging, root)
      except OSError:
        if not os.path.exists(os.path.join(root, MANIFEST)):
          raise
    finally:
      _remove(staging)
  return root
