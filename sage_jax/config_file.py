"""Loads `configs/<file>.py[:<arg>]` (what `get_config(arg)` returns), with one clear line
when it cannot: a missing file, a syntax error (with its line), an argument such as a preset
the file does not know (its own message, which lists the ones it does), or any other error
raised in the file (with the line that raised it).

ml_collections' config flag prints a traceback for each of these, and reports a missing file
only when the config is first read; `define_flag` gives the entry points the same flag,
loading through `load` instead, and `parse_flags` (or `run`) exits with the line.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback
import types
from typing import Any, Callable, Sequence

import ml_collections
from absl import app, flags
from ml_collections import config_flags

from sage_jax.configurable import ConfigError
from sage_jax.storage import WorkdirError


class ConfigFileError(Exception):
  """A config (or sweep) file that cannot be loaded; the message is one line naming it. Not
  a ValueError, which absl's flag parsing would wrap into a message of its own."""


def load_module(path: str, what: str = "config file") -> types.ModuleType:
  """The Python file at `path`, executed as a module of its own."""
  if not os.path.isfile(path):
    directory = os.path.dirname(path) or "."
    there = (sorted(f for f in os.listdir(directory) if f.endswith(".py"))
             if os.path.isdir(directory) else [])
    raise ConfigFileError(f"{path}: no such {what}"
                          + (f" ({directory}/ has {', '.join(there)})" if there else ""))
  module_spec = importlib.util.spec_from_file_location(
      os.path.splitext(os.path.basename(path))[0], path)
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
  except SyntaxError as e:  # the file's, or that of a file it imports
    raise ConfigFileError(f"{e.filename}:{e.lineno}: syntax error in {what} {path}: "
                          f"{e.msg}") from None
  except Exception as e:  # noqa: BLE001 - whatever the file raises is the file's error
    raise ConfigFileError(f"{_raised_at(e, path)}: {what} {path} failed to load: "
                          f"{type(e).__name__}: {e}") from None
  return module


def call(spec: str, module: types.ModuleType, name: str, *args: Any) -> Any:
  """`module.name(*args)`; a ValueError (the file's own check of its arguments: an unknown
  preset) or any other error becomes one line naming `spec`."""
  function: Callable | None = getattr(module, name, None)
  if not callable(function):
    raise ConfigFileError(f"{module.__file__}: defines no {name}()")
  try:
    return function(*args)
  except ValueError as e:
    raise ConfigFileError(f"{spec}: {e}") from None
  except Exception as e:  # noqa: BLE001
    raise ConfigFileError(f"{_raised_at(e, module.__file__)}: {name}() of {spec} failed: "
                          f"{type(e).__name__}: {e}") from None


def load(spec: str) -> ml_collections.ConfigDict:
  """`get_config(arg)` of the file `spec` (`path[:arg]`) names; everything after the first
  colon is the one argument, as ml_collections passes it."""
  path, colon, arg = spec.partition(":")
  config = call(spec, load_module(path), "get_config", *((arg,) if colon else ()))
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigFileError(f"{spec}: get_config() returned {type(config).__name__}, not a "
                          "ConfigDict")
  return config


def _raised_at(error: BaseException, path: str) -> str:
  """`file:line` of the innermost line the error passed through in `path`'s directory (the
  file itself, or a config it imports), or `path` when none did: the line to look at."""
  directory = os.path.dirname(os.path.abspath(path))
  frames = [frame for frame in traceback.extract_tb(error.__traceback__)
            if os.path.dirname(os.path.abspath(frame.filename)) == directory]
  return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else path


class _Parser(flags.ArgumentParser):
  """Parses `--config=path[:arg]` into the locked ConfigDict `load` returns."""

  def parse(self, argument: str) -> ml_collections.ConfigDict:
    config = load(argument)
    config.lock()
    return config

  def flag_type(self) -> str:
    return "config object"


def define_flag(name: str, help_string: str, flag_values: flags.FlagValues = flags.FLAGS,
                sys_argv: list[str] | None = None) -> flags.FlagHolder:
  """ml_collections' config file flag (`--<name>=path[:arg]` and its `--<name>.<key>=value`
  overrides, found in `sys_argv`, default sys.argv), loading through `load`: a file that
  cannot be loaded fails the parse with `ConfigFileError`'s line."""
  holder = config_flags.DEFINE_config_file(name, None, help_string, flag_values=flag_values,
                                           sys_argv=sys_argv)
  flag_values[name].parser = _Parser()
  return holder


