"""Ending long work early, at a clean point, when a signal asks this process to stop.

A training loop's dev evaluation can outlast a scheduler's grace period. The loop runs it
within `stop_when` of its signal guard, heard on any process (`multihost.asked_anywhere`),
and the agent calls `check()` before each turn: after a signal, every episode ends at its
next turn with StopRequested instead of the evaluation running to its end. Outside such a block `check()` does nothing, so a training
step's rollouts run to the step's end, where the loop stops. The predicate is a context
variable, which asyncio's tasks inherit from the code that starts them.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator


class StopRequested(Exception):
  """A signal asked this process to stop; raised where the work can end cleanly."""


_asked: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar(
    "stop_asked", default=None)


@contextlib.contextmanager
def stop_when(asked: Callable[[], bool]) -> Iterator[None]:
  """Within the block, `check()` raises StopRequested once `asked()` is true."""
  token = _asked.set(asked)
  try:
    yield
  finally:
    _asked.reset(token)


def check() -> None:
  """Raises StopRequested if a `stop_when` block around this call has been asked to stop."""
  asked = _asked.get()
  if asked is not None and asked():
    raise StopRequested("a signal asked this process to stop")
