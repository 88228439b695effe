"""Which functions of the executed code ran, and whether each call returned or raised.

Skill rewards pay for skills that ran successfully, so the worker observes calls while
AppWorld executes a block, instead of reading them off the code's text. `CallTracer` installs
a `sys.settrace` hook around `AppWorld.execute`; it changes nothing that AppWorld does (same
namespace, same code objects, same output) and costs one cheap check per Python call.

What is recorded, per world:
- A *block* is one `execute` (the installed skill library is block "library"; the agent's
  blocks are numbered 0, 1, ... in execution order).
- The functions of a block are the `def`s in the module scope of the cells IPython ran for
  it (at top level, or inside a top-level `if`, `for`, `with`, `try`...: the constants of the
  cell's module code), registered when that code starts. Functions nested in functions,
  lambdas, comprehensions and class bodies are not recorded.
- A call is recorded by code object identity: (defining block, line of the definition in the
  block as given, name) with how many of its calls returned and how many raised. A call
  from code compiled elsewhere (e.g. `exec` of copied source) is not a call of the block's
  function.
- Returned vs raised: at CPython's "return" trace event, the frame's last instruction is a
  return when the call returned; anything else means an exception is leaving the frame. A
  call counts as returned only once every recorded call around it returned too: a skill that
  returned inside a call that then raised (e.g. a helper swallowed by `try/except`) counts as
  `discarded`, not `returned`.
- A generator (or coroutine) is one call from its first resume to its end: a `yield`
  suspends it and counts nothing. It returned when it ran to its end or its consumer closed
  it (`break`, `next(g)` then dropped); it raised when an exception other than the close left
  it, and then what returned inside any of its resumes is discarded. One created and never
  started, or still suspended when the block ends, counts nothing.
- If the executed code replaced or removed the hook, the block's trace is marked incomplete.

Only the worker process imports this module (it inspects IPython, which AppWorld runs).
"""

from __future__ import annotations

import dis
import sys
import types
from collections.abc import Callable
from typing import Any

_RETURN_OPS = frozenset(dis.opmap[name] for name in ("RETURN_VALUE", "RETURN_CONST")
                        if name in dis.opmap)
_YIELD_OP = dis.opmap["YIELD_VALUE"]
# Where the frame of a generator that never ran stands (3.11+): closing it runs no code.
_NOT_STARTED_OP = dis.opmap.get("RETURN_GENERATOR")
_NEW_LOCALS = 0x0002  # inspect.CO_NEWLOCALS: set for functions, not for class bodies
_SUSPENDABLE = 0x0020 | 0x0080 | 0x0200  # inspect.CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR
LIBRARY_BLOCK = "library"


def _run_code_frame_code() -> types.CodeType:
  """The code of IPython's `run_code`, which executes each cell's module code."""
  from IPython.core.interactiveshell import InteractiveShell
  return InteractiveShell.run_code.__code__


class _Function:
  """A registered module-scope function: where it was defined and how its calls ended."""

  __slots__ = ("code", "block", "line", "name", "suspendable", "returned", "raised",
               "discarded")

  def __init__(self, code: types.CodeType, block: Any, line: int):
    self.code, self.block, self.line, self.name = code, block, line, code.co_name
    self.suspendable = bool(code.co_flags & _SUSPENDABLE)
    self.returned = self.raised = self.discarded = 0

  def counts(self) -> tuple[int, int, int]:
    return self.returned, self.raised, self.discarded


class _Running:
  """A recorded call in progress: the calls that returned inside it so far (they count once
  the outermost recorded call around them has returned), and for a generator the exception
  that last passed through it, with the instruction it passed at."""

  __slots__ = ("function", "inside", "exception")

  def __init__(self, function: _Function, inside: list[_Function]):
    self.function, self.inside = function, inside
    self.exception: tuple[int, type] | None = None


