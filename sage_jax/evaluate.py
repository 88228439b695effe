r"""Evaluates the Skill Library Agent on an AppWorld split.

  python -m sage_jax.evaluate --config=configs/eval.py:<preset> --workdir=DIR
  python -m sage_jax.evaluate --run=RUN_DIR [--step=N] [--stage=rl|sft] \
      --config=configs/eval.py:<preset> [--config.retrieval.strategy=S ...] --workdir=DIR

With --run, the model is a training run's checkpoint (step N, default the latest), with the
run's own model, agent and sampler (engine, sampler_mesh) settings and tokenizer, read from
RUN_DIR/config.json; the --config file gives the evaluation's settings (its eval, retrieval
and pool sections) and the data is the run's (pipeline.data). So one trained run is
evaluated under several retrieval strategies, as the SAGE paper compares them. What the
model is and how it acts (model, agent) cannot be changed; where it samples can, for a host
unlike the run's: `--config.sampler_mesh.tensor=1 --config.engine.num_slots=4` replace the
run's values of those keys. The merged config is validated as a training run's is
(`sage_jax.run_config`), so a misspelt key fails.

A stopped evaluation (a preemption, a crash) resumes when the same command runs again: the
scenarios it finished are kept in DIR and only the others are played (`sage_jax.eval.progress`).
A finished report in DIR of an evaluation with other settings or another checkpoint is refused
(`sage_jax.eval.runner.check_report`): each evaluation has a --workdir of its own.
See `sage_jax.eval.runner` for what runs and what is written into DIR.
"""

from __future__ import annotations

import json
import logging

import jax
from absl import app, flags
from ml_collections import config_flags

from sage_jax import config_file, multihost, run_checkpoint, run_config
from sage_jax.eval import metrics as metrics_lib
from sage_jax.eval.runner import evaluate

# With --run: sections that are the run's (what the model is and how it acts), those that are
# the run's unless set on the command line (where the model samples: another host may need
# another mesh or fewer slots), and those that come from --config (how it is evaluated).
RUN_SECTIONS = ("model", "agent")
HOST_SECTIONS = ("engine", "sampler_mesh")
EVAL_SECTIONS = ("eval", "retrieval", "pool")


def evaluate_run(run_dir: str, eval_config, workdir: str, step: int | None = None,
                 stage: str = "rl", host: dict | None = None) -> dict:
  """Evaluates checkpoint `step` of the run in `run_dir` with the eval, retrieval and pool
  sections of `eval_config`; `host` maps keys of the engine and sampler_mesh sections
  ("engine.num_slots") to values that replace the run's. Returns the report."""
  from sage_jax.sampler import Engine
  from sage_jax.tokenizer import Tokenizer

  try:
    config = run_checkpoint.read_config(run_dir)
    for name in EVAL_SECTIONS:
      config[name] = eval_config[name]
    for key, value in (host or {}).items():
      section, _, name = key.partition(".")
      if section not in HOST_SECTIONS:
        raise run_config.ConfigError(f"config.{key}: with --run only the "
                                     f"{' and '.join(HOST_SECTIONS)} sections can be set")
      config[section][name] = value
    run = run_config.resolve(config, local_devices=jax.local_device_count(), trained=True)
  except (FileNotFoundError, run_config.ConfigError) as e:  # not a run; a bad key
    raise app.UsageError(str(e)) from e
  if run.eval.policy != "model":
    raise app.UsageError(f"--run evaluates the run's model: config.eval.policy must be "
                         f"'model', not {run.eval.policy!r}")
  try:
    step = run_checkpoint.checkpoint_step(run_dir, stage, step)
  except FileNotFoundError as e:  # no such stage or step: name the ones there are
    raise app.UsageError(str(e)) from e
  tokenizer = Tokenizer(run_checkpoint.tokenizer_dir(run_dir, run))

  def make_engine() -> Engine:
    """This process's sampling copy of the weights, on its own devices, as in training."""
    model, mesh, _ = run_checkpoint.restore_sampling_model(run_dir, run, step, stage)
    return Engine(model, run.engine, eos_ids=[tokenizer.eos_id, tokenizer.endoftext],
                  detokenize=tokenizer.decode, mesh=mesh)

  sections = run_config.with_seeds(config, run)
  sections["eval"] = {**sections["eval"], "data": run.pipeline.data}
  return evaluate(sections, workdir, make_engine=make_engine, tokenizer=tokenizer,
                  checkpoint={"run": run_dir, "stage": stage, "step": step}, resume=True)


def main(argv) -> None:
  del argv
  FLAGS = flags.FLAGS
  config, workdir, run_dir = FLAGS.config, FLAGS.workdir, FLAGS.run
  if config is None or not workdir:
    raise app.UsageError("--config=configs/eval.py:<preset> and --workdir=DIR are required")
  sections = RUN_SECTIONS + HOST_SECTIONS + EVAL_SECTIONS
  unknown = sorted(set(config) - set(sections))
  if unknown:  # a misspelt section would otherwise leave its settings at their defaults
    raise app.UsageError(f"config.{unknown[0]}: unknown section of an evaluation config; "
                         f"known: {sorted(sections)}")
  if run_dir is None and (FLAGS.step is not None or FLAGS["stage"].present):
    raise app.UsageError("--step and --stage choose a checkpoint of --run=RUN_DIR")
  if run_dir is None and not (config.model.get("spec") or config.model.get("preset")):
    raise app.UsageError("this config names no model (configs/eval.py:run evaluates a trained "
                         "run's): pass --run=RUN_DIR, or set --config.model.spec")
  overrides = config_flags.get_override_values(FLAGS["config"])
  from_run = sorted(k for k in overrides if k.partition(".")[0] in RUN_SECTIONS)
  if run_dir is not None and from_run:
    raise app.UsageError(f"--config.{from_run[0]}: with --run the {' and '.join(RUN_SECTIONS)} "
                         f"sections are the run's own (RUN_DIR/config.json)")
  host = {k: v for k, v in overrides.items() if k.partition(".")[0] in HOST_SECTIONS}
  multihost.initialize()
  logging.getLogger("httpx").setLevel(logging.WARNING)
  if run_dir is None:
    report = evaluate(config, workdir, resume=True)
  else:
    report = evaluate_run(run_dir, config, workdir, FLAGS.step, FLAGS.stage, host)
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
