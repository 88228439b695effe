"""A static check that agent code does not reach into the interpreter it runs in.

AppWorld's own guard refuses imports outside a short list (`sys`, `gc` and `inspect` are not
on it) and a few file and process functions, but not what code reaches through attributes.
Agent code shares its interpreter with the call tracer whose records the skill rewards read
(`calltrace`), and with the AppWorld object that saves the world's state; a block that walks
frames, dunder attributes, the builtins namespace or attributes named at run time can forge
either. Such a block is refused before it runs, the way AppWorld refuses an import: the
observation says "Execution failed" and why, and nothing of it executes.

What is refused: the names `__import__`, `__builtins__`, `globals`, `locals`, `vars`,
`eval`, `exec`, `compile`, `breakpoint`, and IPython's `get_ipython` (its shell runs text as
code); attributes (also in `match` class patterns and imported names) that start with an
underscore, other than a few everyday ones (`__init__`, `__name__`, `__doc__`, namedtuple
methods), or that lead to frames, tracing, modules or code run from text (`f_back`,
`gi_frame`, `gettrace`, `sys`, `modules`, `bltns`, `types`, `attrgetter`, `get_type_hints`,
YAML's unsafe loaders, ...), among them `string.Formatter` and its methods (its `get_field`
resolves the attribute path that a format field names, `{0.__globals__}`, and hands the
object to `convert_field` and `format_field`, which a subclass overrides; `str.format`,
`format_map` and `string.Template` give back only text); the modules that AppWorld lets code
import but that hand it the interpreter (`builtins`: its `exec` and `getattr` as attributes;
`unittest`: `mock.patch` sets any attribute named by a string), the helpers of `appworld`
that get attributes or modules by a name in a string (`getter_plus`, `import_module_file`,
...; its solutions and agents import its date and paging helpers), and `from ... import *`;
and `getattr`/`setattr`/`delattr`/`hasattr` other than called with a literal name that
passes the same rule. A string annotation is code too (pydantic evaluates one where a class
or a validated function is made; `typing` where hints are read): the expression it holds is
checked by the same rules, and so is every string that `typing` evaluates as an annotation
while the code runs (`guard_forward_references`: `x: T` with `T = "..."` hands pydantic a
string that no check of the code's text sees), and so is every attribute of a format field
that `string.Formatter` resolves while the code runs (`guard_format_fields`). AppWorld's own
objects (`apis`, `requester`) and the modules the code imports are not changed: no attribute
of theirs is set or deleted (`requester.request_tracker = None` broke every later block's
bookkeeping, which would count as the environment's failure, not the agent's; a module's
attributes are read by annotations and by AppWorld's own code). The code checked is what
AppWorld runs: the block without its surrounding blank space. Ordinary task code (API calls,
data handling, function definitions) never needs any of them. A static check raises the bar
rather than closing every door: the packages AppWorld imports hold deserialisers and name
resolvers of their own, and those found by walking the attributes that allowed imports reach
are refused above.
"""

from __future__ import annotations

import _string
import ast
import string
import typing

FORBIDDEN_NAMES = frozenset({
    "__import__", "__builtins__", "__loader__", "__spec__", "globals", "locals", "vars",
    "eval", "exec", "compile", "breakpoint", "get_ipython"})
ALLOWED_PRIVATE = frozenset({
    "__init__", "__name__", "__doc__", "_asdict", "_replace", "_fields", "_make"})
