"""Expert turns in the skill-library format, from AppWorld gold solutions; the scripted policy.

Two forms of gold solution are understood:

- The mini world's: a parameterised top-level function (the scenario's procedure), then a
  call with the task's arguments and `complete_task`.
- AppWorld's official form: `ground_truth/compiled_solution.py`, `def solution(apis,
  requester): ...` with the task's values written inside and `complete_task` at its end,
  called by AppWorld's own verifier as `solution(apis, requester)` (the `solution.py` beside
  it is the task generator's program, which needs the generator's inputs and packages). The
  expert turns it into a skill (`official_skill`): the values that change between the tasks
  of the scenario (the sibling solutions of the same structure; in an f-string, the part of
  its text that changes), or else the values that appear in the task instruction, become
  parameters; the name comes from the instruction's words shared by the scenario's tasks;
  the file's helper functions, classes and constants that it reads travel with it. A
  `solution.py` alone is refused (`read_solution`).

The expert then writes the agent's format: when the library the task sees has no such
function (or a different one under that name), one turn defines the function (with a
docstring) and calls it (skill generation, or update); when it has, the turn only calls the
library function (skill use). A solution without top-level functions is replayed as it is.

`expert_turns` is also what the SFT expert-trajectory builder reuses; `ScriptedPolicy` plays
the turns through the same agent, rollout and evaluation code as a model.
"""

from __future__ import annotations

import ast
import builtins
import collections
import copy
import dataclasses
import json
import keyword
import os
import re
import symtable
from collections.abc import Iterable, Mapping

import numpy as np

from sage_jax.agent.config import AgentConfig
from sage_jax.agent.policy import PolicyTurn, TaskContext, TurnRequest
from sage_jax.agent.skills import module_scope_bindings, source_lines
from sage_jax.tokenizer import Tokenizer


def _sentence(name: str) -> str:
  words = [w for w in re.split(r"_+", name) if w]
  text = " ".join(words) or name
  return text[0].upper() + text[1:] + "."


def _arg_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
  return [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]


def default_docstring(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
  """A generic docstring from the function's name and parameters."""
  params = _arg_names(node)
  doc = _sentence(node.name)
  if params:
    doc += "\n\nArgs:\n" + "\n".join(f"    {p}: the {p.replace('_', ' ')}." for p in params)
  return doc


def with_docstrings(source: str) -> str:
  """`source` with a docstring added to every top-level function that has none."""
  tree = ast.parse(source)
  lines = source_lines(source, keepends=False)
  # Insert bottom-up so earlier line numbers stay valid.
  for node in reversed(tree.body):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node):
      continue
    first = node.body[0]
    indent = " " * first.col_offset
    if first.lineno == node.lineno:  # `def f(): return 1` on one line: leave it
      continue
    doc = default_docstring(node).replace("\n", "\n" + indent).replace(indent + "\n", "\n")
    doc_lines = f'{indent}"""{doc}\n{indent}"""'.splitlines()
    doc_lines = [l if l.strip() else "" for l in doc_lines]
    lines[first.lineno - 1:first.lineno - 1] = doc_lines
  return "\n".join(lines) + "\n"


def split_solution(source: str) -> tuple[list[str], str, list[str]]:
  """(top-level function sources, the remaining statements, the function names)."""
  tree = ast.parse(source)
  lines = source_lines(source, keepends=False)
  functions, names, rest = [], [], []
  for node in tree.body:
    start = (node.decorator_list[0].lineno if getattr(node, "decorator_list", None)
             else node.lineno)
    text = "\n".join(lines[start - 1:node.end_lineno])
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      functions.append(text)
      names.append(node.name)
    else:
      rest.append(text)
  return functions, "\n".join(rest).strip() + "\n", names


# --- AppWorld's official form ---------------------------------------------------------------

OFFICIAL_ENTRY = "solution"
OFFICIAL_ARGS = ("apis", "requester")  # globals of every AppWorld world
_STOPWORDS = frozenset(
    "a an the my me i of to in into on for from and or with by at as is are be it its this "
    "that all any e g eg please".split())
