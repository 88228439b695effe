"""What every launcher shares: the entry-point command line and printing it for dry runs."""

from __future__ import annotations

import shlex
from typing import Mapping, Sequence

ENTRY_POINTS = ("sage_jax.train", "sage_jax.evaluate", "sage_jax.export")


def entry_command(config: str, workdir: str, overrides: Mapping[str, object] = (),
                  module: str = "sage_jax.train", python: str = "python",
                  entry_flags: Mapping[str, object] = ()) -> list[str]:
  """`python -m <module> [--<flag>=<value>...] --config=<config> --workdir=<workdir>
  --config.<key>=<value>...`; `entry_flags` are the entry point's own (evaluate's --run,
  --step)."""
  if module not in ENTRY_POINTS:
    raise ValueError(f"module {module!r} is not an entry point; choose from {ENTRY_POINTS}")
  argv = [python, "-m", module,
          *(f"--{name}={format_value(value)}" for name, value in dict(entry_flags).items()),
          f"--config={config}", f"--workdir={workdir}"]
  for key, value in dict(overrides).items():
    argv.append(f"--config.{key}={format_value(value)}")
  return argv


def format_value(value: object) -> str:
  """Renders an override value the way ml_collections' config flags parse it back."""
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, (list, tuple)):
    return "(" + ",".join(format_value(v) for v in value) + ("," if len(value) == 1 else "") + ")"
  return str(value)


def parse_overrides(items: Sequence[str]) -> dict[str, str]:
  """`["a.b=1", "c=x"]` -> `{"a.b": "1", "c": "x"}`, rejecting items without '='."""
  out = {}
  for item in items:
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise ValueError(f"override {item!r} is not KEY=VALUE")
    out[key.removeprefix("config.")] = value
  return out


def show(commands: Sequence[Sequence[str] | str]) -> str:
  """One shell-quoted command per line."""
  return "\n".join(c if isinstance(c, str) else shlex.join(c) for c in commands)