FORBIDDEN_ATTRIBUTES = frozenset({
    # frames, code, tracebacks
    "f_back", "f_globals", "f_locals", "f_builtins", "f_code", "f_trace", "gi_frame",
    "gi_code", "cr_frame", "cr_code", "ag_frame", "ag_code", "tb_frame", "tb_next",
    # tracing and the module table (os.sys is the sys module)
    "gettrace", "settrace", "setprofile", "getprofile", "sys", "modules",
    # modules that reach the interpreter, as attributes of allowed ones (enum.bltns,
    # typing.types, and appworld's modules: their gc, inspect, importlib, ...)
    "builtins", "bltns", "types", "CodeType", "FunctionType", "gc", "inspect", "importlib",
    "pkgutil", "zipimport", "marshal", "copyreg", "unittest", "subprocess", "threading",
    "asyncio", "pickle", "dill",
    # objects made from names in strings (logging's configuration, pydantic, pydoc), and
    # types from strings evaluated later (forward references)
    "dictConfig", "fileConfig", "resolve_name", "locate", "ImportString", "import_string",
    "ForwardRef", "evaluate_forwardref", "update_forward_refs", "model_rebuild",
    "create_model",
    # the interpreter's import and exec under other names (SQLAlchemy's compat module,
    # logging.config's configurators), reached by attribute chains from allowed imports
    "import_", "exec_", "importer", "importlib_metadata", "dottedgetter",
    # attribute access by a name chosen at run time; format fields resolved to objects
    # (string.Formatter's machinery, and IPython's subclasses, which evaluate a field as code)
    "attrgetter", "methodcaller", "Formatter", "EvalFormatter", "FullEvalFormatter",
    "DollarFormatter", "get_field", "get_value", "convert_field", "format_field", "vformat",
    # code run from text: string annotations (evaluated by these), YAML's Python tags
    "get_type_hints", "singledispatch", "singledispatchmethod", "unsafe_load",
    "unsafe_load_all", "full_load", "full_load_all", "Loader", "FullLoader", "UnsafeLoader",
    "CLoader", "CFullLoader", "CUnsafeLoader", "Constructor", "FullConstructor",
    "UnsafeConstructor", "add_constructor", "add_multi_constructor",
    # AppWorld's helpers (its solutions and agents import some of its others) that get
    # attributes or import modules by a name in a string
    "getter_plus", "build_condition_function", "import_module", "import_module_file",
    "import_module_and_submodules", "import_apis_module", "import_models_module",
    "import_factories_module", "import_constants_module", "import_responses_module",
    "import_tests_module", "ensure_package_installed", "analyze_lru_cache_usage",
    "get_api_name_to_test_names"})
FORBIDDEN_MODULES = frozenset({"builtins", "unittest"})
# The names under which AppWorld hands agent code its objects.
ENVIRONMENT_OBJECTS = frozenset({"apis", "requester"})
ATTRIBUTE_FUNCTIONS = frozenset({"getattr", "setattr", "delattr", "hasattr"})


def _attribute_refusal(name: str) -> str | None:
  if name in FORBIDDEN_ATTRIBUTES or (name.startswith("_") and name not in ALLOWED_PRIVATE):
    return f"the attribute {name!r} is not allowed (it reaches the interpreter's internals)"
  return None


def _root_name(node: ast.expr) -> str | None:
  """`a` of `a.b[0].c`."""
  while isinstance(node, (ast.Attribute, ast.Subscript)):
    node = node.value
  return node.id if isinstance(node, ast.Name) else None


def _annotations(node: ast.AST) -> list[ast.expr]:
  """The annotations `node` holds: a function's return and arguments', an annotated name's."""
  if isinstance(node, ast.AnnAssign):
    return [node.annotation]
  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
    args = node.args
    found = [a.annotation for a in (*args.posonlyargs, *args.args, *args.kwonlyargs,
                                    args.vararg, args.kwarg) if a is not None and a.annotation]
    return found + ([node.returns] if getattr(node, "returns", None) else [])
  return []


def _annotation_refusal(annotation: ast.expr) -> str | None:
  """Why a string inside `annotation` may not be evaluated (with the strings inside it, which
  are annotations in turn: `List["Song"]`), or None."""
  for part in ast.walk(annotation):
    if isinstance(part, ast.Constant) and isinstance(part.value, str):
      try:
        expression = ast.parse(part.value.strip(), mode="eval")
      except (SyntaxError, ValueError, RecursionError):
        continue  # not an expression: evaluating it fails before anything runs
      if why := _refusal(expression) or _annotation_refusal(expression.body):
        return f"a string annotation ({part.value[:60]!r}): {why}"
  return None


