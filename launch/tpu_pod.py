"""Runs one entry point on every worker of a Cloud TPU pod slice.

The code at git HEAD is packed, copied to every worker, installed into a venv there, and the
same command starts on all workers at once (`--worker=all`); `jax.distributed.initialize()`
(called by the entry points) finds the other workers by itself. The run is detached from the
ssh session (`setsid nohup`), so a dropped connection does not stop it; each worker writes its
output to `<remote_dir>/logs/<hostname>.log` (the last command printed shows how to follow
worker 0's). The workdir is a bucket every worker reaches (gs://bucket/run, with the workers'
service account) or a filesystem every worker mounts (Filestore): every host writes its shards
of each checkpoint there.

The venv is made with `--python` (default python3), which must be Python >= 3.11: the TPU VM
images' own python3 is 3.10, so setup stops on each worker with a line saying so unless
`--python` names a newer one there (python3.11, or the path of a uv-managed interpreter).

`--create` makes the slice first; with `--queued` it asks for it as a queued resource
(`--spot` for spot capacity) and waits until the slice is ACTIVE.

  python launch/tpu_pod.py --project=P --zone=us-east5-a --tpu=sage-v5p --accelerator_type=v5p-64 \\
      --config=configs/sage.py:qwen2.5-32b --workdir=gs://my-bucket/runs/sage32b [--create [--queued]]
  python launch/tpu_pod.py --project=P --zone=us-east5-a --tpu=sage-v5p --module=sage_jax.export \\
      --workdir=gs://my-bucket/runs/sage32b --flag=out=gs://my-bucket/hf/sage32b
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from absl import app, flags

FLAGS = flags.FLAGS

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch import common  # noqa: E402


ARCHIVE = "/tmp/sage_jax_code.tar.gz"
JOIN_ENV = "SAGE_JAX_JOIN_TPU_POD"  # set on every worker: join the run (`multihost.initialize`)
PYTHON_REQUIRED = (3, 11)  # pyproject.toml's requires-python


def build(*, project, zone, tpu, config, workdir, overrides=(), module="sage_jax.train",
          entry_flags=(), create=False, accelerator_type="v5p-64",
          runtime_version="v2-alpha-tpuv5", remote_dir="sage_jax",
          jax_tpu="jax[tpu]==0.10.2", queued=False, spot=False,
          python="python3") -> list[list[str]]:
  """The commands that start the run, in order (`follow` shows its log); `python`: the
  workers' interpreter for the venv."""
  where = [f"--zone={zone}", f"--project={project}"]
  gcloud = ["gcloud", "compute", "tpus", "tpu-vm"]
  commands = []
  if create and queued:
    queue = ["gcloud", "compute", "tpus", "queued-resources"]
    commands.append(queue + ["create", tpu, f"--node-id={tpu}", *where,
                             f"--accelerator-type={accelerator_type}",
                             f"--runtime-version={runtime_version}", *(["--spot"] if spot else [])])
    state = shlex.join(queue + ["describe", tpu, *where, "--format=value(state.state)"])
    commands.append(["bash", "-c", f'until [ "$({state})" = ACTIVE ]; do sleep 30; done'])
  elif create:
    commands.append(gcloud + ["create", tpu, *where, f"--accelerator-type={accelerator_type}",
                              f"--version={runtime_version}"])
  commands.append(["git", "archive", "--format=tar.gz", f"--output={ARCHIVE}", "HEAD"])
  commands.append(gcloud + ["scp", ARCHIVE, f"{tpu}:~/sage_jax_code.tar.gz", "--worker=all",
                            *where])
  setup = " && ".join([
      f"mkdir -p {remote_dir}/logs",
      f"tar -xzf ~/sage_jax_code.tar.gz -C {remote_dir}",
      f"cd {remote_dir}",
      python_check(python),
      f"{shlex.quote(python)} -m venv .venv",
      ". .venv/bin/activate",
      "pip install -q -r requirements.txt -e .",
      f"pip install -q {shlex.quote(jax_tpu)}",
      "appworld install",
  ])
  commands.append(gcloud + ["ssh", tpu, "--worker=all", *where, f"--command={setup}"])
  entry = shlex.join(common.entry_command(config, workdir, overrides, module=module,
                                          entry_flags=entry_flags))
  # The workers join one run through JAX's Cloud TPU detection (`multihost.initialize`). Only
  # the start goes to the background (the braces): `a && b &` would put the whole chain there,
  # a subshell that waits for the run with ssh's channel open, and ssh would not return.
  run = (f"cd {remote_dir} && . .venv/bin/activate && {{ {JOIN_ENV}=1 "
         f"setsid nohup {entry} > logs/$(hostname).log 2>&1 < /dev/null & }}")
  commands.append(gcloud + ["ssh", tpu, "--worker=all", *where, f"--command={run}"])
  return commands


