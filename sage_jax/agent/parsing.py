"""Code extraction from a model response.

The agent answers with Python in fenced blocks (```python ... ```). Every Python block of a
response is run, joined in order; untagged blocks count only in a response without a Python
block (beside one, an untagged block is most often an output the model imagined, which would
stop the real code with a SyntaxError). A last block left open (the turn hit its token limit)
is taken up to the end of the text. A fence line that names a language inside a block closes
it and opens the next. Blocks are dedented (a fence inside a list item is indented) and line
ends normalised. A response without any code block has no code: the turn ends with a format
error observation.
"""

from __future__ import annotations

import dataclasses
import re
import textwrap

# An opening fence: ``` followed by an optional language tag and the rest of its line (an
# info string such as `title="x"`).
_OPEN = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n")
# A fence line (it may be indented): a closing fence, or with a tag, the next block's opening.
_FENCE = re.compile(r"^[ \t]*```([A-Za-z0-9_+-]*)", re.MULTILINE)
_PYTHON_LANGS = ("python", "py", "python3")


@dataclasses.dataclass(frozen=True)
class ParsedResponse:
  code: str | None  # None when the response holds no code block
  num_blocks: int
  unclosed: bool  # the last block run had no closing fence


def extract_code(text: str) -> ParsedResponse:
  """The code of every Python fenced block in `text` (else of every untagged one), joined."""
  text = text.replace("\r\n", "\n")
  blocks: dict[bool, list[tuple[str, bool]]] = {True: [], False: []}  # tagged?: (code, open)
  pos = 0
  while (m := _OPEN.search(text, pos)) is not None:
    fence = _FENCE.search(text, m.end())
    body = text[m.end():fence.start()] if fence else text[m.end():]
    tag = m.group(1).lower()
    if (tag in _PYTHON_LANGS or not tag) and body.strip():
      blocks[bool(tag)].append((textwrap.dedent(body).rstrip(), fence is None))
    if fence is None:
      break
    pos = fence.start() if fence.group(1) else fence.end()
  chosen = blocks[True] or blocks[False]
  if not chosen:
    return ParsedResponse(code=None, num_blocks=0, unclosed=False)
  return ParsedResponse(code="\n\n".join(code for code, _ in chosen) + "\n",
                        num_blocks=len(chosen), unclosed=chosen[-1][1])
