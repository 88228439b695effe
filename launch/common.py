"""What every launcher shares: the entry-point command line and printing it for dry runs."""

from __future__ import annotations

import shlex
import sys
from typing import Mapping, Sequence

from sage_jax import config_file

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


def check_config(config: str | None) -> None:
  """Exits with `config_file`'s one line when `config` (`configs/<file>.py:<preset>`) does
  not load: before anything starts, rather than in the entry point on every host."""
  if config:
    try:
      config_file.load(config)
    except config_file.ConfigFileError as e:
      sys.exit(str(e))


def format_value(value: object) -> str:
  """Renders an override value the way ml_collections' config flags parse it back."""
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, (list, tuple)):
    return "(" + ",".join(format_value(v) for v in value) + ("," if len(value) == 1 else "") + ")"
  return str(value)


def parse_pairs(items: Sequence[str], what: str) -> dict[str, str]:
  """`["a.b=1", "c=x"]` -> `{"a.b": "1", "c": "x"}`, rejecting items without '=' (named as
  `what` in the error)."""
  out = {}
  for item in items:
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise ValueError(f"{what} {item!r} is not KEY=VALUE")
    out[key] = value
  return out


def parse_overrides(items: Sequence[str]) -> dict[str, str]:
  """--override items -> config keys (a leading "config." dropped) and values."""
  return {k.removeprefix("config."): v for k, v in parse_pairs(items, "override").items()}


def parse_entry_flags(items: Sequence[str]) -> dict[str, str]:
  """--flag items (`out=DIR`, `--step=3`) -> the entry point's own flags and values."""
  return {k.removeprefix("--"): v for k, v in parse_pairs(items, "flag").items()}


def show(commands: Sequence[Sequence[str] | str]) -> str:
  """One shell-quoted command per line."""
  return "\n".join(c if isinstance(c, str) else shlex.join(c) for c in commands)