MAX_NAME_WORDS = 6
_BUILTIN_NAMES = frozenset(dir(builtins))


def _parse(source: str) -> ast.Module | None:
  try:
    return ast.parse(source)
  except SyntaxError:
    return None


def _uncalled_entries(tree: ast.Module) -> list[ast.FunctionDef]:
  """The module's top-level `def solution`s when nothing in it calls `solution` (what
  AppWorld calls itself: its compiled solutions and its generator programs), else none."""
  calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call)
           and isinstance(n.func, ast.Name)}
  if OFFICIAL_ENTRY in calls:
    return []
  return [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == OFFICIAL_ENTRY]


def _official_entry(tree: ast.Module) -> ast.FunctionDef | None:
  defs = _uncalled_entries(tree)
  if len(defs) != 1:
    return None
  fn = defs[0]
  if not set(_arg_names(fn)) <= set(OFFICIAL_ARGS) or fn.args.vararg or fn.args.kwarg:
    return None
  return fn


def official_function(source: str) -> ast.FunctionDef | None:
  """`def solution(apis, requester)` when `source` is in the official form (the function and
  nothing that calls it), else None."""
  tree = _parse(source)
  return None if tree is None else _official_entry(tree)


def _format_specs(fn: ast.FunctionDef) -> set[int]:
  """ids of the format specs of the function's f-strings (`f"{x:.2f}"`'s ".2f")."""
  return {id(n.format_spec) for n in ast.walk(fn)
          if isinstance(n, ast.FormattedValue) and n.format_spec is not None}


def _constants(fn: ast.FunctionDef) -> list[ast.Constant]:
  """String and number literals of the body that may become parameters, an f-string's text
  pieces among them (`_fstring_pieces`; not its format specs, nor docstrings), in a fixed
  walk order."""
  specs = _format_specs(fn)
  skip = {id(v) for n in ast.walk(fn) if id(n) in specs for v in ast.walk(n)}
  body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
  out = []
  for node in (n for stmt in body for n in ast.walk(stmt)):
    if (isinstance(node, ast.Constant) and id(node) not in skip
        and isinstance(node.value, (str, int, float)) and not isinstance(node.value, bool)):
      out.append(node)
  return out


def _fstring_pieces(fn: ast.FunctionDef) -> set[int]:
  """ids of the text pieces of the function's f-strings (format specs aside)."""
  specs = _format_specs(fn)
  return {id(v) for n in ast.walk(fn) if isinstance(n, ast.JoinedStr) and id(n) not in specs
          for v in n.values if isinstance(v, ast.Constant)}


def _word_cut(texts: list[str], length: int, from_end: bool = False) -> int:
  """`length` shortened until cutting every text that far from its start (or end) splits no
  word: the part the texts share, up to a word boundary."""
  def splits(text: str, k: int) -> bool:
    i = len(text) - k if from_end else k
    return 0 < i < len(text) and text[i - 1].isalnum() and text[i].isalnum()
  while length and any(splits(t, length) for t in texts):
    length -= 1
  return length


def _varying_part(texts: list[str]) -> tuple[int, int]:
  """(start, end offset from the end) of the part that differs between `texts` (an f-string
  piece of sibling tasks: "~/vacations/Petra/", "~/vacations/Rome/"): what they all begin and
  end with, cut at word boundaries, is left out."""
  start = _word_cut(texts, len(os.path.commonprefix(texts)))
  shortest = min(len(t) for t in texts) - start
  end = _word_cut(texts, min(shortest, len(os.path.commonprefix([t[::-1] for t in texts]))),
                  from_end=True)
  return start, end


def _data_keys(fn: ast.FunctionDef) -> set[str]:
  """The strings the function reads data fields by: subscript keys (`profile["message"]`) and
  the first argument of `.get`, `.pop` and `.setdefault`."""
  keys = set()
  for node in ast.walk(fn):
    key = (node.slice if isinstance(node, ast.Subscript) else
           node.args[0] if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                            and node.func.attr in ("get", "pop", "setdefault") and node.args)
           else None)
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
      keys.add(key.value)
  return keys


