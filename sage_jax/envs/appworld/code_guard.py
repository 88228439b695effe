"""A static check that agent code does not reach into the interpreter it runs in.

AppWorld's own guard refuses imports outside a short list (`sys`, `gc` and `inspect` are not
on it) and a few file and process functions, but not what code reaches through attributes.
Agent code shares its interpreter with the call tracer whose records the skill rewards read
(`calltrace`), and with the AppWorld object that saves the world's state; a block that walks
frames, dunder attributes, the builtins namespace or attributes named at run time can forge
either. Such a block is refused before it runs, the way AppWorld refuses an import: the
observation says "Execution failed" and why, and nothing of it executes.

What is refused: the names `__import__`, `__builtins__`, `globals`, `locals`, `vars`,
`eval`, `exec`, `compile`, `breakpoint`; attributes (also in `match` class patterns and
imported names) that start with an underscore, other than a few everyday ones (`__init__`,
`__name__`, `__doc__`, namedtuple methods), or that lead to frames, tracing or modules
(`f_back`, `gi_frame`, `gettrace`, `sys`, `modules`, `attrgetter`, `get_field`, ...); and
`getattr`/`setattr`/`delattr`/`hasattr` other than called with a literal name that passes
the same rule. Ordinary task code (API calls, data handling, function definitions) never
needs any of them.
"""

from __future__ import annotations

import ast

FORBIDDEN_NAMES = frozenset({
    "__import__", "__builtins__", "__loader__", "__spec__", "globals", "locals", "vars",
    "eval", "exec", "compile", "breakpoint"})
ALLOWED_PRIVATE = frozenset({
    "__init__", "__name__", "__doc__", "_asdict", "_replace", "_fields", "_make"})
FORBIDDEN_ATTRIBUTES = frozenset({
    # frames, code, tracebacks
    "f_back", "f_globals", "f_locals", "f_builtins", "f_code", "f_trace", "gi_frame",
    "gi_code", "cr_frame", "cr_code", "ag_frame", "ag_code", "tb_frame", "tb_next",
    # tracing and the module table (os.sys is the sys module)
    "gettrace", "settrace", "setprofile", "getprofile", "sys", "modules",
    # attribute access by a name chosen at run time
    "attrgetter", "methodcaller", "get_field"})
ATTRIBUTE_FUNCTIONS = frozenset({"getattr", "setattr", "delattr", "hasattr"})


def _attribute_refusal(name: str) -> str | None:
  if name in FORBIDDEN_ATTRIBUTES or (name.startswith("_") and name not in ALLOWED_PRIVATE):
    return f"the attribute {name!r} is not allowed (it reaches the interpreter's internals)"
  return None


def refusal(code: str) -> str | None:
  """Why `code` may not run, or None. Code that does not parse is left to AppWorld, which
  reports the syntax error."""
  try:
    tree = ast.parse(code)
  except (SyntaxError, ValueError):
    return None
  calls_by_name = {id(n.func): n for n in ast.walk(tree)
                   if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
  for node in ast.walk(tree):
    if isinstance(node, ast.Name):
      if node.id in FORBIDDEN_NAMES:
        return f"{node.id!r} is not allowed (it reaches the interpreter's internals)"
      if node.id in ATTRIBUTE_FUNCTIONS:
        call = calls_by_name.get(id(node))
        name = call.args[1] if call is not None and len(call.args) >= 2 else None
        if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
          return (f"{node.id} is allowed only when called with the attribute's name "
                  "written out as a string")
        if why := _attribute_refusal(name.value):
          return why
    elif isinstance(node, ast.Attribute):
      if why := _attribute_refusal(node.attr):
        return why
    elif isinstance(node, ast.MatchClass):
      for name in node.kwd_attrs:
        if why := _attribute_refusal(name):
          return why
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      for alias in node.names:
        if alias.name in FORBIDDEN_NAMES:
          return f"{alias.name!r} is not allowed (it reaches the interpreter's internals)"
        if why := _attribute_refusal(alias.name.rsplit(".", 1)[-1]):
          return why
  return None
