"""Trains: `python -m sage_jax.train --config=configs/sage.py:<preset> --workdir=DIR`.

Config overrides go as `--config.<section>.<key>=<value>`. The resolved config is printed and
written to DIR/config.json; an invalid config fails here, before anything compiles.
See `sage_jax.pipeline` for the stages and what lands in DIR.
"""

import logging
import os

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from sage_jax import multihost, pipeline, run_config


# XLA:CPU's default schedule starts independent work early, which keeps every layer's
# recomputed activations alive at once and undoes remat (the 0.5B on 4k tokens: 31 GB of
# temporaries instead of 4.8). The memory-optimised schedule keeps remat's savings; other
# backends ignore the flag. It must be set before JAX starts its backend.
CPU_REMAT_FLAG = "--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"


def main(argv) -> None:
  del argv
  config, workdir = flags.FLAGS.config, flags.FLAGS.workdir
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if config.model.remat != "none" and "xla_cpu_scheduler_type" not in xla_flags:
    os.environ["XLA_FLAGS"] = f"{xla_flags} {CPU_REMAT_FLAG}".strip()
  if not flags.FLAGS["verbosity"].present:  # orbax logs every file at INFO
    absl_logging.set_verbosity(absl_logging.WARNING)
  multihost.initialize()
  logging.getLogger("httpx").setLevel(logging.WARNING)
  lead = multihost.is_lead()
  if lead:
    print(config, flush=True)
  summary = pipeline.run(config, workdir)
  if lead:
    print(summary["table"])
    print(f"workdir: {summary['workdir']}  ({summary['elapsed_s']} s)")


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", None, "configs/<file>.py:<preset>",
                                  lock_config=True)
  flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, exports).")
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main, flags_parser=run_config.parse_flags)
