"""Skill events of a task episode, from what its code did when it ran.

The AppWorld worker records, for every executed block, which module-scope functions of the
task's blocks (defined at top level, or inside a top-level `if`, `for`, `while`, `with`, `try`
or `match`) and of the installed library were called and whether each call returned or
raised (`envs.appworld.calltrace`; a call that returned inside a call that raised does not
count as returned). From those records (per task episode; "library skills" are those the
task was shown and had installed):

- used: a library skill, in its library version, that was called and returned without
  raising (directly, through functions the task defined, or inside another library skill).
- generated: a function, not a library skill, defined in the task and called successfully
  (a call of that definition returned), in a definition that can be saved (below).
- updated: a library skill redefined in the task and then called successfully (likewise).
- saved: for each generated or updated name, the last definition (in execution order) that
  was called successfully, unless the name is a builtin's (`len`: ordinary code calling the
  builtin would count as a use where it is installed); the rollout adds it to the library
  when the task ends, with the imports of its block and what it reads of the task's other
  imports and literal constants (`LIMIT = 20`), as the code that ran had bound them by the
  end of the last block in which it ran successfully (a block that failed bound nothing
  after its failing line), so that it runs as it did where it is installed. A value
  computed by code (`token = apis...`) is not carried: it would run again; nor is a constant
  bound inside an `if`, a loop or an `except` (the text does not say which value the name
  held). A definition whose decorators, default values or annotations read anything else (a
  task function or class, a computed value) cannot be saved: its `def` would fail where it
  is installed.

So a define-only block saves nothing, a block whose skill call returned but whose last line
failed still saves the skill, and a library skill that raised (even inside `try/except`),
was never reached (`if False: f()`), or was replaced after failing is not used. A generator
skill returned when it ran to its end or its consumer closed it; one that yielded and then
raised did not.

Diagnostics: `idle_uses`, the used library skills none of whose returned calls made an app
request (an API call other than to `api_docs`), i.e. skills that ask nothing of the apps; the
rewards leave them out only with `RewardConfig.credit_idle_uses=False` (else a `def f(): pass`
saved in one task and called in the next earns both bonuses). `mentioned`, the library
skills the executed code names in calls reachable from its top level (static analysis of the
text); `failed_uses`, library skills called that never returned; `failed_definitions`, names the
task defined but saved no definition of (none ran successfully, or none can be saved);
`untraced_blocks`, blocks whose call records were incomplete (their calls are ignored).
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import io
import re
import symtable
import tokenize
from collections.abc import Iterable, Iterator, Mapping


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
# Expressions with a scope of their own: the names they bind stay inside them.
_OWN_SCOPE_EXPRESSIONS = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
                          ast.GeneratorExp)
_BUILTINS = frozenset(dir(builtins))
FAILED_PREFIX = "Execution failed."  # how AppWorld's output of a block that raised begins
# A frame of the block's own top level in AppWorld's traceback (lines of the stripped block).
_TOP_LEVEL_FRAME = re.compile(r'^[ \t]*File "<python-input>", line (\d+), in <module>$', re.M)


@dataclasses.dataclass(frozen=True)
class FunctionInfo:
  """A function a code block defines in module scope (where the worker traces its calls)."""

  name: str
  source: str  # the definition's source, decorators included
  signature: str  # "name(a, b=1)"
  docstring: str  # "" when it has none
  calls: frozenset[str]  # plain names called anywhere in its body
  imports: tuple[str, ...] = ()  # top-level imports of its block (they travel with it)
  line: int = 0  # its first line in the block (decorators included)
  reads: frozenset[str] = frozenset()  # global names its body (nested scopes too) reads
  # Module constants it reads (`LIMIT = 20`: literal values only; a value computed by
  # code, e.g. an API call, is not run again elsewhere), as the task had bound them.
  constants: tuple[str, ...] = ()
  # Names the `def` statement itself reads (decorators, default values, annotations): where
  # it is installed they must already be bound.
  definition_reads: frozenset[str] = frozenset()
  # Globals it reads that the task bound by running code (`token = apis.spotify.login(...)`,
  # a class, a constant set in a branch): unbound where it is installed.
  task_values: frozenset[str] = frozenset()

  @property
  def code(self) -> str:
    """Source to install it elsewhere: its imports and constants, then the definition."""
    return "\n".join((*self.imports, *self.constants, self.source)) + "\n"

  @property
  def installable(self) -> bool:
    """Whether it runs where it is installed: what the `def` reads is a builtin or bound by
    the imports and constants it carries (not a task function or a computed value), and its
    body reads no value the task computed."""
    carried = top_level_bindings("\n".join((*self.imports, *self.constants)))
    return (not self.task_values
            and self.definition_reads <= _BUILTINS | {name for name, _ in carried})


@dataclasses.dataclass(frozen=True)
class CodeAnalysis:
  syntax_ok: bool
  error: str | None
  functions: tuple[FunctionInfo, ...]  # module-scope definitions, in source order
  top_level_calls: frozenset[str]  # names called outside function bodies
  imports: tuple[str, ...]
  bindings: tuple[tuple[str, Binding], ...] = ()  # see `top_level_bindings`


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


def _global_reads(source: str, name: str) -> frozenset[str]:
  """Module names the body of function `name` (all of `source`) reads, in its nested
  functions, classes and comprehensions too. Python's own scoping (symtable) says which: a
  nested function's parameter or a comprehension's variable binds nothing in the function.
  A name declared `global` counts as read (`G += 1` reads it; symtable does not say so)."""
  try:
    scopes = [symtable.symtable(source, "<skill>", "exec").lookup(name).get_namespace()]
  except SyntaxError:  # `nonlocal x` with no `x`: its block never compiles, nothing ran
    return frozenset()
  names = set()
  while scopes:
    scope = scopes.pop()
    names.update(s.get_name() for s in scope.get_symbols()
                 if s.is_global() and (s.is_referenced() or s.is_declared_global()))
    scopes.extend(scope.get_children())
  return frozenset(names)


def _definition_reads(node: ast.FunctionDef | ast.AsyncFunctionDef) -> frozenset[str]:
  """Names its decorators, default values and annotations read: the `def` statement
  evaluates them (annotations too, where the skill is installed without the task's
  `from __future__ import annotations`, which install code leaves out)."""
  args = node.args
  parts = [*node.decorator_list, *args.defaults, *args.kw_defaults, node.returns,
           *(a.annotation for a in (*args.posonlyargs, *args.args, *args.kwonlyargs,
                                    args.vararg, args.kwarg) if a is not None)]
  return frozenset(n.id for part in parts if part is not None for n in ast.walk(part)
                   if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load))


def _module_scope(body: list[ast.stmt], conditional: bool = False
                  ) -> Iterator[tuple[ast.stmt, bool]]:
  """(statement, conditional) of each statement of `body` that runs in the module's scope, in
  source order: each one, then for a compound statement (if, for, while, with, try, match)
  those of its blocks. Conditional: inside a block that may run or not, or run many times
  (if, for, while, match, an `except` handler), where the text does not say what a name holds
  afterwards; a `with` or `try` body runs whenever its statement does. Function and class
  bodies are scopes of their own."""
  for node in body:
    yield node, conditional
    if isinstance(node, _SCOPES):
      continue
    inner = conditional or not isinstance(node, (ast.With, ast.AsyncWith, ast.Try, ast.TryStar))
    yield from _module_scope(getattr(node, "body", []), inner)
    for part in (*getattr(node, "handlers", ()), *getattr(node, "cases", ())):
      yield from _module_scope(part.body, True)
    for field in ("orelse", "finalbody"):
      yield from _module_scope(getattr(node, field, []), inner)


def _bound_names(node: ast.stmt) -> set[str]:
  """Names a module-scope statement binds itself: for a compound statement, what its header
  binds (a `for` target, `with ... as`, `except ... as`, a walrus in a condition, a `match`
  capture), not the statements of its blocks (`_module_scope` gives those)."""
  if isinstance(node, _SCOPES):
    return {node.name}
  if isinstance(node, (ast.Import, ast.ImportFrom)):
    return {a.asname or a.name.split(".")[0] for a in node.names if a.name != "*"}
  names, stack = set(), []
  for field, value in ast.iter_fields(node):
    if field in ("body", "orelse", "finalbody"):
      continue
    for child in value if isinstance(value, list) else [value]:
      if isinstance(child, ast.ExceptHandler):
        names.update([child.name] if child.name else [])
        stack.extend([child.type] if child.type else [])
      elif isinstance(child, ast.match_case):
        stack.extend([child.pattern, child.guard] if child.guard else [child.pattern])
      elif isinstance(child, ast.AST):
        stack.append(child)
  while stack:
    n = stack.pop()
    if isinstance(n, _OWN_SCOPE_EXPRESSIONS):
      if not isinstance(n, ast.Lambda):  # a comprehension's walrus binds out here
        names.update(w.target.id for w in ast.walk(n) if isinstance(w, ast.NamedExpr))
      continue
    if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
      names.add(n.id)
    elif isinstance(n, (ast.MatchAs, ast.MatchStar)) and n.name:
      names.add(n.name)
    elif isinstance(n, ast.MatchMapping) and n.rest:
      names.add(n.rest)
    stack.extend(ast.iter_child_nodes(n))
  return names


def module_scope_bindings(node: ast.stmt) -> set[str]:
  """Names a module-scope statement binds, the statements of its blocks included (a helper
  defined inside a top-level `if` or `try` too)."""
  return set().union(*(_bound_names(n) for n, _ in _module_scope([node])))


def _literal_constant(node: ast.stmt) -> bool:
  """`NAME = <literal>` (or `A = B = ...`, `NAME: T = ...`): numbers, strings, and
  containers of them, which install anywhere without running any code."""
  if isinstance(node, ast.Assign):
    targets, value = node.targets, node.value
  elif isinstance(node, ast.AnnAssign) and node.value is not None:
    targets, value = [node.target], node.value
  else:
    return False
  if not all(isinstance(t, ast.Name) for t in targets):
    return False
  try:
    ast.literal_eval(value)
  except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
    return False
  return True


@dataclasses.dataclass(frozen=True)
class Binding:
  """How a module-scope statement of a task bound a name: `source` is the statement when it
  is an import or a literal constant (something a saved skill can carry), else None."""

  source: str | None
  kind: str = ""  # "import" | "constant" | "function" | "" (a value computed by code)


def top_level_bindings(code: str) -> list[tuple[str, Binding]]:
  """(name, binding) of each name `code`'s module-scope statements bind, in source order."""
  try:
    return _bindings(ast.parse(code), code)
  except (SyntaxError, ValueError):
    return []


