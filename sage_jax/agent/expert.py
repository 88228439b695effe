"""Expert turns in the skill-library format, from AppWorld gold solutions; the scripted policy.

A gold solution of the mini world is a parameterised top-level function (the scenario's
procedure), then a call with the task's arguments and `complete_task`. The expert rewrites
it into the agent's format: when the library the task sees has no function of that name, one
turn defines the function (with a docstring) and calls it (skill generation); when it has,
the turn only calls the library function (skill use). A solution without top-level functions
(e.g. official AppWorld solutions written as straight-line code) is replayed as it is.

`expert_turns` is also what the SFT expert-trajectory builder reuses; `ScriptedPolicy` plays
the turns through the same agent, rollout and evaluation code as a model.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterable

import numpy as np

from sage_jax.agent.policy import PolicyTurn, TaskContext, TurnRequest
from sage_jax.tokenizer import Tokenizer


def _sentence(name: str) -> str:
  words = [w for w in re.split(r"_+", name) if w]
  text = " ".join(words) or name
  return text[0].upper() + text[1:] + "."


def default_docstring(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
  """A generic docstring from the function's name and parameters."""
  params = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
  doc = _sentence(node.name)
  if params:
    doc += "\n\nArgs:\n" + "\n".join(f"    {p}: the {p.replace('_', ' ')}." for p in params)
  return doc


def with_docstrings(source: str) -> str:
  """`source` with a docstring added to every top-level function that has none."""
  tree = ast.parse(source)
  lines = source.splitlines()
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
  lines = source.splitlines()
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


def expert_turns(solution: str, library_names: Iterable[str] = ()) -> list[str]:
  """The assistant turns (text) that solve a task in the skill format.

  `library_names`: the skills the task sees. Functions of the solution already there are
  called, the others are defined (with docstrings) and called.
  """
  functions, call_code, names = split_solution(solution)
  if not functions:
    return [f"```python\n{solution.strip()}\n```"]
  library = set(library_names)
  missing = [(f, n) for f, n in zip(functions, names) if n not in library]
  if not missing:
    listed = ", ".join(f"`{n}`" for n in names)
    return [f"The library skill {listed} fits this task, so I call it.\n\n"
            f"```python\n{call_code.strip()}\n```"]
  definitions = with_docstrings("\n\n\n".join(f for f, _ in missing)).strip()
  new = ", ".join(f"`{n}`" for _, n in missing)
  return [f"I write the skill {new} for this task and call it with the task's arguments.\n\n"
          f"```python\n{definitions}\n\n\n{call_code.strip()}\n```"]


def read_solution(appworld_root: str, task_id: str) -> str:
  path = os.path.join(appworld_root, "data", "tasks", task_id, "ground_truth", "solution.py")
  with open(path) as f:
    return f.read()


def expert_turns_for_task(appworld_root: str, task_id: str,
                          library_names: Iterable[str] = ()) -> list[str]:
  """`expert_turns` of a task's gold solution (`<root>/data/tasks/<id>/ground_truth`)."""
  return expert_turns(read_solution(appworld_root, task_id), library_names)


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
  in the task's context (the GRPO baseline) it defines and calls the function every time."""

  def __init__(self, appworld_root: str, tokenizer: Tokenizer):
    self._root = appworld_root
    self._tok = tokenizer

  def session(self, context: TaskContext) -> TextTurnsSession:
    names = [s.name for s in context.skills] if context.use_library else []
    return TextTurnsSession(expert_turns_for_task(self._root, context.task_id, names), self._tok)
