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
  block as AppWorld runs it, stripped of surrounding blank space, name) with how many of its
  calls returned and how many raised. A call from code compiled elsewhere (e.g. `exec` of
  copied source) is not a call of the block's function.
- Returned vs raised: at CPython's "return" trace event, the frame's last instruction is a
  return when the call returned; anything else means an exception is leaving the frame. A
  call counts as returned only once every recorded call around it returned too: a skill that
  returned inside a call that then raised (e.g. a helper swallowed by `try/except`) counts as
  `discarded`, not `returned`.
- A generator (or coroutine) is one call from its first resume to its end: a `yield` (an
  `await`) suspends it and counts nothing yet. It raised when an exception left it other than
  the close its consumer threw in where it was suspended (what returned inside any of its
  resumes is then discarded); otherwise a generator returned, when it ran to its end, when
  its consumer closed it (`break`, `next(g)` then dropped), or, still suspended, when the
  block ended; a coroutine returned only by running to its end. If a recorded call it
  yielded into raised, it is discarded. One created and never started counts nothing.
  (CPython 3.13 closes a generator suspended outside `try` without running it: the block's
  end settles it.)
- Requested: of a function's returned calls, those during which the code made an app request
  (a call of `request_code`, AppWorld's `Requester.request`, for an app other than `api_docs`:
  reading documentation changes nothing). A recorded call is marked when such a request starts
  while it is in progress (in it, or in anything it called, a generator's resumes included),
  so that a skill that asks nothing of the apps (`def f(): pass`) can be told apart.
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
_RESUME_OP = dis.opmap["RESUME"]  # its argument's low bits: 0 at a function's start
# Where a frame stands when it leaves by a yield: the yield (3.11, 3.12) or the resume after
# it (3.13). An exception can leave from there too; the exception event then says so.
_SUSPEND_OPS = frozenset({dis.opmap["YIELD_VALUE"], _RESUME_OP})
# Where the frame of a generator that never ran stands (3.11+): closing it runs no code.
_NOT_STARTED_OP = dis.opmap.get("RETURN_GENERATOR")
_NEW_LOCALS = 0x0002  # inspect.CO_NEWLOCALS: set for functions, not for class bodies
_COROUTINE = 0x0080  # inspect.CO_COROUTINE; with CO_GENERATOR and CO_ASYNC_GENERATOR:
_SUSPENDABLE = 0x0020 | _COROUTINE | 0x0200
LIBRARY_BLOCK = "library"


def _run_code_frame_code() -> types.CodeType:
  """The code of IPython's `run_code`, which executes each cell's module code."""
  from IPython.core.interactiveshell import InteractiveShell
  return InteractiveShell.run_code.__code__


class _Function:
  """A registered module-scope function: where it was defined and how its calls ended."""

  __slots__ = ("code", "block", "line", "name", "suspendable", "coroutine", "returned",
               "raised", "discarded", "requested")

  def __init__(self, code: types.CodeType, block: Any, line: int):
    self.code, self.block, self.line, self.name = code, block, line, code.co_name
    self.suspendable = bool(code.co_flags & _SUSPENDABLE)
    self.coroutine = bool(code.co_flags & _COROUTINE)
    self.returned = self.raised = self.discarded = self.requested = 0

  def counts(self) -> tuple[int, int, int, int]:
    return self.returned, self.raised, self.discarded, self.requested


class _Calls:
  """What returned inside a recorded call (or a generator's resumes) so far, each with whether
  it made an app request, counted once the outermost recorded call around them has returned;
  the generators that yielded into it (discarded if it raises); whether an app request was
  made during it."""

  __slots__ = ("function", "inside", "generators", "requested")

  def __init__(self, function: _Function):
    self.function = function
    self.inside: list[tuple[_Function, bool]] = []
    self.generators: dict[int, _Generator] = {}  # by id: a generator yields many times
    self.requested = False

  def absorb(self, other: "_Calls") -> None:
    self.inside += other.inside
    self.generators.update(other.generators)


class _Generator(_Calls):
  """A started generator of the block, across its resumes; `spoiled` once a recorded call
  it yielded into has raised."""

  __slots__ = ("spoiled",)

  def __init__(self, function: _Function):
    super().__init__(function)
    self.spoiled = False


class _Running(_Calls):
  """A recorded call in progress (for a generator, one resume of `generator`, from the
  instruction `resumed_at`), with the exception that last passed through its frame and the
  instruction it passed at, and whether a close was thrown in where it resumed."""

  __slots__ = ("generator", "resumed_at", "exception", "closing")

  def __init__(self, function: _Function, generator: _Generator | None, resumed_at: int):
    super().__init__(function)
    self.generator, self.resumed_at = generator, resumed_at
    self.exception: tuple[int, type] | None = None
    self.closing = False


class CallTracer:
  """Call records of one world's blocks (make one per world). `request_code`: the code of
  AppWorld's `Requester.request`, through which the executed code's API calls pass (None:
  no call counts as requested)."""

  def __init__(self, request_code: types.CodeType | None = None):
    self._run_code = _run_code_frame_code()
    self._request_code = request_code
    self._next_block = 0
    self._functions: dict[int, _Function] = {}  # id(code) -> function (keeps the code alive)
    self._block: Any = None
    self._touched: dict[int, tuple[int, int, int]] = {}  # id(code) -> counts at block start
    self._stack: list[_Running] = []  # recorded calls in progress, innermost last
    self._generators: dict[int, _Generator] = {}  # id(frame) -> the block's started ones

  def run(self, execute: Callable[[str], str], code: str, *, library: bool = False
          ) -> tuple[str, dict]:
    """`execute(code)` under the hook: (its output, the block's trace: its id, whether the
    hook stayed in place throughout, and `calls()`)."""
    if library:
      block_id = LIBRARY_BLOCK
    else:
      block_id, self._next_block = self._next_block, self._next_block + 1
    self._block = block_id  # lines are of `code.strip()`, which AppWorld compiles
    self._touched, self._stack, self._generators = {}, [], {}
    previous = sys.gettrace()
    sys.settrace(self._global)
    try:
      output = execute(code)
    finally:
      hook = sys.gettrace()  # a bound method is a new object on every access
      complete = (getattr(hook, "__func__", None) is CallTracer._global
                  and getattr(hook, "__self__", None) is self)
      sys.settrace(previous)
      self._stack = []
      for generator in self._generators.values():  # suspended: they did not raise
        self._settle(generator, self._abandoned(generator))
      self._generators = {}
    return output, {"block": block_id, "complete": complete, "calls": self.calls()}

  def calls(self) -> list[dict]:
    """The functions called during the last block (any block's functions): their defining
    block, line, name, and how many of the block's calls returned, raised, or returned
    inside a call that raised (discarded), and how many of those that returned made an app
    request (requested)."""
    out = []
    for key, before in self._touched.items():
      f = self._functions[key]
      returned, raised, discarded, requested = (
          now - then for now, then in zip(f.counts(), before))
      out.append({"block": f.block, "line": f.line, "name": f.name, "returned": returned,
                  "raised": raised, "discarded": discarded, "requested": requested})
    return out

  # --- the hook ------------------------------------------------------------------------------

  def _global(self, frame: types.FrameType, event: str, arg: Any):
    del event, arg  # the global hook only sees "call"
    code = frame.f_code
    if code is self._request_code:
      if frame.f_locals.get("_app_name") != "api_docs":
        for running in self._stack:
          running.requested = True
      return None
    function = self._functions.get(id(code))
    if function is not None and function.code is code:
      generator = None
      if function.suspendable:
        op, oparg = code.co_code[frame.f_lasti], code.co_code[frame.f_lasti + 1]
        if op == _NOT_STARTED_OP:
          return None  # a generator closed before it ever ran
        generator = self._generators.get(id(frame))
        if op == _RESUME_OP and not oparg & 3 and generator is not None:
          # Its first resume, where a finished generator's frame stood: that one was closed
          # without running (CPython 3.13), so it did not raise.
          del self._generators[id(frame)]
          self._settle(generator, self._abandoned(generator))
          generator = None
        if generator is None:
          generator = self._generators[id(frame)] = _Generator(function)
      self._touched.setdefault(id(code), function.counts())  # counts before the block's calls
      self._stack.append(_Running(function, generator, frame.f_lasti))
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
        running.closing |= arg[0] is GeneratorExit and frame.f_lasti == running.resumed_at
      elif event == "return":
        self._stack.pop()
        self._left(running, frame)
      return local
    return local

  def _left(self, running: _Running, frame: types.FrameType) -> None:
    """Counts a recorded call that left its frame: it returned, raised, or (a generator)
    yielded, which suspends it and counts nothing yet."""
    op = frame.f_code.co_code[frame.f_lasti]
    generator = running.generator
    if generator is None:
      self._settle(running, "returned" if op in _RETURN_OPS else "raised")
      return
    generator.absorb(running)
    generator.requested |= running.requested  # across its resumes
    exception = running.exception
    if op in _SUSPEND_OPS and (exception is None or exception[0] != frame.f_lasti):
      if self._stack:  # a yield into a recorded call, which may still raise
        self._stack[-1].generators[id(generator)] = generator
      return
    del self._generators[id(frame)]
    if op in _RETURN_OPS:
      self._settle(generator, "discarded" if generator.spoiled else "returned")
    elif running.closing and exception[1] is GeneratorExit:  # its consumer closed it
      self._settle(generator, self._abandoned(generator))
    else:
      self._settle(generator, "raised")

  @staticmethod
  def _abandoned(generator: _Generator) -> str:
    """The outcome of a generator closed or left suspended: a generator returned what its
    consumer took; a coroutine never gave its result."""
    if generator.spoiled:
      return "discarded"
    return "unfinished" if generator.function.coroutine else "returned"

  def _settle(self, call: _Calls, outcome: str) -> None:
    """Counts an ended call: its function and what returned inside it go to the recorded call
    around it (or are counted at the top); when it raised, or returned inside a call that
    had raised, they are discarded along with the generators that yielded into it; an
    unfinished coroutine counts nothing itself and discards what returned inside it."""
    if outcome == "returned" and self._stack:
      self._stack[-1].absorb(call)
      self._stack[-1].inside.append((call.function, call.requested))
      return
    call.function.returned += outcome == "returned"
    call.function.raised += outcome == "raised"
    call.function.discarded += outcome == "discarded"
    call.function.requested += outcome == "returned" and call.requested
    for f, requested in call.inside:
      if outcome == "returned":
        f.returned += 1
        f.requested += requested
      else:
        f.discarded += 1
    for generator in call.generators.values():
      generator.spoiled |= outcome != "returned"

  def _register(self, module: types.CodeType) -> None:
    for const in module.co_consts:
      if (isinstance(const, types.CodeType) and const.co_flags & _NEW_LOCALS
          and not const.co_name.startswith("<")):
        self._functions[id(const)] = _Function(const, self._block, const.co_firstlineno)
