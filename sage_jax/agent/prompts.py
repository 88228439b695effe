"""The agent's prompt: system prompt (AppWorld setting, skill format, skill library), task
message, and the observations appended after each turn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sage_jax.agent.library import Skill

ENVIRONMENT = """\
You are an agent that completes tasks for your supervisor on their phone apps by writing \
Python code.

# Environment
- Each of your replies must contain Python code in a ```python block. It runs in a Python \
REPL and you see its output in the next message. Variables and functions persist between \
turns.
- Apps are reached only through `apis.<app>.<api>(...)` with keyword arguments, e.g. \
`apis.spotify.login(username=..., password=...)`.
- Find APIs with `apis.api_docs.show_api_descriptions(app_name="<app>")` and read one with \
`apis.api_docs.show_api_doc(app_name="<app>", api_name="<api>")`.
- `apis.supervisor.show_profile()` gives the supervisor's details and \
`apis.supervisor.show_account_passwords()` their app passwords; most apps need \
`apis.<app>.login(...)` and an `access_token` argument.
- Listings are paginated: pass `page_index` (and `page_limit`, at most 20) and loop until \
a page comes back empty.
- Do not guess values; look them up. Print what you need to see.
- When the task is done, call `apis.supervisor.complete_task()`. If the task asks a \
question, call `apis.supervisor.complete_task(answer=<the answer>)` with the answer only \
(a number or a short string).
"""

SKILL_FORMAT = """
# Skills
Solve a task by writing a skill: a Python function with parameters and a docstring that \
performs the whole procedure, with nothing specific to this task hard-coded (pass names, \
amounts, titles and other details as arguments). Define it and call it with this task's \
arguments in the same code block, then complete the task.
- If a skill in the library below fits the task, call it instead of writing new code.
- If a library skill fails, fix it by redefining it with the same name, then call it again.
- Skills whose code runs without error are saved to the library for later tasks.
"""

LIBRARY_HEADER = """
# Skill library
These functions are already defined in your environment:
"""

EMPTY_LIBRARY = "\n# Skill library\nThe library is empty.\n"

FORMAT_ERROR = ("Format error: your reply has no ```python code block, so nothing ran. Reply "
                "with Python code in a ```python block.")


def skill_listing(skills: Sequence[Skill], max_chars: int) -> str:
  """Signature and docstring of each skill (its code is in the world), cut at max_chars."""
  parts, used = [], 0
  for skill in skills:
    doc = skill.docstring.strip()
    if doc:
      lines = doc.splitlines()
      body = "\n".join(("    " + l).rstrip() for l in lines).lstrip()
      body = '    """' + body + ('\n    """\n' if len(lines) > 1 else '"""\n')
    else:
      body = "    ...\n"
    head = skill.signature  # "name(args)", or "async name(args)"
    head = f"async def {head[6:]}" if head.startswith("async ") else f"def {head}"
    part = f"{head}:\n{body}"
    if used + len(part) > max_chars and parts:
      parts.append(f"# ... {len(skills) - len(parts)} more skills not shown\n")
      break
    parts.append(part)
    used += len(part)
  return "```python\n" + "\n".join(parts) + "```\n"


def system_prompt(skills: Sequence[Skill] | None, max_library_chars: int = 6000) -> str:
  """The system prompt; `skills=None` gives the plain code agent (no skill library)."""
  if skills is None:
    return ENVIRONMENT
  library = (LIBRARY_HEADER + skill_listing(skills, max_library_chars) if skills
             else EMPTY_LIBRARY)
  return ENVIRONMENT + SKILL_FORMAT + library


def task_message(instruction: str, supervisor: Mapping[str, str], datetime: str,
                 app_descriptions: Mapping[str, str]) -> str:
  apps = ", ".join(name for name in app_descriptions if name not in ("api_docs", "supervisor"))
  name = f"{supervisor.get('first_name', '')} {supervisor.get('last_name', '')}".strip()
  return (f"Supervisor: {name} (email {supervisor.get('email', '?')}, phone "
          f"{supervisor.get('phone_number', '?')}). Current time: {datetime}.\n"
          f"Apps: {apps}.\n\nTask: {instruction}")


def observation(output: str, max_chars: int) -> str:
  """An execution output as the agent reads it (cut to max_chars)."""
  if len(output) > max_chars:
    output = output[:max_chars] + f"\n[... {len(output) - max_chars} more characters cut]"
  return f"Output:\n```\n{output.rstrip()}\n```"


def library_install_failure(output: str, max_chars: int) -> str:
  """Told in the task message when the library code itself failed to install."""
  return ("\n\nNote: installing the skill library failed, some skills may be undefined:\n"
          + observation(output, max_chars))
