"""Expands a sweep (configs/sweeps/*.py) into runs and hands each to a launcher.

A sweep file defines `get_sweep(*args)` (the `:`-separated words after the file name)
returning
  {"config": "configs/sage.py:<preset>", "axes": [{name: overrides, ...}, ...]}
and optionally "module" (the entry point, default sage_jax.train) and "flags" (that entry
point's own flags, the same for every run: `sage_jax.evaluate`'s --run and --step). The
runs are the product of its axes: one run per combination, named by joining the
chosen names, with the overrides merged. An arm's overrides may name a stage config of its
own under "config" (e.g. the GRPO baseline's `configs/grpo.py:<preset>`), so that the arm is
exactly that stage's command plus the swept keys. Every run gets its own workdir under
--workdir_root. `--override=KEY=VALUE` (repeatable) sets a key in every run, e.g. the
checkpoint a real-size preset starts from (`--override=model.spec=/ckpt/Qwen2.5-7B-Instruct`);
a key the sweep's arms set is refused there (it would undo the sweep). With
--launcher=slurm, `--sbatch_arg=OPTION` (repeatable) goes to every run's sbatch, before the
script: the nodes a preset needs (`--sbatch_arg=--nodes=1` for one 8-GPU node; the script
asks for 2), a partition, a time limit.

  python launch/sweep.py --sweep=configs/sweeps/reward_ablation.py:qwen2.5-7b \\
      --workdir_root=runs/reward_ablation --launcher=slurm --sbatch_arg=--nodes=1 --dry_run
  python launch/sweep.py --sweep=configs/sweeps/retrieval.py:runs/sage7b \\
      --workdir_root=runs/sage7b_retrieval --dry_run     # evaluations of one trained run
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import subprocess
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch import common, local, tpu_pod  # noqa: E402
from sage_jax import config_file  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHERS = ("local", "slurm", "multinode", "tpu_pod")

FLAGS = flags.FLAGS


@dataclasses.dataclass(frozen=True)
class Run:
  name: str
  config: str
  overrides: dict
  workdir: str
  module: str = "sage_jax.train"
  flags: dict = dataclasses.field(default_factory=dict)  # the entry point's own


def split_spec(spec: str) -> list[str]:
  """`path[:arg[:arg...]]` -> [path, *args]; an argument may be a URL (`gs://b/run`)."""
  parts: list[str] = []
  for part in spec.split(":"):
    if parts and part.startswith("//") and parts[-1].isidentifier():
      parts[-1] += ":" + part
    else:
      parts.append(part)
  return parts


def load_sweep(spec: str) -> dict:
  """`path[:arg[:arg...]]` -> the sweep its `get_sweep(*args)` returns; a file that cannot
  be loaded raises `config_file.ConfigFileError`, one line naming it."""
  path, *args = split_spec(spec)
  sweep = config_file.call(spec, config_file.load_module(path, "sweep file"), "get_sweep",
                           *args)
  for key in ("config", "axes"):
    if key not in sweep:
      raise config_file.ConfigFileError(f"{path}: get_sweep() must return a dict with {key!r}")
  axes = sweep["axes"]
  if not (isinstance(axes, (list, tuple)) and all(
      isinstance(axis, dict) and all(isinstance(arm, dict) for arm in axis.values())
      for axis in axes)):
    raise config_file.ConfigFileError(
        f"{spec}: get_sweep()['axes'] must be a list of {{run name: {{key: value}}}} dicts, "
        f"got {axes!r:.200}")
  empty = [i for i, axis in enumerate(axes) if not axis]
  if empty:
    raise config_file.ConfigFileError(f"{spec}: the sweep has no runs: axis {empty[0]} has no "
                                      "arms")
  return sweep


def expand(sweep: dict, workdir_root: str, overrides: dict | None = None) -> list[Run]:
  """The sweep's runs; `overrides`: config keys set in every run, none of them swept."""
  shared = dict(overrides or {})
  runs = []
  axes = [list(axis.items()) for axis in sweep["axes"]]
  for combo in itertools.product(*axes):
    name = "-".join(str(n) for n, _ in combo)
    overrides = {}
    for _, o in combo:
      clash = set(overrides) & set(o)
      if clash:
        raise ValueError(f"run {name!r}: axes set {sorted(clash)} twice")
      overrides.update(o)
    config = overrides.pop("config", sweep["config"])
    swept = sorted(set(shared) & set(overrides))
    if swept:
      raise ValueError(f"--override of {swept}: run {name!r} sets it; the sweep varies it")
    runs.append(Run(name, config, {**shared, **overrides}, os.path.join(workdir_root, name),
                    sweep.get("module", "sage_jax.train"), dict(sweep.get("flags", {}))))
  names = [r.name for r in runs]
  if len(set(names)) != len(names):
    raise ValueError(f"sweep has duplicate run names: {names}")
  return runs


def tpu_name(template: str, run_name: str) -> str:
  """`template` with {name} as the run's name in what Cloud TPU names allow (lowercase
  letters, digits and hyphens): `grpo_matched-seed0` -> `grpo-matched-seed0`."""
  try:
    return template.format(name=re.sub(r"[^a-z0-9-]+", "-", run_name.lower()))
  except (KeyError, IndexError) as e:
    raise ValueError(f"--tpu={template}: only {{name}} (the run's name) is filled in, not "
                     f"{{{e.args[0]}}}") from None


def _entry_args(run: Run) -> list[str]:
  """The entry point's arguments of `run` (its command after `python -m <module>`)."""
  return common.entry_command(run.config, run.workdir, run.overrides, module=run.module,
                              entry_flags=run.flags)[3:]