def python_check(python: str) -> str:
  """A shell command that fails with one line when `python` is older than `PYTHON_REQUIRED`
  (pip's own refusal would come later, as a pinned requirement it finds no version of)."""
  required = ".".join(map(str, PYTHON_REQUIRED))
  # An f-string on the worker: the interpreter's path and version fill in there.
  message = (f"sage_jax needs Python >= {required}; {{sys.executable}} is "
             f"{{sys.version.split()[0]}}: pass --python=python{required} (or the path of a "
             "uv-managed interpreter)")
  code = f"import sys; sys.version_info >= {PYTHON_REQUIRED} or sys.exit(f'{message}')"
  return f"{shlex.quote(python)} -c {shlex.quote(code)}"


def follow(*, project, zone, tpu, remote_dir="sage_jax") -> list[str]:
  """The command that shows worker 0's log as it grows (stopping it leaves the run)."""
  return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", tpu, "--worker=0", f"--zone={zone}",
          f"--project={project}", f"--command=tail -F {remote_dir}/logs/$(hostname).log"]


def main(argv):
  del argv
  if FLAGS.queued and not FLAGS.create:
    raise app.UsageError("--queued asks for the slice as a queued resource: it needs --create")
  if FLAGS.spot and not FLAGS.queued:
    raise app.UsageError("--spot asks for spot capacity of a queued resource: it needs "
                         "--create --queued")
  try:  # the entry point's command first: nothing starts when it is wrong
    overrides = common.parse_overrides(FLAGS.override)
    entry_flags = common.parse_entry_flags(FLAGS.flag)
    entry = common.entry_command(FLAGS.config, FLAGS.workdir, overrides, FLAGS.module,
                                 entry_flags=entry_flags)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  common.check_or_exit(FLAGS.module, entry[3:])
  commands = build(project=FLAGS.project, zone=FLAGS.zone, tpu=FLAGS.tpu,
                   config=FLAGS.config, workdir=FLAGS.workdir,
                   overrides=overrides, module=FLAGS.module, entry_flags=entry_flags,
                   create=FLAGS.create, accelerator_type=FLAGS.accelerator_type,
                   runtime_version=FLAGS.runtime_version, remote_dir=FLAGS.remote_dir,
                   jax_tpu=FLAGS.jax_tpu_requirement, queued=FLAGS.queued,
                   spot=FLAGS.spot, python=FLAGS.python)
  log = follow(project=FLAGS.project, zone=FLAGS.zone, tpu=FLAGS.tpu,
               remote_dir=FLAGS.remote_dir)
  if FLAGS.dry_run:
    print(common.show([*commands, log]))
    return
  for cmd in commands:
    subprocess.run(cmd, check=True)
  print("started on every worker; worker 0's log (Ctrl-C stops following, not the run):",
        flush=True)
  subprocess.run(log, check=False)


def define_flags():
  flags.DEFINE_string("project", None, "GCP project.", required=True)
  flags.DEFINE_string("zone", None, "TPU zone.", required=True)
  flags.DEFINE_string("tpu", None, "TPU VM (pod slice) name.", required=True)
  flags.DEFINE_string("accelerator_type", "v5p-64", "For --create.")
  flags.DEFINE_string("runtime_version", "v2-alpha-tpuv5", "For --create.")
  flags.DEFINE_bool("create", False, "Create the TPU VM first.")
  flags.DEFINE_bool("queued", False, "With --create: as a queued resource, waiting until ACTIVE.")
  flags.DEFINE_bool("spot", False, "With --queued: spot capacity.")
  flags.DEFINE_string("config", None, "configs/<file>.py:<preset> (not for export, generate)")
  flags.DEFINE_string("workdir", None, "Run directory: gs://bucket/run, or a path every worker "
                      "mounts (not for generate).")
  flags.DEFINE_string("module", "sage_jax.train", "Entry point module.")
  flags.DEFINE_multi_string("override", [], "KEY=VALUE config overrides.")
  flags.DEFINE_multi_string("flag", [], "NAME=VALUE: a flag of the entry point's own "
                            "(export's out, evaluate's run and step).")
  flags.DEFINE_string("remote_dir", "sage_jax", "Code directory on the workers.")
  flags.DEFINE_string("python", "python3", "The workers' interpreter for the venv: Python >= "
                      "3.11 (python3.11, or a uv-managed interpreter's path).")
  flags.DEFINE_string("jax_tpu_requirement", "jax[tpu]==0.10.2",
                      "JAX build for TPU, installed over requirements.txt.")
  flags.DEFINE_bool("dry_run", False, "Print every command instead of running them.")


if __name__ == "__main__":
  define_flags()
  app.run(main)
