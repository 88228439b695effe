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
    self._pending: dict[int, asyncio.Future] = {}
    self._error: BaseException | None = None
    self._thread = threading.Thread(target=self._loop, name="sampler-engine", daemon=True)
    self._thread.start()

  async def __aenter__(self) -> "AsyncEngine":
    return self

  async def __aexit__(self, *exc) -> None:
    self.close()

  async def start(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams(),
                  seed: int = 0) -> TurnResult:
    """Starts a sequence and returns its first turn (its `seq_id` names it from then on)."""
    return await self._submit("start", list(prompt_ids), sampling, seed)

  async def append(self, seq_id: int, new_ids: Sequence[int],
                   sampling: SamplingParams | None = None) -> TurnResult:
    """Appends `new_ids` to an idle sequence and returns its next turn."""
    return await self._submit("append", seq_id, list(new_ids), sampling)

  async def free(self, seq_id: int) -> None:
    """Releases a sequence's slot (before the engine's next step)."""
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

  async def _submit(self, kind: str, *args) -> TurnResult | None:
    self._check_alive()
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    self._commands.put((kind, loop, future, args))
    return await future

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
          loop, future = self._pending.pop(result.seq_id)
          loop.call_soon_threadsafe(_resolve, future, result, None)
    except BaseException as error:  # Every waiter must learn that the engine died.
      self._error = error
      for loop, future in self._pending.values():
        loop.call_soon_threadsafe(_resolve, future, None, error)
      raise
    finally:
      for loop, future in self._pending.values():
        loop.call_soon_threadsafe(future.cancel)
      self._pending.clear()

  def _run_command(self, kind: str, loop, future, args) -> None:
    try:
      if kind == "start":
        seq_id = self.engine.start(*args)
      elif kind == "append":
        seq_id = args[0]
        self.engine.append(*args)
      else:
        self.engine.free(*args)
        loop.call_soon_threadsafe(_resolve, future, None, None)
        return
    except (ValueError, KeyError) as error:  # A bad request fails its caller only.
      loop.call_soon_threadsafe(_resolve, future, None, error)
      return
    self._pending[seq_id] = (loop, future)


def _resolve(future: asyncio.Future, result, error) -> None:
  if future.done():  # The awaiting task was cancelled.
    return
  if error is not None:
    future.set_exception(error)
  else:
    future.set_result(result)
