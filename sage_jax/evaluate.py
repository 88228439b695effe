r"""Evaluates the Skill Library Agent on an AppWorld split.

  python -m sage_jax.evaluate --config=configs/eval.py:<preset> --workdir=DIR

See `sage_jax.eval.runner` for what runs and what is written into DIR.
"""

from __future__ import annotations

import json
import logging

from absl import app, flags
from ml_collections import config_flags

from sage_jax import multihost, run_config
from sage_jax.eval import metrics as metrics_lib
from sage_jax.eval.runner import evaluate


def main(argv) -> None:
  del argv
  config, workdir = flags.FLAGS.config, flags.FLAGS.workdir
  if config is None or not workdir:
    raise app.UsageError("--config=configs/eval.py:<preset> and --workdir=DIR are required")
  multihost.initialize()
  logging.getLogger("httpx").setLevel(logging.WARNING)
  report = evaluate(config, workdir)
  if not multihost.is_lead():
    return
  print(metrics_lib.markdown_table(report["metrics"], report["split"]))
  print(json.dumps({k: report[k] for k in ("split", "policy", "retrieval", "elapsed_s")}
                   | {"tgc": report["metrics"]["overall"]["tgc"],
                      "sgc": report["metrics"]["overall"]["sgc"],
                      "appworld": report.get("appworld")}))


def define_flags() -> None:
  """The entry point's flags (defined only when run, so importing this module defines none)."""
  config_flags.DEFINE_config_file("config", None, "Evaluation config file.")
  flags.DEFINE_string("workdir", None, "Directory for the reports.")


if __name__ == "__main__":
  define_flags()
  app.run(main, flags_parser=run_config.parse_flags)