def _bindings(tree: ast.Module, code: str, failed_line: int | None = None
              ) -> list[tuple[str, Binding]]:
  """`failed_line`: where the code's top level raised. Statements from there on never ran,
  except in a `try` around it (its handlers and `finally` may have): what those bind is
  taken as computed, since the text does not say whether they ran."""
  statements = list(_module_scope(tree.body))
  try_ends = [node.end_lineno for node, _ in statements
              if failed_line is not None and isinstance(node, (ast.Try, ast.TryStar))
              and node.lineno < failed_line <= node.end_lineno]
  out = []
  for node, conditional in statements:
    if failed_line is not None and node.lineno >= failed_line:
      if not any(node.lineno <= end for end in try_ends):
        continue
      conditional = True
    # A constant bound in a branch may not be what the name held: carried, it could run
    # with another value than the task's. An import binds the same module wherever it ran.
    kind = ("import" if isinstance(node, (ast.Import, ast.ImportFrom))
            else "function" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            else "constant" if _literal_constant(node) and not conditional else "")
    # A nested statement's own text: its first line from its column, the rest as written
    # (continuation lines inside brackets or strings), so it also runs at top level.
    source = (ast.get_source_segment(code, node) or ast.unparse(node)) if kind else None
    out.extend((name, Binding(source, kind)) for name in sorted(_bound_names(node)))
  return out