def commands_for(run: Run, launcher: str, *, project=None, zone=None, tpu=None,
                 python="python3", sbatch_args=()) -> list[list[str]]:
  """The exact commands that start `run` with `launcher`; `sbatch_args`: options of the
  slurm launcher's sbatch; `python`: the TPU workers' interpreter (`tpu_pod.build`)."""
  module = run.module
  args = _entry_args(run)
  if launcher == "local":
    return [local.build(run.config, run.workdir, run.overrides, module,
                        entry_flags=run.flags)[1]]
  if launcher == "slurm":
    return [["sbatch", f"--job-name={run.name}", f"--export=ALL,SAGE_JAX_MODULE={module}",
             *sbatch_args, os.path.join(REPO, "launch", "slurm.sbatch"), *args]]
  if launcher == "multinode":
    return [["env", f"SAGE_JAX_MODULE={module}", os.path.join(REPO, "launch", "multinode.sh"),
             *args]]
  if launcher == "tpu_pod":
    missing = [n for n, v in (("project", project), ("zone", zone), ("tpu", tpu)) if not v]
    if missing:
      raise ValueError(f"launcher tpu_pod needs --{', --'.join(missing)}")
    return tpu_pod.build(project=project, zone=zone, tpu=tpu_name(tpu, run.name),
                         config=run.config, workdir=run.workdir, overrides=run.overrides,
                         module=module, entry_flags=run.flags,
                         python=python)  # started, not followed
  raise ValueError(f"unknown launcher {launcher!r}; choose from {LAUNCHERS}")


def main(argv):
  del argv
  try:
    sweep = load_sweep(FLAGS.sweep)
  except config_file.ConfigFileError as e:
    sys.exit(str(e))
  if FLAGS["module"].present:
    if "module" in sweep and sweep["module"] != FLAGS.module:
      raise app.UsageError(f"--module={FLAGS.module}: {FLAGS.sweep} runs {sweep['module']}")
    sweep = {**sweep, "module": FLAGS.module}
  if FLAGS.sbatch_arg and FLAGS.launcher != "slurm":
    raise app.UsageError(f"--sbatch_arg is for --launcher=slurm, not {FLAGS.launcher}")
  per_run = [a for a in FLAGS.sbatch_arg if a.startswith(("--job-name", "-J", "--export"))]
  if per_run:
    raise app.UsageError(f"--sbatch_arg={per_run[0]}: the sweep sets the job name and "
                         "--export=ALL,SAGE_JAX_MODULE=<module> of each run itself")
  try:
    runs = expand(sweep, FLAGS.workdir_root, common.parse_overrides(FLAGS.override))
    commands = {run.name: commands_for(run, FLAGS.launcher, project=FLAGS.project,
                                       zone=FLAGS.zone, tpu=FLAGS.tpu, python=FLAGS.python,
                                       sbatch_args=FLAGS.sbatch_arg) for run in runs}
  except ValueError as e:  # a bad --override or --tpu, an override the sweep varies
    raise app.UsageError(f"{FLAGS.sweep}: {e}") from None
  if FLAGS.launcher == "tpu_pod" and len(runs) > 1 and "{name}" not in (FLAGS.tpu or ""):
    raise app.UsageError(f"--tpu={FLAGS.tpu}: {len(runs)} runs would share one slice; put "
                         "{name} in it (e.g. --tpu=sage-{name}) for a slice per run")
  for config in dict.fromkeys(run.config for run in runs):  # before any run starts
    common.check_config(config)
  for run in runs:  # then every run's command whole
    common.check_or_exit(run.module, _entry_args(run), run.name)
  if FLAGS.dry_run:
    for run in runs:
      print(f"# {run.name}")
      print(common.show(commands[run.name]))
  elif failed := run_all(commands):
    sys.exit(f"{len(failed)} of {len(runs)} runs failed: {', '.join(failed)}")


def run_all(commands: dict[str, list[list[str]]]) -> list[str]:
  """Runs each run's commands in order; returns the runs that failed. A failed command ends
  its run, and the next run starts: one arm that fails (a bad seed, a node lost) does not cost
  the sweep its other arms. Ctrl-C stops the sweep."""
  failed = []
  for name, cmds in commands.items():
    print(f"# {name}", flush=True)
    print(common.show(cmds), flush=True)
    for cmd in cmds:
      if (status := subprocess.run(cmd).returncode) != 0:
        print(f"# {name} failed (exit status {status}); going on with the next run",
              file=sys.stderr, flush=True)
        failed.append(name)
        break
  return failed


def define_flags():
  flags.DEFINE_string("sweep", None, "configs/sweeps/<file>.py[:arg]", required=True)
  flags.DEFINE_string("workdir_root", None, "Parent of the runs' workdirs.", required=True)
  flags.DEFINE_enum("launcher", "local", LAUNCHERS, "Where each run goes.")
  flags.DEFINE_string("module", "sage_jax.train",
                      "Entry point module (a sweep may name its own).")
  flags.DEFINE_string("project", None, "tpu_pod: GCP project.")
  flags.DEFINE_string("zone", None, "tpu_pod: zone.")
  flags.DEFINE_string("tpu", None, "tpu_pod: TPU name; '{name}' becomes the run name.")
  flags.DEFINE_string("python", "python3", "tpu_pod: the workers' interpreter for the venv "
                      "(Python >= 3.11).")
  flags.DEFINE_multi_string("sbatch_arg", [], "slurm: an sbatch option for every run, e.g. "
                            "--nodes=1.")
  flags.DEFINE_multi_string("override", [], "KEY=VALUE config override for every run.")
  flags.DEFINE_bool("dry_run", False, "Print the exact commands; run nothing.")


if __name__ == "__main__":
  define_flags()
  app.run(main)
