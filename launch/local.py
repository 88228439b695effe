"""Single-host launch on any number of local devices (CPU, GPUs or a TPU VM).

  python launch/local.py --config=configs/sage.py:demo --workdir=runs/demo [--cpu_devices=8]
      [--gpus=0,1] [--override=rollout.group_size=4 ...] [--dry_run]
"""

from __future__ import annotations

import os
import subprocess
import sys

from absl import app, flags

FLAGS = flags.FLAGS

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch import common  # noqa: E402


def build(config, workdir, overrides, module="sage_jax.train", cpu_devices=0, gpus=None):
  """(environment additions, argv) for one local run."""
  env = {}
  if cpu_devices:
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={cpu_devices}"
    env["JAX_PLATFORMS"] = "cpu"
  if gpus is not None:
    env["CUDA_VISIBLE_DEVICES"] = gpus
  return env, common.entry_command(config, workdir, overrides, module=module,
                                   python=sys.executable)


def main(argv):
  del argv
  env, cmd = build(FLAGS.config, FLAGS.workdir, common.parse_overrides(FLAGS.override),
                   FLAGS.module, FLAGS.cpu_devices, FLAGS.gpus)
  prefix = [f"{k}={v}" for k, v in env.items()]
  if FLAGS.dry_run:
    print(common.show([(["env", *prefix] if prefix else []) + cmd]))
    return
  raise SystemExit(subprocess.call(cmd, env={**os.environ, **env}))


def define_flags():
  flags.DEFINE_string("config", None, "configs/<file>.py:<preset>", required=True)
  flags.DEFINE_string("workdir", None, "Run directory.", required=True)
  flags.DEFINE_string("module", "sage_jax.train", "Entry point module.")
  flags.DEFINE_multi_string("override", [], "KEY=VALUE config overrides.")
  flags.DEFINE_integer("cpu_devices", 0, "Simulate this many CPU devices.")
  flags.DEFINE_string("gpus", None, "Comma-separated visible GPU ids.")
  flags.DEFINE_bool("dry_run", False, "Print the command instead of running it.")


if __name__ == "__main__":
  define_flags()
  app.run(main)
