"""Skill events from the AST of the code an episode actually ran.

Definitions (per task episode; "library skills" are those the task was shown and had
installed):

- generated: a top-level function, not a library skill, whose defining block ran without
  error in this task.
- used: a library skill called by the task's code while it still was the library's version
  (not redefined earlier in the task or in the same block). A call counts when it is reached
  from the block's top-level statements, directly or through functions defined in the task
  or other library skills (so a library skill called by a helper the task defined and called
  is used, and so are the library skills a used skill calls).
- updated: a library skill redefined (same name) by a block that ran without error.
- saved: generated and updated functions, in their last definition that ran without error;
  the rollout adds them to the library when the task ends.

A block with a syntax error ran nothing and yields no event (and never crashes the agent).
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterable, Mapping


@dataclasses.dataclass(frozen=True)
class FunctionInfo:
  """A top-level function definition of a code block."""

  name: str
  source: str  # the definition's source, decorators included
  signature: str  # "name(a, b=1)"
  docstring: str  # "" when it has none
  calls: frozenset[str]  # plain names called anywhere in its body
  imports: tuple[str, ...] = ()  # top-level imports of its block (they travel with it)

  @property
  def code(self) -> str:
    """Source to install it elsewhere: its block's imports, then the definition."""
    return "\n".join((*self.imports, self.source)) + "\n"


@dataclasses.dataclass(frozen=True)
class CodeAnalysis:
  syntax_ok: bool
  error: str | None
  functions: tuple[FunctionInfo, ...]  # top-level definitions, in order
  top_level_calls: frozenset[str]  # names called outside function bodies
  imports: tuple[str, ...]


def _called_names(nodes: Iterable[ast.AST], *, skip_defs: bool) -> set[str]:
  """Plain names called (`f(...)`) under `nodes`; with skip_defs, not inside function or
  class bodies (lambdas and comprehensions are kept: they run where they stand)."""
  names, stack = set(), list(nodes)
  while stack:
    node = stack.pop()
    if skip_defs and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      stack.extend(node.decorator_list)  # decorators run at definition time
      continue
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
      names.add(node.func.id)
    stack.extend(ast.iter_child_nodes(node))
  return names


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
  try:
    args = ast.unparse(node.args)
  except Exception:  # noqa: BLE001 - unparse of exotic syntax; the name still matters
    args = "..."
  prefix = "async " if isinstance(node, ast.AsyncFunctionDef) else ""
  return f"{prefix}{node.name}({args})"


def analyze(code: str) -> CodeAnalysis:
  """Top-level functions, top-level calls and imports of `code`; never raises."""
  try:
    tree = ast.parse(code)
  except (SyntaxError, ValueError) as e:  # ValueError: null bytes
    return CodeAnalysis(False, f"{type(e).__name__}: {e}", (), frozenset(), ())
  imports = tuple(ast.get_source_segment(code, n) or ast.unparse(n) for n in tree.body
                  if isinstance(n, (ast.Import, ast.ImportFrom)))
  functions = []
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      first = node.decorator_list[0] if node.decorator_list else node
      lines = code.splitlines(keepends=True)
      source = "".join(lines[first.lineno - 1:node.end_lineno]).rstrip()
      if first.col_offset:  # cannot happen at top level, but keep the source valid
        source = ast.unparse(node)
      functions.append(FunctionInfo(
          name=node.name, source=source, signature=_signature(node),
          docstring=ast.get_docstring(node) or "",
          calls=frozenset(_called_names(node.body, skip_defs=False)), imports=imports))
  return CodeAnalysis(True, None, tuple(functions),
                      frozenset(_called_names(tree.body, skip_defs=True)), imports)


@dataclasses.dataclass(frozen=True)
class SkillEvents:
  """What one task episode did with skills (names, sorted)."""

  generated: tuple[str, ...] = ()
  used: tuple[str, ...] = ()
  updated: tuple[str, ...] = ()
  saved: tuple[str, ...] = ()
  failed_definitions: tuple[str, ...] = ()  # defined only in blocks that failed
  syntax_errors: int = 0  # executed blocks that did not parse

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


class SkillTracker:
  """Accumulates one task's skill events, block by block, in execution order."""

  def __init__(self, library: Mapping[str, Iterable[str]] = {}):
    """`library`: name -> names it calls, of every library skill the task can call."""
    self._library = {name: frozenset(calls) for name, calls in library.items()}
    self._task_functions: dict[str, FunctionInfo] = {}  # every definition seen, latest
    self._ok: dict[str, FunctionInfo] = {}  # latest definition that ran without error
    self._redefined: set[str] = set()  # library names redefined so far
    self._used: set[str] = set()
    self._failed: set[str] = set()
    self._syntax_errors = 0

  def observe(self, code: str, ok: bool) -> CodeAnalysis:
    """Records one executed block; `ok` is whether it ran without error."""
    analysis = analyze(code)
    if not analysis.syntax_ok:
      self._syntax_errors += 1
      return analysis
    defined_here = {f.name for f in analysis.functions}
    # Functions of this block shadow earlier ones from the block's start (good enough: a
    # call placed before its redefinition in the same block is rare and ambiguous anyway).
    for f in analysis.functions:
      self._task_functions[f.name] = f
    shadowed = self._redefined | (defined_here & set(self._library))
    self._used |= self._reachable_library(analysis.top_level_calls, shadowed)
    for f in analysis.functions:
      if ok:
        self._ok[f.name] = f
        self._failed.discard(f.name)
        if f.name in self._library:
          self._redefined.add(f.name)
      elif f.name not in self._ok:
        self._failed.add(f.name)
    if not ok:
      # A library name redefined in a failing block may still have been rebound.
      self._redefined |= defined_here & set(self._library)
    return analysis

  def _reachable_library(self, roots: Iterable[str], shadowed: set[str]) -> set[str]:
    used, seen, stack = set(), set(), list(roots)
    while stack:
      name = stack.pop()
      if name in seen:
        continue
      seen.add(name)
      if name in self._task_functions and (name not in self._library or name in shadowed):
        stack.extend(self._task_functions[name].calls)
      elif name in self._library:
        used.add(name)
        stack.extend(self._library[name])
    return used

  def events(self) -> SkillEvents:
    generated = sorted(n for n in self._ok if n not in self._library)
    updated = sorted(n for n in self._ok if n in self._library)
    return SkillEvents(
        generated=tuple(generated), used=tuple(sorted(self._used)), updated=tuple(updated),
        saved=tuple(sorted(generated + updated)), failed_definitions=tuple(sorted(self._failed)),
        syntax_errors=self._syntax_errors)

  def saved_functions(self) -> dict[str, FunctionInfo]:
    """The definitions to save: each generated or updated function's last good version."""
    return dict(self._ok)
