"""The world state an episode saved, checked before AppWorld's evaluator replays it.

AppWorld scores an episode by executing every `[sql, params, executemany]` line of
`<task outputs>/dbs/<app>.jsonl` on a raw SQLite connection. Those files lie where the
episode's code may write, and that code can reach the AppWorld object and stop its saves,
so their lines are the agent's to choose: `ATTACH DATABASE` alone would let them create or
change SQLite files anywhere the evaluating process may write. The evaluation therefore
replays a private copy holding only lines in the forms AppWorld's own saves write (the ORM's
INSERT of one row, UPDATE and DELETE of one row by id, and the same on its full-text-search
tables), read once from the episode's files, so that nothing written later reaches it.
"""

import json
import os
import re
import stat

# An identifier as SQLAlchemy writes it: bare, or double-quoted when it is a keyword.
_NAME = r'(?:[A-Za-z_]\w*|"[A-Za-z_]\w*")'
_ROW = rf"(?:{_NAME}\.)?id = \?"
_FORMS = (
  re.compile(rf"INSERT INTO (?P<table>{_NAME}) \((?P<columns>{_NAME}(?:, {_NAME})*)\) "
             rf"VALUES \(\?(?:, \?)*\)"),
  re.compile(rf"UPDATE (?P<table>{_NAME}) SET {_NAME} ?= ?\?(?:, {_NAME} ?= ?\?)* WHERE {_ROW}"),
  re.compile(rf"DELETE FROM (?P<table>{_NAME}) WHERE {_ROW}"),
)
_INT64 = range(-2**63, 2**63)
HASHES = "model_hashes.json"  # which models each app changed; AppWorld writes it beside the logs


class RefusedState(Exception):
  """The saved state cannot be scored because of what the episode wrote: its code forged
  the files, or made a state that does not replay. A failure of the agent, not of the
  environment."""


def _scalar(value) -> bool:
  if isinstance(value, int):  # bool included
    return value in _INT64
  if isinstance(value, float):
    return value == value and abs(value) != float("inf")
  return value is None or isinstance(value, str)


def check_line(line: object) -> str:
  """Raises RefusedState unless `line` is a change in a form AppWorld writes; returns its
  statement."""
  if not (isinstance(line, list) and len(line) == 3 and isinstance(line[0], str)
          and isinstance(line[1], list) and isinstance(line[2], bool)):
    raise RefusedState("a line that is not [statement, parameters, executemany]")
  statement, parameters, executemany = line
  match = next((m for m in (f.fullmatch(statement) for f in _FORMS) if m), None)
  if match is None or match["table"].strip('"').lower().startswith("sqlite_"):
    raise RefusedState(f"a statement AppWorld does not write: {statement[:100]!r}")
  placeholders = statement.count("?")
  columns = match.groupdict().get("columns")
  if columns is not None and len(columns.split(", ")) != placeholders:
    raise RefusedState(f"columns and values differ in number: {statement[:100]!r}")
  rows = parameters if executemany else [parameters]
  if not rows or not all(isinstance(r, list) and len(r) == placeholders
                         and all(_scalar(v) for v in r) for r in rows):
    raise RefusedState(f"parameters that do not fit the statement: {statement[:100]!r}")
  return statement


def _read(directory_fd: int, name: str) -> bytes | None:
  """The bytes of regular file `name`, without following links; None when missing."""
  try:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory_fd)
  except FileNotFoundError:
    return None
  except OSError as e:  # a link (ELOOP) or a fifo that would block, among others
    raise RefusedState(f"{name} cannot be read as a file ({e.strerror})") from e
  with os.fdopen(fd, "rb") as f:
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
      raise RefusedState(f"{name} is not a regular file")
    return f.read()


def _changes(name: str, data: bytes) -> str:
  lines = []
  for number, text in enumerate(data.splitlines(), 1):
    if not text.strip():
      continue
    try:
      line = json.loads(text)
      check_line(line)
    except (ValueError, RecursionError, RefusedState) as e:  # nesting too deep to parse
      raise RefusedState(f"{name} line {number}: {e}") from e
    lines.append(json.dumps(line, allow_nan=False) + "\n")
  return "".join(lines)


def _hashes(data: bytes) -> str:
  try:
    hashes = json.loads(data)
  except (ValueError, RecursionError) as e:
    raise RefusedState(f"{HASHES} is not JSON") from e
  if not (isinstance(hashes, dict) and all(
      isinstance(models, dict) and all(isinstance(h, int) and h in _INT64
                                       for h in models.values())
      for models in hashes.values())):
    raise RefusedState(f"{HASHES} is not a map of apps to model hashes")
  return json.dumps(hashes)


def copy_checked(source: str, target: str, apps: list[str]) -> None:
  """Copies the saved state of directory `source` (each app's changes and the model hashes)
  to `target`, reading each file once; raises RefusedState at the first line or file
  AppWorld would not have written. Other files there are never read."""
  try:
    directory_fd = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
  except OSError as e:
    raise RefusedState(f"the saved DBs directory cannot be opened ({e.strerror})") from e
  try:
    checked = {}
    for name in [f"{app}.jsonl" for app in apps] + [HASHES]:
      data = _read(directory_fd, name)
      if data is not None:
        checked[name] = _hashes(data) if name == HASHES else _changes(name, data)
  finally:
    os.close(directory_fd)
  os.makedirs(target, exist_ok=True)
  for name, text in checked.items():
    with open(os.path.join(target, name), "w") as f:
      f.write(text)