def _masked(fn: ast.FunctionDef) -> str:
  """The function's structure with its literals blanked (same for sibling tasks' solutions
  written from one template)."""
  fn = copy.deepcopy(fn)
  for c in _constants(fn):
    c.value = None
  return ast.dump(fn)


def _words(text: str) -> str:
  return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def _in_instruction(value: str | int | float, instruction: str) -> bool:
  """Whether the instruction states `value`: a string as written, or (3 characters or more)
  in other case and punctuation ("Go to sleep" in "my go-to-sleep alarm"); a number in one of
  its usual spellings."""
  if isinstance(value, str):
    if len(value.strip()) < 2:
      return False
    if re.search(rf"(?<!\w){re.escape(value)}(?!\w)", instruction):
      return True
    return len(value.strip()) >= 3 and bool(_words(value)) and (
        f" {_words(value)} " in f" {_words(instruction)} ")
  texts = {str(value), f"{value:g}", f"{value:.2f}"}
  return (abs(value) >= 2 or value != int(value)) and any(
      re.search(rf"(?<![\w.]){re.escape(t)}(?![\w]|\.\d)", instruction) for t in texts)


def _parameter_name(node: ast.Constant, parents: dict[int, ast.AST], taken: set[str],
                    bound_once: set[str]) -> str:
  """A name from where the value stands: `f(title=...)`, `x = ...`, `d["title"] == ...`.
  `x = <value>` where that statement alone binds `x` (`bound_once`) makes `x` itself the
  parameter (the assignment, then `x = x`, is dropped)."""
  parent = parents.get(id(node))
  name = "value"
  if isinstance(parent, ast.keyword) and parent.arg:
    name = parent.arg
  elif (isinstance(parent, ast.Assign) and len(parent.targets) == 1
        and isinstance(parent.targets[0], ast.Name)):
    name = parent.targets[0].id
    if name in bound_once:
      bound_once.discard(name)
      taken.add(name)
      return name
  elif isinstance(parent, ast.Compare):
    other = parent.left
    if (isinstance(other, ast.Subscript) and isinstance(other.slice, ast.Constant)
        and isinstance(other.slice.value, str) and other.slice.value.isidentifier()):
      name = other.slice.value
  base, i = name, 2
  while name in taken or keyword.iskeyword(name):
    name, i = f"{base}_{i}", i + 1
  taken.add(name)
  return name


def _skill_name(instruction: str, siblings: Iterable[str], values: Iterable,
                reserved: set[str]) -> str:
  """Words of the instruction shared by every sibling instruction (the scenario's template),
  minus the task's values and stopwords, as a snake_case name. The words keep the order of
  one of the instructions, the same for every task of the scenario, so that siblings phrased
  in another order name the same skill. A name that is a keyword, a builtin or one of
  `reserved` (the names the skill's file binds or reads) gets a suffix: defined, it would be
  a syntax error or hide what it names."""
  siblings = list(siblings)
  text = instruction
  for v in values:
    text = text.replace(str(v), " ")
  words = lambda t: re.findall(r"[a-z]+", t.lower())
  shared = set(words(instruction))
  for other in siblings:
    shared &= set(words(other))
  picked: list[str] = []
  for w in words(text):
    if w in shared and w not in _STOPWORDS and w not in picked:
      picked.append(w)
  picked.sort(key=words(min([instruction, *siblings])).index)
  name = "_".join(picked[:MAX_NAME_WORDS]) or "solve_task"
  if keyword.iskeyword(name) or name in _BUILTIN_NAMES or name in reserved:
    name += "_task"
  return name