def _changed(root: str) -> str:
  if root in ENVIRONMENT_OBJECTS:
    return (f"AppWorld's objects ({', '.join(sorted(ENVIRONMENT_OBJECTS))}) are not to be "
            "changed: call their APIs instead")
  return f"the module {root!r} is not to be changed: keep your own values in your own names"


def guard_forward_references() -> None:
  """Makes `typing` refuse to evaluate a string annotation that `refusal` refuses, wherever
  the string comes from (pydantic evaluates one where a class or a validated function is
  made). For the process that runs agent code, before any runs."""
  evaluate = typing.ForwardRef._evaluate

  def checked(self, *args, **kwargs):
    if why := refusal(self.__forward_arg__):
      raise TypeError(f"the string annotation {self.__forward_arg__[:60]!r} is not "
                      f"evaluated: {why}")
    return evaluate(self, *args, **kwargs)

  typing.ForwardRef._evaluate = checked


def guard_format_fields() -> None:
  """Makes `string.Formatter` refuse a format field with an attribute that the guard refuses
  (`{0.__globals__}`), whichever formatter resolves it: a subclass is handed the object that
  the field names. For the process that runs agent code, before any runs."""
  get_field = string.Formatter.get_field

  def checked(self, field_name, *args, **kwargs):
    for is_attribute, name in _string.formatter_field_name_split(field_name)[1]:
      if is_attribute and (why := _attribute_refusal(name)):
        raise ValueError(f"the format field {field_name[:60]!r} is not resolved: {why}")
    return get_field(self, field_name, *args, **kwargs)

  string.Formatter.get_field = checked


def refusal(code: str) -> str | None:
  """Why `code` may not run, or None. Checks what AppWorld runs, `code.strip()` (a block
  that starts with blank space parses only without it). Code that does not parse is left to
  AppWorld, which reports the syntax error."""
  try:
    tree = ast.parse(code.strip())
  except (SyntaxError, ValueError):
    return None
  return _refusal(tree)


def _refusal(tree: ast.AST) -> str | None:
  calls_by_name = {id(n.func): n for n in ast.walk(tree)
                   if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
  imported = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree)
              if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
  unchanged = ENVIRONMENT_OBJECTS | imported
  for node in ast.walk(tree):
    for annotation in _annotations(node):
      if why := _annotation_refusal(annotation):
        return why
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
        if (node.id in ("setattr", "delattr") and call.args
            and _root_name(call.args[0]) in unchanged):
          return _changed(_root_name(call.args[0]))
    elif isinstance(node, ast.Attribute):
      if why := _attribute_refusal(node.attr):
        return why
      if isinstance(node.ctx, (ast.Store, ast.Del)) and _root_name(node.value) in unchanged:
        return _changed(_root_name(node.value))
    elif isinstance(node, ast.MatchClass):
      for name in node.kwd_attrs:
        if why := _attribute_refusal(name):
          return why
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      modules = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                 else [alias.name for alias in node.names])
      for module in modules:
        if module.split(".")[0] in FORBIDDEN_MODULES:
          return f"the module {module!r} is not allowed (it reaches the interpreter's internals)"
      for alias in node.names:
        if alias.name == "*":
          return "`from ... import *` is not allowed: import the names you use"
        if alias.name in FORBIDDEN_NAMES:
          return f"{alias.name!r} is not allowed (it reaches the interpreter's internals)"
        if _attribute_refusal(alias.name.rsplit(".", 1)[-1]):
          what = "module" if isinstance(node, ast.Import) else "name"
          return (f"importing the {what} {alias.name!r} is not allowed (it reaches the "
                  "interpreter's internals)")
  return None
