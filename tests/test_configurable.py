"""Config sections -> dataclasses: unknown keys, wrong types and invalid values name the key."""

import dataclasses
from typing import Literal

import ml_collections
import pytest

from sage_jax.configurable import ConfigError, build


@dataclasses.dataclass(frozen=True)
class Example:
  workers: int = 2
  timeout_s: float = 1.5
  root: str | None = None
  mode: Literal["std", "mean"] = "std"
  layers: tuple[int, ...] = ()
  enabled: bool = True

  def __post_init__(self):
    if self.workers < 1:
      raise ValueError(f"workers must be >= 1, got {self.workers}")


def test_builds_and_converts():
  section = ml_collections.ConfigDict(
      dict(workers=3, timeout_s=2, root="/data", mode="mean", layers=[1, 2], enabled=False))
  got = build(Example, section, "config.env")
  assert got == Example(3, 2.0, "/data", "mean", (1, 2), False)
  assert build(Example, {}, "config.env") == Example()


@pytest.mark.parametrize("values,message", [
    (dict(workerz=3), r"config.env.workerz: unknown key; Example has \['enabled', 'layers'"),
    (dict(workers="3"), r"config.env.workers: expected int, got str '3'"),
    (dict(workers=True), r"config.env.workers: expected int, got bool True"),
    (dict(root=5), r"config.env.root: expected str \| None, got int 5"),
    (dict(mode="max"), r"config.env.mode: expected one of \['std', 'mean'\], got 'max'"),
    (dict(layers=[1, "a"]), r"config.env.layers\[1\]: expected int, got str 'a'"),
    (dict(workers=0), r"config.env: workers must be >= 1, got 0"),
])
def test_errors_name_the_key(values, message):
  with pytest.raises(ConfigError, match=message):
    build(Example, values, "config.env")
