"""Code extraction from a model response.

The agent answers with Python in fenced blocks (```python ... ```). Every block of a response
is run, joined in order; a last block left open (the turn hit its token limit) is taken up to
the end of the text. A response without any block has no code: the turn ends with a format
error observation.
"""

from __future__ import annotations

import dataclasses
import re

# An opening fence: ``` followed by an optional language tag, then the end of the line.
_OPEN = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n")
_CLOSE = re.compile(r"^[ \t]*```", re.MULTILINE)  # a closing fence starts a line
_CODE_LANGS = ("", "python", "py", "python3")


@dataclasses.dataclass(frozen=True)
class ParsedResponse:
  code: str | None  # None when the response holds no code block
  num_blocks: int
  unclosed: bool  # the last block had no closing fence


def extract_code(text: str) -> ParsedResponse:
  """The code of every Python (or untagged) fenced block in `text`, joined in order."""
  blocks, pos, unclosed = [], 0, False
  while (m := _OPEN.search(text, pos)) is not None:
    close = _CLOSE.search(text, m.end())
    body = text[m.end():close.start()] if close else text[m.end():]
    if m.group(1).lower() in _CODE_LANGS and body.strip():
      blocks.append(body.rstrip())
      unclosed = close is None
    if close is None:
      break
    pos = close.end()
  if not blocks:
    return ParsedResponse(code=None, num_blocks=0, unclosed=False)
  return ParsedResponse(code="\n\n".join(blocks) + "\n", num_blocks=len(blocks),
                        unclosed=unclosed)