def _assigned_once(fn: ast.FunctionDef) -> set[str]:
  """Names that one statement of the function's own body, `x = ...`, binds, and that nothing
  else in it binds or declares global or nonlocal, nested scopes included: such an `x` can be
  the parameter itself, its assignment dropped (not one bound in a nested function)."""
  stores = collections.Counter(n.id for n in ast.walk(fn) if isinstance(n, ast.Name)
                               and isinstance(n.ctx, (ast.Store, ast.Del)))
  declared = {name for n in ast.walk(fn) if isinstance(n, (ast.Global, ast.Nonlocal))
              for name in n.names}
  return {st.targets[0].id for st in fn.body
          if isinstance(st, ast.Assign) and len(st.targets) == 1
          and isinstance(st.targets[0], ast.Name) and stores[st.targets[0].id] == 1
          } - declared - set(OFFICIAL_ARGS)


def _read_names(node: ast.AST) -> set[str]:
  return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _module_reads(node: ast.stmt) -> set[str]:
  """The module-scope names a top-level statement reads when it runs or is called: not the
  locals of its functions (a skill's local `result` does not need a top-level `result`)."""
  def reads(table: symtable.SymbolTable) -> set[str]:
    module = table.get_type() == "module"
    own = {sym.get_name() for sym in table.get_symbols()
           if sym.is_referenced() and (module or sym.is_global())}
    return own.union(*(reads(child) for child in table.get_children()))
  return reads(symtable.symtable(ast.unparse(node), "<solution>", "exec"))


def _module_text(statements: list[ast.stmt]) -> str:
  """Top-level statements as source, with two blank lines around each definition."""
  text = ""
  for i, node in enumerate(statements):
    definition = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    if i:
      text += "\n\n\n" if definition or previous else "\n"
    text += ast.unparse(node)
    previous = definition
  return text


def _supporting(module: ast.Module, entry: ast.FunctionDef, reads: set[str]) -> list[ast.stmt]:
  """The module's other top-level statements (helper functions, classes, constants; not its
  imports) that bind a name `reads` needs, with those they need in turn, in source order."""
  candidates = [n for n in module.body
                if n is not entry and not isinstance(n, (ast.Import, ast.ImportFrom))]
  needed: set[int] = set()
  frontier = set(reads)
  while frontier:
    found = [n for n in candidates if id(n) not in needed and module_scope_bindings(n) & frontier]
    needed |= {id(n) for n in found}
    frontier = set().union(*(_module_reads(n) for n in found))
  return [n for n in candidates if id(n) in needed]


