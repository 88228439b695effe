"""Where the mini AppWorld lives, and building it once per builder version.

Pure Python: the build runs `python -m sage_jax.envs.appworld.build_mini` in a child
process, so calling `ensure_mini_world()` from the trainer never imports appworld.
"""

import os
import shutil
import subprocess
import sys
import tempfile

# Bump whenever the builder's output changes; it keys the cache.
BUILDER_VERSION = "2"
DEFAULT_SEED = 0
MANIFEST = "mini_world.json"  # written last by the builder: its presence marks a full build


def cache_root() -> str:
  return os.environ.get("SAGE_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache",
                                                       "sage_jax"))


def mini_world_root() -> str:
  """The APPWORLD_ROOT of the cached mini world (it may not be built yet)."""
  return os.path.join(cache_root(), "appworld_mini", BUILDER_VERSION)


def ensure_mini_world() -> str:
  """Builds the mini world into the cache unless it is there; returns its root.

  The build goes to a fresh temporary directory that is renamed into place, so a reader
  never sees a half-built world; when two processes build at once, the first rename
  wins and the other build is discarded.
  """
  root = mini_world_root()
  if os.path.exists(os.path.join(root, MANIFEST)):
    return root
  parent = os.path.dirname(root)
  os.makedirs(parent, exist_ok=True)
  staging = tempfile.mkdtemp(dir=parent, prefix=f".{BUILDER_VERSION}-building-")
  try:
    command = [sys.executable, "-m", "sage_jax.envs.appworld.build_mini", f"--out={staging}",
               f"--seed={DEFAULT_SEED}"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
      raise RuntimeError(f"Building the mini AppWorld failed ({' '.join(command)}):\n"
                         + (done.stdout + done.stderr)[-4000:])
    try:
      os.rename(staging, root)
    except OSError:
      if not os.path.exists(os.path.join(root, MANIFEST)):
        raise
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return root