class CallTracer:
  """Call records of one world's blocks (make one per world)."""

  def __init__(self):
    self._run_code = _run_code_frame_code()
    self._next_block = 0
    self._functions: dict[int, _Function] = {}  # id(code) -> function (keeps the code alive)
    self._block: Any = None
    self._line_offset = 0
    self._touched: dict[int, tuple[int, int, int]] = {}  # id(code) -> counts at block start
    self._stack: list[_Running] = []  # recorded calls in progress, innermost last
    # Suspended generators of the block: id(frame) -> what returned inside their resumes.
    self._suspended: dict[int, list[_Function]] = {}

  def run(self, execute: Callable[[str], str], code: str, *, library: bool = False
          ) -> tuple[str, dict]:
    """`execute(code)` under the hook: (its output, the block's trace: its id, whether the
    hook stayed in place throughout, and `calls()`)."""
    if library:
      block_id = LIBRARY_BLOCK
    else:
      block_id, self._next_block = self._next_block, self._next_block + 1
    self._block = block_id
    # AppWorld strips the code before IPython compiles it: lines shift by the blank lines
    # it removed at the start.
    self._line_offset = code[:len(code) - len(code.lstrip())].count("\n")
    self._touched, self._stack, self._suspended = {}, [], {}
    previous = sys.gettrace()
    sys.settrace(self._global)
    try:
      output = execute(code)
    finally:
      hook = sys.gettrace()  # a bound method is a new object on every access
      complete = (getattr(hook, "__func__", None) is CallTracer._global
                  and getattr(hook, "__self__", None) is self)
      sys.settrace(previous)
    return output, {"block": block_id, "complete": complete, "calls": self.calls()}

  def calls(self) -> list[dict]:
    """The functions called during the last block (any block's functions): their defining
    block, line, name, and how many of the block's calls returned, raised, or returned
    inside a call that raised (discarded)."""
    out = []
    for key, before in self._touched.items():
      f = self._functions[key]
      returned, raised, discarded = (now - then for now, then in zip(f.counts(), before))
      out.append({"block": f.block, "line": f.line, "name": f.name, "returned": returned,
                  "raised": raised, "discarded": discarded})
    return out

  # --- the hook ------------------------------------------------------------------------------

  def _global(self, frame: types.FrameType, event: str, arg: Any):
    del event, arg  # the global hook only sees "call"
    code = frame.f_code
    function = self._functions.get(id(code))
    if function is not None and function.code is code:
      if function.suspendable:
        if code.co_code[frame.f_lasti] == _NOT_STARTED_OP:
          return None  # a generator closed before it ever ran
        inside = self._suspended.pop(id(frame), [])
      else:
        inside = []
      self._touched.setdefault(id(code), function.counts())  # counts before the block's calls
      self._stack.append(_Running(function, inside))
      frame.f_trace_lines = False
      return self._local_for(function)
    if (code.co_name == "<module>" and frame.f_back is not None
        and frame.f_back.f_code is self._run_code):
      self._register(code)
    return None

  def _local_for(self, function: _Function):
    def local(frame: types.FrameType, event: str, arg: Any):
      if not (self._stack and self._stack[-1].function is function):
        return local
      running = self._stack[-1]
      if event == "exception":
        running.exception = (frame.f_lasti, arg[0])
      elif event == "return":
        self._stack.pop()
        self._ended(running, frame)
      return local
    return local

  def _ended(self, running: _Running, frame: types.FrameType) -> None:
    """Counts a recorded call that left its frame (returned, raised, or a generator that
    yielded: suspended, counting nothing yet)."""
    op = frame.f_code.co_code[frame.f_lasti]
    returned = op in _RETURN_OPS
    if running.function.suspendable and op == _YIELD_OP:
      exception = running.exception
      if exception is None or exception[0] != frame.f_lasti:
        self._suspended[id(frame)] = running.inside  # a yield
        return
      returned = exception[1] is GeneratorExit  # closed by its consumer, or thrown into
    if returned:
      running.inside.append(running.function)
      if self._stack:
        self._stack[-1].inside.extend(running.inside)
      else:
        for f in running.inside:
          f.returned += 1
    else:
      running.function.raised += 1
      for f in running.inside:
        f.discarded += 1

  def _register(self, module: types.CodeType) -> None:
    for const in module.co_consts:
      if (isinstance(const, types.CodeType) and const.co_flags & _NEW_LOCALS
          and not const.co_name.startswith("<")):
        self._functions[id(const)] = _Function(const, self._block,
                                               const.co_firstlineno + self._line_offset)