def official_skill(solution: str, instruction: str,
                   siblings: Iterable[tuple[str, str]] = ()) -> tuple[str, str, str] | None:
  """(name, definition, call) of an official-form gold solution rewritten as a skill, or
  None when `solution` is not in that form. `siblings`: (solution, instruction) of the
  scenario's other tasks."""
  module = _parse(solution)
  fn = None if module is None else _official_entry(module)
  if fn is None:
    return None
  siblings = list(siblings)
  constants = _constants(fn)
  pieces = _fstring_pieces(fn)
  same_shape = [f for s, _ in siblings if (f := official_function(s)) is not None
                and _masked(f) == _masked(fn)]
  parents = {id(child): node for node in ast.walk(fn) for child in ast.iter_child_nodes(node)}
  # An f-string piece's parameter is the part of it that is the task's (`cuts`: what is left
  # at its start and end): "Petra" of f"~/vacations/Petra/{name}".
  cuts: dict[int, tuple[int, int]] = {}
  if same_shape:  # what changes between the scenario's tasks is a parameter
    others = [_constants(f) for f in same_shape]
    varying = {i for other in others for i, (a, b) in enumerate(zip(constants, other))
               if a.value != b.value}
    chosen = [c for i, c in enumerate(constants) if i in varying]
    cuts = {id(constants[i]): _varying_part([constants[i].value, *(o[i].value for o in others)])
            for i in varying if id(constants[i]) in pieces}
  else:
    # A key (`passwords["phone"]`, `song["title"]`, `"message" in profile` beside
    # `profile["message"]`) names a field of the data, not a value of the task, even where
    # the instruction says the word. f-string pieces stay as written.
    keys = _data_keys(fn)
    chosen = [c for c in constants if id(c) not in pieces and c.value not in keys
              and _in_instruction(c.value, instruction)]

  def value(c: ast.Constant) -> str | int | float:
    if id(c) not in cuts:
      return c.value
    start, end = cuts[id(c)]
    return c.value[start:len(c.value) - end]

  reserved = (_read_names(fn) | set(OFFICIAL_ARGS)
              | set().union(*(module_scope_bindings(n) for n in module.body)))
  taken = set(reserved)
  bound_once = _assigned_once(fn)
  params: dict[tuple[type, object], str] = {}
  key = lambda c: (type(value(c)), value(c))
  for c in chosen:
    if key(c) not in params:
      params[key(c)] = _parameter_name(c, parents, taken, bound_once)
  name = _skill_name(instruction, [i for _, i in siblings], [v for _, v in params], reserved)
  new = copy.deepcopy(fn)
  chosen_ids = {id(c) for c in chosen}
  originals = {id(n): old for n, old in zip(_constants(new), constants) if id(old) in chosen_ids}

  class Substitute(ast.NodeTransformer):
    def visit_Constant(self, node):  # noqa: N802 - ast's name
      if id(node) not in originals:
        return node
      return ast.copy_location(ast.Name(params[key(originals[id(node)])], ast.Load()), node)

    def visit_JoinedStr(self, node):  # noqa: N802 - ast's name
      parts = []
      for piece in node.values:
        old = originals.get(id(piece))
        if old is None:
          parts.append(self.visit(piece))
          continue
        start, end = cuts[id(old)]
        text = old.value
        parts += [ast.Constant(text[:start])] if start else []
        parts.append(ast.FormattedValue(ast.Name(params[key(old)], ast.Load()), -1, None))
        parts += [ast.Constant(text[len(text) - end:])] if end else []
      node.values = parts
      return node

  new = Substitute().visit(new)
  new.body = [st for st in new.body if not (  # `x = x`: x is the parameter now
      isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.value, ast.Name)
      and isinstance(st.targets[0], ast.Name) and st.targets[0].id == st.value.id)] or [
          ast.Pass()]
  new.name = name
  new.args = ast.arguments(posonlyargs=[], args=[ast.arg(p) for p in params.values()],
                           kwonlyargs=[], kw_defaults=[], defaults=[])
  new.returns = None  # the entry's annotations name AppWorld's classes, not the skill's
  # What the skill reads of the solution file travels with it, in the file's order: its
  # helper functions, classes and constants, and the imports these or the skill read; the
  # imports of the entry's type annotations (AppWorld's own classes) do not.
  support = _supporting(module, fn, _module_reads(new))
  read = set().union(_module_reads(new), *(_module_reads(n) for n in support))
  imports = [n for n in module.body if isinstance(n, (ast.Import, ast.ImportFrom))
             and any((a.asname or a.name).split(".")[0] in read for a in n.names)]
  definition = _module_text([*imports, *support, ast.fix_missing_locations(new)])
  call = f"{name}({', '.join(repr(v) for _, v in params)})"
  return name, definition, call


def _statements(source: str) -> set[str]:
  """The top-level statements of `source`, docstrings, layout and comments aside (none when
  it does not parse)."""
  try:
    tree = ast.parse(source)
  except SyntaxError:
    return set()
  for node in ast.walk(tree):
    if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and ast.get_docstring(node) is not None):
      node.body = node.body[1:]
  return {ast.dump(node) for node in tree.body}


def _installed(definition: str, codes: Mapping[str, str]) -> bool:
  """Whether the library's skills install `definition` as it is, docstrings and layout aside:
  the code of the skills named like what it binds (each one's imports and constants, then its
  function; a helper is a skill of its own) holds all its statements and none it lacks (a
  constant of another task's value)."""
  ours = _statements(definition)
  names = set().union(*(module_scope_bindings(n) for n in ast.parse(definition).body))
  theirs = [_statements(codes[n]) for n in names & codes.keys()]
  return all(t <= ours for t in theirs) and ours <= set().union(*theirs)


