"""The skill library: per rollout (or per evaluation run), keyed by scenario.

A skill is a saved module-scope function (dedented when the task defined it inside an `if` or
a `try`): its code (with the imports and literal constants it reads from the task that
defined it), signature, docstring, the task that last saved it, the skills it calls, and
usage statistics. Saving a function under an existing name of the scenario replaces it (an
update) and keeps its statistics; saving the same code again changes nothing but recency.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
from collections.abc import Iterable, Mapping

from sage_jax.agent.skills import FunctionInfo, source_lines, top_level_bindings


@dataclasses.dataclass
class Skill:
  name: str
  code: str  # installable source: imports, constants, then the definition
  signature: str
  docstring: str
  scenario: str
  source_task: str  # the task whose code saved this version
  source_instruction: str  # that task's instruction (query-based retrieval compares it)
  calls: tuple[str, ...] = ()  # plain names its body calls
  version: int = 1
  created_by: str = ""  # the task that first saved the name
  uses: int = 0  # tasks that used it
  successes: int = 0  # tasks that used it and succeeded

  @property
  def description(self) -> str:
    """Name, signature and docstring: what the prompt shows and skill embeddings see."""
    return f"{self.signature}\n{self.docstring}".strip()

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


class SkillLibrary:
  """Skills by scenario, then by name. Not thread-safe: one rollout owns one library."""

  def __init__(self, skills: Iterable[Skill] = ()):
    self._skills: dict[str, dict[str, Skill]] = {}
    for skill in skills:
      self._skills.setdefault(skill.scenario, {})[skill.name] = skill

  def __len__(self) -> int:
    return sum(len(s) for s in self._skills.values())

  def scenarios(self) -> list[str]:
    return list(self._skills)

  def skills(self, scenario: str | None = None) -> list[Skill]:
    """Every skill (or a scenario's), in saving order."""
    if scenario is not None:
      return list(self._skills.get(scenario, {}).values())
    return [s for by_name in self._skills.values() for s in by_name.values()]

  def get(self, scenario: str, name: str) -> Skill | None:
    return self._skills.get(scenario, {}).get(name)

  def save(self, functions: Mapping[str, FunctionInfo], *, scenario: str, task_id: str,
           instruction: str) -> list[Skill]:
    """Adds (or replaces) the scenario's skills with `functions`; returns the saved skills.
    A function whose code is the library version's (up to layout and comments) is that
    version again: it keeps the task that wrote it, so a later task that uses it credits
    its author, not the task that wrote the same code once more."""
    by_name = self._skills.setdefault(scenario, {})
    saved = []
    for name, f in functions.items():
      old = by_name.pop(name, None)  # re-inserted last: saving order = recency
      if old is not None and _same_code(old.code, f.code):
        by_name[name] = old
        saved.append(old)
        continue
      skill = Skill(name=name, code=f.code, signature=f.signature, docstring=f.docstring,
                    scenario=scenario, source_task=task_id, source_instruction=instruction,
                    calls=tuple(sorted(f.calls)), version=old.version + 1 if old else 1,
                    created_by=old.created_by if old else task_id,
                    uses=old.uses if old else 0, successes=old.successes if old else 0)
      by_name[name] = skill
      saved.append(skill)
    return saved

  def record_use(self, skills: Iterable[Skill], success: bool) -> None:
    for skill in skills:
      skill.uses += 1
      skill.successes += int(success)

  def with_dependencies(self, skills: Iterable[Skill]) -> list[Skill]:
    """`skills` plus the skills of their scenarios that they call, transitively."""
    out: dict[tuple[str, str], Skill] = {}
    stack = list(skills)
    while stack:
      skill = stack.pop(0)
      key = (skill.scenario, skill.name)
      if key in out:
        continue
      out[key] = skill
      stack.extend(dep for name in skill.calls
                   if (dep := self.get(skill.scenario, name)) is not None)
    return list(out.values())

  def copy(self) -> "SkillLibrary":
    return copy.deepcopy(self)

  def to_list(self) -> list[dict]:
    return [s.to_dict() for s in self.skills()]

  @classmethod
  def from_list(cls, items: Iterable[Mapping]) -> "SkillLibrary":
    return cls(Skill(**{**item, "calls": tuple(item.get("calls", ()))}) for item in items)


def _same_code(a: str, b: str) -> bool:
  try:
    return ast.dump(ast.parse(a)) == ast.dump(ast.parse(b))
  except (SyntaxError, ValueError):
    return a == b


def _carried(code: str) -> dict[str, tuple]:
  """The names `code`'s imports and literal constants bind at top level: name -> what it
  binds ("import", module) or ("from", module, name) for an import, ("constant", its
  statement) for a constant."""
  out = {}
  for name, binding in top_level_bindings(code):
    if binding.kind == "constant":
      out[name] = ("constant", binding.source)
    elif binding.kind == "import":
      statement = ast.parse(binding.source.strip()).body[0]
      for alias in statement.names:
        if (alias.asname or alias.name.split(".")[0]) != name:
          continue
        if isinstance(statement, ast.Import):
          if alias.asname or "." not in alias.name:  # else it binds a name no alias renames
            out[name] = ("import", alias.name)
        else:
          out[name] = ("from", "." * statement.level + (statement.module or ""), alias.name)
  return out


class _Rename(ast.NodeTransformer):
  def __init__(self, names: Mapping[str, str]):
    self.names = names

  def visit_Name(self, node: ast.Name) -> ast.Name:  # noqa: N802 - ast's name
    node.id = self.names.get(node.id, node.id)
    return node

  def visit_Global(self, node: ast.Global) -> ast.Global:  # noqa: N802 - ast's name
    node.names = [self.names.get(n, n) for n in node.names]
    return node

  def visit_alias(self, node: ast.alias) -> ast.alias:
    """An import's name: `import datetime` -> `import datetime as datetime__f` (`_carried`
    leaves out a dotted `import a.b`, which binds `a` and cannot be renamed so)."""
    bound = node.asname or node.name
    if bound in self.names:
      node.asname = self.names[bound]
    return node


def _without_future_imports(code: str) -> str:
  """`code` without its `from __future__` imports, which may only open a block (and which
  IPython would keep in force for the agent's later blocks)."""
  tree = ast.parse(code)
  drop = {row for node in tree.body if isinstance(node, ast.ImportFrom)
          and node.module == "__future__" for row in range(node.lineno - 1, node.end_lineno)}
  return "".join(line for row, line in enumerate(source_lines(code))
                 if row not in drop)


def install_code(skills: Iterable[Skill]) -> str | None:
  """One block that defines `skills` in a world; None if there are none.

  Each skill's code carries its imports and the literal constants it reads. Skills of the
  same name (from different scenarios) keep the first one given. All share one namespace:
  where a skill's import or constant would rebind a name that an earlier skill bound to
  something else (`import datetime` there, `from datetime import datetime` here; `LIMIT = 3`
  there, `LIMIT = 5` here), that skill's copy is renamed (`LIMIT` -> `LIMIT__<skill>`), so
  each reads its own.
  """
  bodies, names, bound = [], set(), {}
  for skill in skills:
    if skill.name in names:
      continue
    names.add(skill.name)
    code = _without_future_imports(skill.code).rstrip()
    own = _carried(code)
    clashes = {n: f"{n}__{skill.name}" for n, meaning in own.items()
               if bound.get(n, meaning) != meaning}
    if clashes:
      code = ast.unparse(_Rename(clashes).visit(ast.parse(code)))
      own = _carried(code)
    bound.update(own)
    bodies.append(code)
  return "\n\n\n".join(bodies) + "\n" if bodies else None
