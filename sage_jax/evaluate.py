r"""Evaluates the Skill Library Agent on an AppWorld split.

  python -m sage_jax.evaluate --config=configs/eval.py:<preset> --workdir=DIR
  python -m sage_jax.evaluate --run=RUN_DIR [--step=N] [--stage=rl|sft] \
      --config=configs/eval.py:<preset> [--config.retrieval.strategy=S ...] --workdir=DIR

With --run, the model is a training run's checkpoint (step N, default the latest), with the
run's own model, agent and sampler (engine, sampler_mesh) settings and tokenizer, read from
RUN_DIR/config.json; the --config file gives the evaluation's settings (its eval, retrieval
and pool sections) and the data is the run's (pipeline.data). So one trained run is
evaluated under several retrieval strategies, as the SAGE paper compares them. The merged
config is validated as a training run's is (`sage_jax.run_config`), so a misspelt key fails.

See `sage_jax.eval.runner` for what runs and what is written into DIR.
"""

from __future__ import annotations

import json
import logging
import sys

import jax
from absl import app, flags

from sage_jax import config_file, multihost, run_checkpoint, run_config
from sage_jax.eval import metrics as metrics_lib
from sage_jax.eval.runner import evaluate

# With --run: sections that come from the run (what the model is and how it acts), and those
# that come from --config (how it is evaluated).
RUN_SECTIONS = ("model", "agent", "engine", "sampler_mesh")
EVAL_SECTIONS = ("eval", "retrieval", "pool")


def evaluate_run(run_dir: str, eval_config, workdir: str, step: int | None = None,
                 stage: str = "rl") -> dict:
  """Evaluates checkpoint `step` of the run in `run_dir` with the eval, retrieval and pool
  sections of `eval_config`; returns the report."""
  from sage_jax.sampler import Engine
  from sage_jax.tokenizer import Tokenizer

  try:
    config = run_checkpoint.read_config(run_dir)
    for name in EVAL_SECTIONS:
      config[name] = eval_config[name]
    run = run_config.resolve(config, local_devices=jax.local_device_count(), trained=True)
  except (FileNotFoundError, run_config.ConfigError) as e:  # not a run; a bad key
    raise app.UsageError(str(e)) from e
  if run.eval.policy != "model":
    raise app.UsageError(f"--run evaluates the run's model: config.eval.policy must be "
                         f"'model', not {run.eval.policy!r}")
  try:
    # This process's sampling copy of the weights, on its own devices, as in training.
    model, mesh, step = run_checkpoint.restore_sampling_model(run_dir, run, step, stage)
  except FileNotFoundError as e:  # no such stage or step: name the ones there are
    raise app.UsageError(str(e)) from e
  tokenizer = Tokenizer(run_checkpoint.tokenizer_dir(run_dir, run))
  engine = Engine(model, run.engine, eos_ids=[tokenizer.eos_id, tokenizer.endoftext],
                  detokenize=tokenizer.decode, mesh=mesh)
  sections = run_config.with_seeds(config, run)
  sections["eval"] = {**sections["eval"], "data": run.pipeline.data}
  return evaluate(sections, workdir, engine=engine, tokenizer=tokenizer,
                  checkpoint={"run": run_dir, "stage": stage, "step": step})


def main(argv) -> None:
  del argv
  FLAGS = flags.FLAGS
  config, workdir, run_dir = FLAGS.config, FLAGS.workdir, FLAGS.run
  if config is None or not workdir:
    raise app.UsageError("--config=configs/eval.py:<preset> and --workdir=DIR are required")
  unknown = sorted(set(config) - set(RUN_SECTIONS) - set(EVAL_SECTIONS))
  if unknown:  # a misspelt section would otherwise leave its settings at their defaults
    raise app.UsageError(f"config.{unknown[0]}: unknown section of an evaluation config; "
                         f"known: {sorted(RUN_SECTIONS + EVAL_SECTIONS)}")
  if run_dir is None and (FLAGS.step is not None or FLAGS["stage"].present):
    raise app.UsageError("--step and --stage choose a checkpoint of --run=RUN_DIR")
  if run_dir is None and not (config.model.get("spec") or config.model.get("preset")):
    raise app.UsageError("this config names no model (configs/eval.py:run evaluates a trained "
                         "run's): pass --run=RUN_DIR, or set --config.model.spec")
  from_run = [a for a in sys.argv if a.startswith(tuple(f"--config.{s}." for s in RUN_SECTIONS))]
  if run_dir is not None and from_run:
    raise app.UsageError(f"{from_run[0]}: with --run the {', '.join(RUN_SECTIONS)} sections "
                         f"are the run's own (RUN_DIR/config.json)")
  multihost.initialize()
  logging.getLogger("httpx").setLevel(logging.WARNING)
  if run_dir is None:
    report = evaluate(config, workdir)
  else:
    report = evaluate_run(run_dir, config, workdir, FLAGS.step, FLAGS.stage)
  multihost.finish()
  if not multihost.is_lead():
    return
  print(metrics_lib.markdown_table(report["metrics"], report["split"]))
  print(json.dumps({k: report[k] for k in ("split", "policy", "retrieval", "elapsed_s")}
                   | {"tgc": report["metrics"]["overall"]["tgc"],
                      "sgc": report["metrics"]["overall"]["sgc"],
                      "appworld": report.get("appworld"),
                      "checkpoint": report.get("checkpoint")}))


def define_flags() -> None:
  """The entry point's flags (defined only when run, so importing this module defines none)."""
  config_file.define_flag("config", "Evaluation config file (configs/eval.py:<preset>).")
  flags.DEFINE_string("workdir", None, "Directory for the reports.")
  flags.DEFINE_string("run", None, "A training run's workdir: evaluate its checkpoint.")
  flags.DEFINE_integer("step", None, "With --run: the checkpoint step (default: the latest).")
  flags.DEFINE_enum("stage", "rl", list(run_checkpoint.STAGE_DIRS),
                    "With --run: which stage's checkpoints.")


if __name__ == "__main__":
  define_flags()
  config_file.run(main)