def expert_turns(solution: str, library: Iterable[str] | Mapping[str, str] = (), *,
                 instruction: str = "", siblings: Iterable[tuple[str, str]] = ()) -> list[str]:
  """The assistant turns (text) that solve a task in the skill format.

  `library`: the skills the task sees (names, or names -> code). Functions of the solution
  already there are called, the others are defined (with docstrings) and called. For an
  official-form solution, `instruction` and `siblings` ((solution, instruction) of the
  scenario's other tasks) decide its parameters and name (`official_skill`); a library skill
  of that name is called only when the library installs the same code, the constants and
  helpers it reads included (when its code is given).
  """
  codes = dict(library) if isinstance(library, Mapping) else {}
  known = set(library)
  official = official_skill(solution, instruction, siblings)
  if official is not None:
    name, definition, call = official
    if name in known and (name not in codes or _installed(definition, codes)):
      return [f"The library skill `{name}` fits this task, so I call it.\n\n"
              f"```python\n{call}\n```"]
    definition = with_docstrings(definition).strip()
    return [f"I write the skill `{name}` for this task and call it with the task's values."
            f"\n\n```python\n{definition}\n\n\n{call}\n```"]
  functions, call_code, names = split_solution(solution)
  if not functions:
    return [f"```python\n{solution.strip()}\n```"]
  missing = [(f, n) for f, n in zip(functions, names) if n not in known]
  if not missing:
    listed = ", ".join(f"`{n}`" for n in names)
    return [f"The library skill {listed} fits this task, so I call it.\n\n"
            f"```python\n{call_code.strip()}\n```"]
  definitions = with_docstrings("\n\n\n".join(f for f, _ in missing)).strip()
  new = ", ".join(f"`{n}`" for _, n in missing)
  return [f"I write the skill {new} for this task and call it with the task's arguments.\n\n"
          f"```python\n{definitions}\n\n\n{call_code.strip()}\n```"]


SOLUTION_FILES = ("compiled_solution.py", "solution.py")  # the first found is read
_CANARY = re.compile(r"^# Canary String:.*\n?", re.MULTILINE)


def _generator_inputs(source: str) -> list[str]:
  """The inputs beyond `apis` and `requester` that the `solution` function of `source` takes
  when nothing in `source` calls it (AppWorld's generator `solution.py`: `solution(main_user,
  apis, requester, public_data)`); else none."""
  tree = _parse(source)
  defs = [] if tree is None else _uncalled_entries(tree)
  return [a for a in _arg_names(defs[0]) if a not in OFFICIAL_ARGS] if defs else []


def read_solution(appworld_root: str, task_id: str) -> str:
  """A task's gold solution: AppWorld's `compiled_solution.py` (what its verifier runs) when
  there is one, else `solution.py` (the mini world's), without the benchmark's canary line
  (which marks text that must stay out of training data)."""
  truth = os.path.join(appworld_root, "data", "tasks", task_id, "ground_truth")
  for name in SOLUTION_FILES:
    path = os.path.join(truth, name)
    if os.path.exists(path):
      try:
        with open(path, encoding="utf-8") as f:
          source = _CANARY.sub("", f.read())
      except UnicodeDecodeError as e:
        raise ValueError(f"{path}: the gold solution is not UTF-8 text ({e})") from None
      inputs = _generator_inputs(source)
      if inputs:
        raise ValueError(
            f"{path} is AppWorld's task-generator program (its `{OFFICIAL_ENTRY}` takes "
            f"{', '.join(inputs)} and nothing calls it); the gold solution that AppWorld's "
            f"verifier runs is {SOLUTION_FILES[0]}, which this task lacks")
      return source
  raise FileNotFoundError(f"{truth}: no gold solution ({' or '.join(SOLUTION_FILES)}); the "
                          f"test splits of AppWorld ship none")


def read_instruction(appworld_root: str, task_id: str) -> str:
  path = os.path.join(appworld_root, "data", "tasks", task_id, "specs.json")
  try:
    with open(path, encoding="utf-8") as f:
      instruction = json.load(f)["instruction"]
  except (ValueError, KeyError, TypeError) as e:  # ValueError: bad JSON or UTF-8
    raise ValueError(f"{path}: not a task spec with an instruction "
                     f"({type(e).__name__}: {e})") from None
  if not isinstance(instruction, str):
    raise ValueError(f"{path}: the instruction is a {type(instruction).__name__}, not text")
  return instruction


