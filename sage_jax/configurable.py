"""Builds the library's frozen dataclass configs from sections of an ml_collections config.

Every module takes a plain dataclass (`EnvPoolConfig`, `EngineConfig`, ...); the run's
ConfigDict has one section per dataclass with the same field names. `build` checks keys and
types before anything is constructed, so a typo or a wrong type fails at start with the full
key path (`config.rollout.group_sise: unknown key ...`), never after minutes of compilation.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Mapping, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
  """A config value that cannot be used; the message names the key."""


def build(cls: type[T], section: Any, path: str) -> T:
  """`cls(**section)` after checking every key exists on `cls` and every value's type."""
  values = section.to_dict() if hasattr(section, "to_dict") else dict(section or {})
  fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
  unknown = sorted(set(values) - set(fields))
  if unknown:
    raise ConfigError(f"{path}.{unknown[0]}: unknown key; {cls.__name__} has "
                      f"{sorted(fields)}")
  hints = typing.get_type_hints(cls)
  converted = {k: _check(hints[k], v, f"{path}.{k}") for k, v in values.items()}
  try:
    return cls(**converted)
  except (ValueError, TypeError) as e:
    raise ConfigError(f"{path}: {e}") from e


def _check(hint: Any, value: Any, key: str) -> Any:
  """Returns `value` (lists become tuples) if it fits `hint`, else raises ConfigError."""
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if hint is Any:
    return value
  if origin in (typing.Union, types.UnionType):
    errors = []
    for option in args:
      try:
        return _check(option, value, key)
      except ConfigError as e:
        errors.append(e)
    raise ConfigError(f"{key}: expected {_name(hint)}, got {type(value).__name__} {value!r}")
  if hint is type(None):
    if value is None:
      return None
  elif origin is typing.Literal:
    if value in args:
      return value
    raise ConfigError(f"{key}: expected one of {list(args)}, got {value!r}")
  elif origin in (tuple, list):
    if isinstance(value, (tuple, list)):
      item = args[0] if args else Any
      return tuple(_check(item, v, f"{key}[{i}]") for i, v in enumerate(value))
  elif origin in (dict, Mapping) or hint in (dict, Mapping):
    if isinstance(value, Mapping):
      return dict(value)
  elif hint is float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
  elif hint is int:
    if isinstance(value, int) and not isinstance(value, bool):
      return value
  elif isinstance(hint, type):
    if isinstance(value, hint):
      return value
  raise ConfigError(f"{key}: expected {_name(hint)}, got {type(value).__name__} {value!r}")


def _name(hint: Any) -> str:
  return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