def _failed_line(output: str | None) -> int | None:
  """The line at which a block's top level raised, from AppWorld's output of it (None: it
  ran to its end). The traceback's first frame of the block's top level is where the error
  first left its code; with no such frame a guard refused the block: line 1, none of it ran.
  (Printed text can imitate this output: a signal from the worker would be sturdier.)"""
  if output is None or not output.startswith(FAILED_PREFIX):
    return None
  frame = _TOP_LEVEL_FRAME.search(output)
  return int(frame.group(1)) if frame else 1


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
  try:
    args = ast.unparse(node.args)
  except Exception:  # noqa: BLE001 - unparse of exotic syntax; the name still matters
    args = "..."
  prefix = "async " if isinstance(node, ast.AsyncFunctionDef) else ""
  return f"{prefix}{node.name}({args})"


def source_lines(code: str, keepends: bool = True) -> list[str]:
  """`code`'s lines as Python numbers them: split at \\n, \\r\\n and \\r only (str.splitlines
  also splits at \\f, \\x85, \\u2028 and others, which agent code may hold in its strings)."""
  lines = re.findall(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$", code)
  return lines if keepends else [line.rstrip("\r\n") for line in lines]


def _definition_source(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
  """The definition's source, decorators included, at column 0: one nested in an `if` or a
  `try` is dedented, except the lines inside its string literals, which keep their text."""
  first = node.decorator_list[0] if node.decorator_list else node
  source = "".join(lines[first.lineno - 1:node.end_lineno]).rstrip()
  width = node.col_offset  # of `def`; its decorators stand in the same column
  if width:
    try:
      inside = set()  # rows (1-based) that continue a multi-line token: string literals
      for token in tokenize.generate_tokens(io.StringIO(source).readline):
        inside.update(range(token.start[0] + 1, token.end[0] + 1))
    except (tokenize.TokenError, SyntaxError):
      return ast.unparse(node)
    source = "".join(
        line if row in inside else line[min(width, len(line) - len(line.lstrip(" \t"))):]
        for row, line in enumerate(source_lines(source), 1))
  try:
    body = ast.parse(source).body
    whole = len(body) == 1 and type(body[0]) is type(node) and body[0].name == node.name
  except (SyntaxError, ValueError):
    whole = False
  return source if whole else ast.unparse(node)


def analyze(code: str) -> CodeAnalysis:
  """The functions `code` defines in module scope (at top level or in a top-level `if`,
  `for`, `while`, `with`, `try` or `match`), its top-level calls and imports; never raises."""
  try:
    tree = ast.parse(code)
  except (SyntaxError, ValueError) as e:  # ValueError: null bytes
    return CodeAnalysis(False, f"{type(e).__name__}: {e}", (), frozenset(), ())
  imports = tuple(ast.get_source_segment(code, n) or ast.unparse(n) for n in tree.body
                  if isinstance(n, (ast.Import, ast.ImportFrom)))
  lines = source_lines(code)
  functions = []
  for node, _ in _module_scope(tree.body):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      first = node.decorator_list[0] if node.decorator_list else node
      source = _definition_source(lines, node)
      functions.append(FunctionInfo(
          name=node.name, source=source, signature=_signature(node),
          docstring=ast.get_docstring(node) or "",
          calls=frozenset(_called_names(node.body, skip_defs=False)), imports=imports,
          line=first.lineno, reads=_global_reads(source, node.name),
          definition_reads=_definition_reads(node)))
  return CodeAnalysis(True, None, tuple(functions),
                      frozenset(_called_names(tree.body, skip_defs=True)), imports,
                      tuple(_bindings(tree, code)))


@dataclasses.dataclass(frozen=True)
class Call:
  """The calls of one function during one block: `block` is the block that defined it (an
  agent block's id, or "library"), `line` its first line (decorators included) there."""

  block: int | str
  line: int
  name: str
  returned: int
  raised: int
  discarded: int = 0  # returned inside a call that raised
  requested: int = 0  # of the returned calls, those that made an app request


@dataclasses.dataclass(frozen=True)
class BlockTrace:
  """The worker's call records of one executed block."""

  block: int | str
  calls: tuple[Call, ...] = ()
  complete: bool = True  # False: the code disturbed the recording; calls are not trusted

  @classmethod
  def from_dict(cls, d: Mapping) -> "BlockTrace":
    return cls(d["block"], tuple(Call(**c) for c in d["calls"]), bool(d["complete"]))


LIBRARY_BLOCK = "library"


@dataclasses.dataclass(frozen=True)
class SkillEvents:
  """What one task episode did with skills (names, sorted)."""

  generated: tuple[str, ...] = ()
  used: tuple[str, ...] = ()
  updated: tuple[str, ...] = ()
  saved: tuple[str, ...] = ()
  # diagnostics
  idle_uses: tuple[str, ...] = ()  # used, but no returned call made an app request
  mentioned: tuple[str, ...] = ()
  failed_uses: tuple[str, ...] = ()
  failed_definitions: tuple[str, ...] = ()
  syntax_errors: int = 0  # executed blocks that did not parse
  untraced_blocks: int = 0

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


class SkillTracker:
  """Accumulates one task's skill events, block by block, in execution order."""

  def __init__(self, library: Mapping[str, Iterable[str]] = {}):
    """`library`: name -> names it calls, of every library skill the task can call."""
    self._library = {name: frozenset(calls) for name, calls in library.items()}
    # (block, line, name) -> (execution order, definition) of every module-scope definition
    self._definitions: dict[tuple, tuple[tuple[int, int], FunctionInfo]] = {}
    # Definitions called successfully, each carrying the task's imports and constants as
    # bound by the end of the last block in which one of its calls returned.
    self._ran: dict[tuple, FunctionInfo] = {}
    self._used: set[str] = set()
    self._requesting: set[str] = set()  # used, with a returned call that made an app request
    self._library_called: set[str] = set()
    self._task_functions: dict[str, FunctionInfo] = {}  # latest text definition (static)
    # name -> (when, how) the task's executed blocks last bound it in module scope
    self._bindings: dict[str, tuple[tuple[int, int], Binding]] = {}
    self._mentioned: set[str] = set()
    self._blocks = 0
    self._syntax_errors = 0
    self._untraced = 0

  def observe(self, code: str, trace: BlockTrace | None, output: str | None = None
              ) -> CodeAnalysis:
    """Records one executed block, the worker's call records of it (None when the
    environment failed under it: nothing ran that can be credited) and AppWorld's output of
    it, which says whether and where it failed (None: it ran to its end). The code is read
    as AppWorld runs it, stripped (the records' lines count from its first line)."""
    code = code.strip()
    analysis = analyze(code)
    order = self._blocks
    self._blocks += 1
    if not analysis.syntax_ok:
      self._syntax_errors += 1
      return analysis
    self._observe_text(analysis)
    if trace is None:
      return analysis
    # What the block bound is read from its text, so only what ran of it counts: a block
    # that failed before rebinding a name left the name as it was.
    failed_line = _failed_line(output)
    bindings = (analysis.bindings if failed_line is None
                else _bindings(ast.parse(code), code, failed_line))
    for i, (name, binding) in enumerate(bindings):
      self._bindings[name] = ((order, i), binding)
    for f in analysis.functions:
      self._definitions[(trace.block, f.line, f.name)] = ((order, f.line), f)
    if not trace.complete:
      self._untraced += 1
      return analysis
    for call in trace.calls:
      if call.block == LIBRARY_BLOCK:
        if call.name in self._library:
          self._library_called.add(call.name)
          if call.returned:
            self._used.add(call.name)
          if call.requested:
            self._requesting.add(call.name)
      elif call.returned and (key := (call.block, call.line, call.name)) in self._definitions:
        carried = self._carrying(self._definitions[key][1])
        if carried.installable:  # else it cannot be saved: its `def` fails elsewhere
          self._ran[key] = carried
    return analysis

  def _carrying(self, f: FunctionInfo) -> FunctionInfo:
    """`f` with what it (and its `def`: default values, decorators) reads of the task's
    imports and literal constants, as bound by the end of the block observed last (where it
    ran): earlier blocks' imports join those of its own block. The task's other functions it
    calls travel as skills of their own; the values its code computed cannot travel."""
    imports, constants, computed = list(f.imports), [], set()
    reads = f.reads | f.definition_reads  # `def f(n=PAGE)`: PAGE is a local name inside f
    for name in sorted(reads & self._bindings.keys(), key=lambda n: self._bindings[n][0]):
      binding = self._bindings[name][1]
      if binding.kind == "import" and binding.source not in imports:
        imports.append(binding.source)
      elif binding.kind == "constant" and binding.source not in constants:
        constants.append(binding.source)
      elif not binding.kind:
        computed.add(name)
    return dataclasses.replace(f, imports=tuple(imports), constants=tuple(constants),
                               task_values=frozenset(computed))

  def _observe_text(self, analysis: CodeAnalysis) -> None:
    """Static diagnostics: library skills reachable from the block's top-level calls."""
    for f in analysis.functions:
      self._task_functions[f.name] = f  # a task definition shadows the library's
    seen, stack = set(), list(analysis.top_level_calls)
    while stack:
      name = stack.pop()
      if name in seen:
        continue
      seen.add(name)
      if name in self._task_functions:
        stack.extend(self._task_functions[name].calls)
      elif name in self._library:
        self._mentioned.add(name)
        stack.extend(self._library[name])

  def saved_functions(self) -> dict[str, FunctionInfo]:
    """The definitions to save: each generated or updated name's last definition that was
    called successfully, but none named like a builtin (`len`, `print`): a call to it could
    not be told from the builtin's where it is installed."""
    latest: dict[str, tuple[tuple[int, int], FunctionInfo]] = {}
    for key, f in self._ran.items():
      if f.name in _BUILTINS:
        continue
      order = self._definitions[key][0]
      if f.name not in latest or order > latest[f.name][0]:
        latest[f.name] = (order, f)
    return {name: f for name, (_, f) in sorted(latest.items())}

  def events(self) -> SkillEvents:
    saved = sorted(self.saved_functions())
    defined = {f.name for _, f in self._definitions.values()} | set(self._task_functions)
    return SkillEvents(
        generated=tuple(n for n in saved if n not in self._library),
        used=tuple(sorted(self._used)),
        updated=tuple(n for n in saved if n in self._library),
        saved=tuple(saved), idle_uses=tuple(sorted(self._used - self._requesting)),
        mentioned=tuple(sorted(self._mentioned)),
        failed_uses=tuple(sorted(self._library_called - self._used)),
        failed_definitions=tuple(sorted(defined - set(saved))),
        syntax_errors=self._syntax_errors, untraced_blocks=self._untraced)