def check_readable(appworld_root: str, task_ids: Iterable[str]) -> None:
  """Reads every task's gold solution and instruction and writes its expert turns as a play
  would: a missing or malformed file, or a solution that cannot be rewritten, fails here,
  naming it, before any task is played rather than partway through."""
  for task_id in task_ids:
    expert_turns_for_task(appworld_root, task_id)


def expert_turns_for_task(appworld_root: str, task_id: str,
                          library: Iterable[str] | Mapping[str, str] = ()) -> list[str]:
  """`expert_turns` of a task's gold solution (`<root>/data/tasks/<id>/ground_truth`); the
  scenario's other tasks on disk are its siblings."""
  scenario = task_id.rsplit("_", 1)[0]
  tasks = os.path.join(appworld_root, "data", "tasks")
  siblings = [(read_solution(appworld_root, t), read_instruction(appworld_root, t))
              for t in sorted(os.listdir(tasks))
              if t != task_id and t.rsplit("_", 1)[0] == scenario]
  solution = read_solution(appworld_root, task_id)
  instruction = read_instruction(appworld_root, task_id)
  try:
    return expert_turns(solution, library, instruction=instruction, siblings=siblings)
  except Exception as e:  # noqa: BLE001 - any failure of the rewriting, named by its task
    raise ValueError(f"task {task_id}: its gold solution could not be written as expert "
                     f"turns ({type(e).__name__}: {e})") from e


# The budgets a scripted play (gold or replayed turns) gets at least. Its turns are fixed,
# not sampled: cut by a run's budget (48 tokens a turn in the tests, 512 by default) a gold
# solution of real AppWorld size (often longer: the official form's imports and helpers)
# fails on the syntax error the cut leaves.
SCRIPTED_BUDGET_FLOORS = {"max_steps": 10, "max_turn_tokens": 4096, "max_episode_tokens": 32768}


def scripted_agent(agent: AgentConfig) -> AgentConfig:
  """The agent a scripted play runs as: `agent` (whose prompt SFT trains on) with budgets of
  at least `SCRIPTED_BUDGET_FLOORS`."""
  return dataclasses.replace(agent, **{key: max(getattr(agent, key), floor)
                                       for key, floor in SCRIPTED_BUDGET_FLOORS.items()})


class TextTurnsSession:
  """Plays fixed assistant turns as a policy session (logprobs zero); once they run out it
  completes the task, as the scripted expert does."""

  def __init__(self, turns: Iterable[str], tokenizer: Tokenizer):
    self._turns = list(turns)
    self._tok = tokenizer

  async def generate(self, request: TurnRequest) -> PolicyTurn:
    i = request.turn_index
    text = self._turns[i] if i < len(self._turns) else (
        "```python\napis.supervisor.complete_task()\n```")
    ids = self._tok.encode(text) + [self._tok.eos_id]
    reason = "eos"
    budget = min(request.max_new_tokens, request.max_context - len(request.prompt_ids))
    if len(ids) > budget:
      ids, reason = ids[:max(budget, 0)], "max_new_tokens"
    zeros = np.zeros(len(ids), np.float32)
    return PolicyTurn(ids, zeros, zeros.copy(), reason)

  async def close(self) -> None:
    pass


class ScriptedPolicy:
  """Replays gold solutions in the skill format (logprobs zero). With `use_library=False`
  in the task's context (the GRPO baseline), or with `rewrite=True` (the library is shown
  but not used), it defines and calls the function every time."""

  def __init__(self, appworld_root: str, tokenizer: Tokenizer, rewrite: bool = False):
    self._root = appworld_root
    self._tok = tokenizer
    self._rewrite = rewrite

  def session(self, context: TaskContext) -> TextTurnsSession:
    use = context.use_library and not self._rewrite
    library = {s.name: s.code for s in context.skills} if use else {}
    return TextTurnsSession(expert_turns_for_task(self._root, context.task_id, library),
                            self._tok)