def run(main: Callable[[list[str]], Any]) -> None:
  """`app.run(main)` for an entry point that takes `--config` and `--config.<path>`
  overrides: flags parse with `parse_flags`, and a ConfigError (a value the schema refuses,
  a workdir that cannot resume under this config) or a WorkdirError (a workdir that cannot
  be used) exits with its message alone; the traceback would only say where it was checked."""

  def checked(argv: list[str]) -> Any:
    try:
      return main(argv)
    except (ConfigError, WorkdirError) as e:
      sys.exit(f"{type(e).__name__}: {e}")

  app.run(checked, flags_parser=parse_flags)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing with usage (a bad flag value exits with absl's message), for `run`
  and `app.run(main, flags_parser=parse_flags)`: a config file that does not load
  (`define_flag`), or a `--config.<path>` override that names no section or key
  of it, exits with one line naming it, instead of ml_collections' traceback or bare
  KeyError."""
  try:
    remaining = app.parse_flags_with_usage(argv)
  except ConfigFileError as e:
    sys.exit(str(e))
  except (KeyError, AttributeError) as e:
    message = unknown_override(argv, e)
    if message is None:
      raise
    sys.exit(message)
  if "config" in flags.FLAGS and flags.FLAGS.config is not None:
    message = joined_tuple_override(argv, flags.FLAGS.config)
    if message is not None:
      sys.exit(message)
  return remaining


def joined_tuple_override(argv: Sequence[str], config: ml_collections.ConfigDict
                          ) -> str | None:
  """The line refusing a tuple key that `argv` overrides more than once with a whole tuple
  among its values, or None. ml_collections joins the values of a repeated tuple override
  (`--config.x=1 --config.x=2` sets (1, 2)), so `--config.x="(512, 1024)"` followed by
  `--config.x="(256,)"` (a base command and a sweep's setting of the same key) sets
  (512, 1024, 256) where the last value was meant to replace the first."""
  given: dict[str, list[str]] = {}
  for arg in argv:
    if arg.startswith("--config.") and "=" in arg:
      key, _, value = arg.removeprefix("--config.").partition("=")
      given.setdefault(key, []).append(value)
  for key, values in given.items():
    whole = [v for v in values if v.strip().startswith(("(", "["))]
    if len(values) < 2 or not whole:
      continue
    value = config[key]  # the parse found it: a dotted path of the config
    if isinstance(value, tuple):
      return (f"--config.{key} is given {len(values)} times ({', '.join(values)}), which "
              f"would set {value}: ml_collections joins repeated tuple overrides. Give the "
              "whole tuple once.")
  return None


def unknown_override(argv: list[str], error: KeyError | AttributeError) -> str | None:
  """The line naming the `--config.<path>` override of `argv` that `error` (ml_collections'
  refusal of a section or key the config lacks) is about, with its suggestion, or the other
  sections that have the key (`eval.temperature` for `agent.temperature`); None when the
  error names none of them."""
  message = error  # ml_collections wraps the KeyError in an AttributeError for keys
  while isinstance(message, BaseException):
    message = message.args[0] if message.args else ""
  message = str(message)
  for override in (a for a in argv if a.startswith("--config.")):
    parts = override.partition("=")[0].removeprefix("--").split(".")
    bad = next((i for i, part in enumerate(parts[1:], 1)
                if message.startswith(f"'{part}'") or message == part), None)
    if bad is not None:
      if bad > 1:
        problem = f"config section {'.'.join(parts[1:bad])!r} has no key {parts[bad]!r}"
      else:
        problem = f"the config has no {'section' if len(parts) > 2 else 'key'} {parts[1]!r}"
      hint = message.partition("\n")[2].strip()
      if not hint and bad == len(parts) - 1:
        holders = _sections_with_key(_config_of(argv, parts[0]), parts[bad])
        if holders:
          hint = "the config has " + ", ".join(f"{parts[0]}.{h}.{parts[bad]}" for h in holders)
      return f"{override}: {problem}" + (f" ({hint})" if hint else "") + "."
  return None


def _config_of(argv: list[str], name: str) -> ml_collections.ConfigDict | None:
  """The config the `--<name>=` flag of `argv` names, if it loads."""
  spec = next((a.partition("=")[2] for a in argv if a.startswith(f"--{name}=")), None)
  try:
    return load(spec) if spec else None
  except ConfigFileError:
    return None


def _sections_with_key(config: ml_collections.ConfigDict | None, key: str,
                       path: str = "") -> list[str]:
  """The dotted paths of `config`'s sections that hold a key `key` (not a section)."""
  if config is None:
    return []
  found = []
  for name, value in config.items():
    inner = f"{path}.{name}" if path else name
    if isinstance(value, ml_collections.ConfigDict):
      found += _sections_with_key(value, key, inner)
    elif name == key and path:
      found.append(path)
  return found
