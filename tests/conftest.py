"""Test-session setup: 8 simulated CPU devices for sharding tests, a persistent compile cache."""

import os

# Must happen before JAX initialises its backends.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(os.environ.get("SAGE_JAX_CACHE", os.path.expanduser("~/.cache/sage_jax")),
                 "jax_compile_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
