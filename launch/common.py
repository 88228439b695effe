"""What every launcher shares: the entry-point command line and printing it for dry runs."""

from __future__ import annotations

import shlex
import sys
from typing import Mapping, Sequence

from absl import flags

from sage_jax import config_file
from sage_jax.configurable import ConfigError

# Each entry point, and which of the launchers' common flags it reads: export reads the run's
# own config (saved beside its checkpoints), generate neither a config nor a workdir; their
# own flags (export's --out, generate's --model and --prompt) go as `entry_flags`.
ENTRY_POINTS = {
    "sage_jax.train": ("config", "workdir"),
    "sage_jax.pipeline": ("config", "workdir"),
    "sage_jax.evaluate": ("config", "workdir"),
    "sage_jax.export": ("workdir",),
    "sage_jax.generate": (),
}
# The entry points whose --config is a training run's, resolved whole by `check_command`.
RUN_ENTRY_POINTS = ("sage_jax.train", "sage_jax.pipeline")


def entry_command(config: str | None, workdir: str | None,
                  overrides: Mapping[str, object] = (), module: str = "sage_jax.train",
                  python: str = "python", entry_flags: Mapping[str, object] = ()) -> list[str]:
  """`python -m <module> [--<flag>=<value>...] [--config=<config>] [--workdir=<workdir>]
  [--config.<key>=<value>...]`; `entry_flags` are the entry point's own (evaluate's --run,
  --step; export's --out). --config and --workdir go to the entry points that read them,
  and must be given for those."""
  if module not in ENTRY_POINTS:
    raise ValueError(f"module {module!r} is not an entry point; choose from "
                     f"{sorted(ENTRY_POINTS)}")
  reads = ENTRY_POINTS[module]
  given = {"config": config, "workdir": workdir}
  for name, value in given.items():
    if (name in reads) != bool(value):
      raise ValueError(f"{module} {'needs' if name in reads else 'takes no'} --{name}"
                       + ("" if name in reads else " (its own flags go as entry flags)"))
  if overrides and "config" not in reads:
    raise ValueError(f"{module} takes no config, so no overrides: {sorted(overrides)}")
  argv = [python, "-m", module,
          *(f"--{name}={format_value(value)}" for name, value in dict(entry_flags).items()),
          *(f"--{name}={given[name]}" for name in ("config", "workdir") if name in reads)]
  for key, value in dict(overrides).items():
    argv.append(f"--config.{key}={format_value(value)}")
  return argv


def check_command(module: str, args: Sequence[str]) -> None:
  """Parses the `--config` flag and `--config.<key>` overrides of `python -m <module> <args>`
  (`entry_command`'s) as the entry point will, and resolves a training run's config whole
  (`run_config.resolve`): a config file that does not load, a misspelt key, a value of the
  wrong type or one the run schema refuses raises ValueError with one line naming it, before
  any job starts rather than in each job on every host."""
  config_args = [a for a in args if a.startswith(("--config=", "--config."))]
  if not config_args:
    return
  from sage_jax import run_config  # noqa: PLC0415 - imports JAX: only to check a command

  values = flags.FlagValues()
  config_file.define_flag("config", "", flag_values=values, sys_argv=[module, *config_args])
  try:
    values([module, *config_args])
  except config_file.ConfigFileError as e:
    raise ValueError(str(e)) from None
  except (KeyError, AttributeError) as e:
    raise ValueError(config_file.unknown_override(config_args, e) or repr(e)) from None
  except flags.Error as e:  # a value of the wrong type
    raise ValueError(str(e)) from None
  joined = config_file.joined_tuple_override(config_args, values.config)
  if joined is not None:
    raise ValueError(joined)
  if module in RUN_ENTRY_POINTS:
    try:
      run_config.resolve(values.config)
    except ConfigError as e:
      raise ValueError(f"ConfigError: {e}") from None


def check_config(config: str) -> None:
  """Exits with `config_file`'s one line when `config` (`configs/<file>.py:<preset>`) does
  not load."""
  try:
    config_file.load(config)
  except config_file.ConfigFileError as e:
    sys.exit(str(e))


def check_or_exit(module: str, args: Sequence[str], run: str = "") -> None:
  """`check_command`, exiting with its line (after `run`'s name, when given)."""
  try:
    check_command(module, args)
  except ValueError as e:
    sys.exit(f"run {run!r}: {e}" if run else str(e))


def format_value(value: object) -> str:
  """Renders an override value the way ml_collections' config flags parse it back: a
  sequence as a Python tuple literal (its strings quoted, which a flag string alone is not)."""
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, (list, tuple)):
    return repr(tuple(value))
  return str(value)


def parse_pairs(items: Sequence[str], what: str, name=lambda key: key) -> dict[str, str]:
  """`["a.b=1", "c=x"]` -> `{name("a.b"): "1", name("c"): "x"}`, refusing an item without '='
  or a name given twice (the later value would silently win); `what` names them in the
  error."""
  out = {}
  for item in items:
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise ValueError(f"{what} {item!r} is not KEY=VALUE")
    if name(key) in out:
      raise ValueError(f"{what} {name(key)!r} is given twice ({out[name(key)]!r}, {value!r})")
    out[name(key)] = value
  return out


def parse_overrides(items: Sequence[str]) -> dict[str, str]:
  """--override items -> config keys (a leading "config." dropped) and values."""
  return parse_pairs(items, "override", lambda key: key.removeprefix("config."))


def parse_entry_flags(items: Sequence[str]) -> dict[str, str]:
  """--flag items (`out=DIR`, `--step=3`) -> the entry point's own flags and values."""
  return parse_pairs(items, "flag", lambda key: key.removeprefix("--"))


def show(commands: Sequence[Sequence[str] | str]) -> str:
  """One shell-quoted command per line."""
  return "\n".join(c if isinstance(c, str) else shlex.join(c) for c in commands)
