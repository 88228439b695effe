"""asyncio front end: rollout coroutines await turns while the engine decodes in a thread.

Each conversation is a coroutine: `turn = await engine.start(...)`, then the environment
call (awaited, so other conversations run meanwhile), then `await engine.append(...)`.
The engine's thread steps whenever any turn is in flight; device calls release the GIL,
so environment work on the event loop overlaps with decoding of the other slots.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Sequence

from sage_jax.sampler.engine import Engine, TurnResult
from sage_jax.sampler.sampling import SamplingParams


class AsyncEngine:
  """Owns an `Engine` and the one thread that drives it. Use as `async with`, or call
  `close()`. Coroutine methods must run on one event loop."""

  def __init__(self, engine: Engine):
    self.engine = engine
    self._commands: queue.SimpleQueue = queue.SimpleQueue()
    # The turn in flight of each sequence: its caller's (loop, future, command kind).
    self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future, str]] = {}
    self._error: BaseException | None = None
    self._thread = threading.Thread(target=self._loop, name="sampler-engine", daemon=True)
    self._thread.start()

  async def __aenter__(self) -> "AsyncEngine":
    return self

  async def __aexit__(self, *exc) -> None:
    self.close()

  async def start(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams(),
                  seed: int | None = None) -> TurnResult:
    """Starts a sequence and returns its first turn (its `seq_id` names it from then on).
    A caller cancelled before it returns never learns the id, so its sequence is freed here:
    else it would hold its slot for good."""
    future = self._submit("start", list(prompt_ids), sampling, seed)
    try:
      return await future
    except asyncio.CancelledError:
      if future.cancelled():  # The turn is in flight, or `_deliver` finds it cancelled.
        self._commands.put(("forget", None, future, (None,)))
      elif future.exception() is None:  # The turn came back as the caller was cancelled.
        self._commands.put(("forget", None, future, (future.result().seq_id,)))
      raise

  async def append(self, seq_id: int, new_ids: Sequence[int],
                   sampling: SamplingParams | None = None) -> TurnResult:
    """Appends `new_ids` to an idle sequence and returns its next turn."""
    return await self._submit("append", seq_id, list(new_ids), sampling)

  async def free(self, seq_id: int) -> None:
    """Releases a sequence's slot (before the engine's next step); a caller awaiting its turn
    is cancelled."""
    await self._submit("free", seq_id)

  def close(self) -> None:
    """Stops the engine thread; turns still in flight are cancelled."""
    if self._thread.is_alive():
      self._commands.put(None)
      self._thread.join()

  # --- Internals -------------------------------------------------------------------------

  def _check_alive(self) -> None:
    if self._error is not None:
      raise RuntimeError("the sampler engine thread failed") from self._error
    if not self._thread.is_alive():
      raise RuntimeError("the sampler engine is closed")

  def _submit(self, kind: str, *args) -> asyncio.Future:
    self._check_alive()
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    self._commands.put((kind, loop, future, args))
    return future

  def _loop(self) -> None:
    try:
      while True:
        # Block for a command only when the engine has nothing to do.
        try:
          command = self._commands.get(block=not self.engine.has_work)
        except queue.Empty:
          command = False
        if command is None:
          break
        if command:
          self._run_command(*command)
          continue  # Drain all queued commands before stepping.
        for result in self.engine.step():
          loop, future, kind = self._pending.pop(result.seq_id)
          if not _call_soon(loop, self._deliver, future, kind, result) and kind == "start":
            self.engine.free(result.seq_id)  # Nobody learns its id now.
    except BaseException as error:  # Every waiter must learn that the engine died.
      self._error = error
      for loop, future, _ in self._pending.values():
        _call_soon(loop, _resolve, future, None, error)
      raise
    finally:
      for loop, future, _ in self._pending.values():
        _call_soon(loop, future.cancel)
      self._pending.clear()

  def _run_command(self, kind: str, loop, future, args) -> None:
    if kind == "forget":
      self._forget(args[0], future)
      return
    try:
      if kind == "start":
        seq_id = self.engine.start(*args)
      elif kind == "append":
        seq_id = args[0]
        self.engine.append(*args)
      else:
        self.engine.free(*args)
        dropped = self._pending.pop(args[0], None)  # its turn, which never comes back now
        if dropped is not None:
          _call_soon(dropped[0], dropped[1].cancel)
        _call_soon(loop, _resolve, future, None, None)
        return
    except (ValueError, KeyError) as error:  # A bad request fails its caller only.
      _call_soon(loop, _resolve, future, None, error)
      return
    self._pending[seq_id] = (loop, future, kind)

  def _forget(self, seq_id: int | None, future: asyncio.Future) -> None:
    """Frees the sequence of a cancelled `start`: by id, or else the one whose turn `future`
    awaits (none when that turn came back meanwhile: `_deliver` names it then)."""
    if seq_id is None:
      seq_id = next((s for s, (_, f, _) in self._pending.items() if f is future), None)
      if seq_id is None:
        return
    self._pending.pop(seq_id, None)
    self.engine.free(seq_id)

  def _deliver(self, future: asyncio.Future, kind: str, result: TurnResult) -> None:
    """Hands a finished turn to its caller (on the caller's loop)."""
    if not future.cancelled():
      future.set_result(result)
    elif kind == "start":  # Its caller was cancelled and never learns the sequence's id.
      self._commands.put(("forget", None, future, (result.seq_id,)))


def _call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> bool:
  """Runs `callback` on a caller's loop; False when that loop is closed (its `asyncio.run`
  ended, cancelling the caller): the engine thread must not die of it."""
  try:
    loop.call_soon_threadsafe(callback, *args)
  except RuntimeError:
    return False
  return True


def _resolve(future: asyncio.Future, result, error) -> None:
  if future.done():  # The awaiting task was cancelled.
    return
  if error is not None:
    future.set_exception(error)
  else:
    future.set_result(result)
