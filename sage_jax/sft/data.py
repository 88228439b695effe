"""Expert trajectories: the JSONL format, validation, and tokenisation for SFT.

Format: one JSON object per line.

  {"id": "<unique id, e.g. the task id>",
   "messages": [{"role": "system", "content": "..."},
                {"role": "user", "content": "<task message>"},
                {"role": "assistant", "content": "<text the model writes, code in ```python```>"},
                {"role": "tool", "content": "<execution output shown to the model>"},
                {"role": "assistant", "content": "..."}, ...],
   "metadata": {...}}            # optional, free-form (task id, scenario, source, ...)

- The first message is the system prompt (the skill-library prompt of `sage_jax.agent.prompts`
  for SAGE); then "user" (the task), "assistant" (the model's turns) and "tool" (environment
  observations) in conversation order, at least one assistant turn: a "tool" message follows
  an assistant turn, and no assistant turn follows another.
- An assistant turn's content is exactly what the model generates, without the closing
  `<|im_end|>`; the tokeniser appends `<|im_end|>` and trains on it (the model must learn to
  stop).
- No content holds the text of `<|im_start|>` or `<|im_end|>`, and no assistant content that of
  `<|endoftext|>`: the tokeniser encodes such text as the special token wherever it stands, so
  the ids would open or close a turn inside a message, or teach the model to end its turn
  there (the sampler stops on `<|endoftext|>` as on `<|im_end|>`). Code that prints one splits
  the literal (`"<|im" "_end|>"`).
- Messages are tokenised by `sage_jax.tokenizer.Conversation`, the builder rollouts use: a
  "tool" message is a ChatML user turn, and an assistant turn's ids are the tokenisation of its
  content, so SFT trains on the same ids the agent sees at sampling time.
- Loss only on assistant tokens (their `<|im_end|>` included); system, user and tool turns and
  every ChatML header are context. Turns after the last assistant turn carry no loss and are
  dropped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from sage_jax import storage
from sage_jax.tokenizer import ENDOFTEXT, IM_END, IM_START, Conversation, Tokenizer

ROLES = ("system", "user", "assistant", "tool")
# Texts of special tokens a message may not hold (the module doc says why), by role.
_FORBIDDEN_TEXTS = {role: (IM_START, IM_END) + ((ENDOFTEXT,) if role == "assistant" else ())
                    for role in ROLES}


@dataclasses.dataclass(frozen=True)
class Trajectory:
  """One expert conversation (see the module doc for the rules)."""

  id: str
  messages: tuple[dict[str, str], ...]
  metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

  def to_json(self) -> dict:
    return {"id": self.id, "messages": [dict(m) for m in self.messages],
            "metadata": dict(self.metadata)}


@dataclasses.dataclass(frozen=True)
class SFTExample:
  """A tokenised trajectory: ids and a loss mask (1 on assistant tokens)."""

  id: str
  tokens: np.ndarray  # int32 [L]
  loss_mask: np.ndarray  # int8 [L]


class FormatError(ValueError):
  """A trajectory that breaks the format; the message names it and the message index."""


def validate(raw: Any, where: str = "trajectory") -> Trajectory:
  """Checks one decoded JSON object and returns it as a Trajectory."""
  if not isinstance(raw, dict):
    raise FormatError(f"{where}: expected a JSON object, got {type(raw).__name__}")
  tid = raw.get("id")
  if not isinstance(tid, str) or not tid:
    raise FormatError(f"{where}: 'id' must be a non-empty string")
  where = f"{where} ({tid})"
  messages = raw.get("messages")
  if not isinstance(messages, list) or not messages:
    raise FormatError(f"{where}: 'messages' must be a non-empty list")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or set(m) - {"role", "content"}:
      raise FormatError(f"{where}: message {i} must be {{'role', 'content'}}, got {m!r:.80}")
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
      raise FormatError(f"{where}: message {i} has role {role!r}; expected one of {ROLES}")
    if not isinstance(content, str):
      raise FormatError(f"{where}: message {i} content must be a string")
    for text in _FORBIDDEN_TEXTS[role]:
      if text in content:
        raise FormatError(f"{where}: message {i} ({role}) holds the text {text!r}, which "
                          "tokenises to that special token and would break the turn; split the "
                          f"literal, e.g. {text[:4]!r} {text[4:]!r}")
    if (role == "system") != (i == 0):
      raise FormatError(f"{where}: message {i}: the system prompt is the first message "
                        "and only it")
    if i and (problem := _out_of_order(role, out[-1]["role"], i)):
      raise FormatError(f"{where}: message {i} ({role}) {problem}")
    out.append({"role": role, "content": content})
  if not any(m["role"] == "assistant" for m in out):
    raise FormatError(f"{where}: no assistant message, nothing to train on")
  metadata = raw.get("metadata", {})
  if not isinstance(metadata, dict):
    raise FormatError(f"{where}: 'metadata' must be an object")
  return Trajectory(tid, tuple(out), metadata)


def _out_of_order(role: str, previous: str, index: int) -> str | None:
  """What is wrong with message `index` of `role` after one of `previous`, if anything: the
  agent's conversations are system, the task, then assistant turns each answered by a tool
  observation (or by the user), and SFT should not teach the model other shapes."""
  if index == 1 and role != "user":
    return "comes where the task (a user message) should be"
  if role == "tool" and previous != "assistant":
    return f"follows a {previous} message: an observation answers an assistant turn"
  if role == "assistant" and previous == "assistant":
    return "follows another assistant message: turns alternate with observations"
  return None


def iter_jsonl(path: str | os.PathLike) -> Iterator[Trajectory]:
  """Trajectories of a JSONL file (local or remote), validated, in file order."""
  with storage.path(path).open(encoding="utf-8") as f:
    for n, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        raw = json.loads(line)
      except json.JSONDecodeError as e:
        raise FormatError(f"{path}:{n}: not JSON ({e})") from None
      yield validate(raw, f"{path}:{n}")


def read_jsonl(path: str | os.PathLike) -> list[Trajectory]:
  trajectories = list(iter_jsonl(path))
  ids = [t.id for t in trajectories]
  if len(set(ids)) != len(ids):
    dup = next(i for i in ids if ids.count(i) > 1)
    raise FormatError(f"{path}: duplicate id {dup!r}")
  return trajectories


def write_jsonl(path: str | os.PathLike, trajectories: Iterable[Trajectory]) -> int:
  """Writes trajectories whole (`storage.write_text`: local or remote); returns the count."""
  lines = [json.dumps(t.to_json(), ensure_ascii=False) + "\n" for t in trajectories]
  storage.write_text(path, "".join(lines))
  return len(lines)


def tokenize(trajectory: Trajectory, tokenizer: Tokenizer) -> SFTExample:
  """The trajectory's ids through `Conversation`, loss on assistant tokens only."""
  messages = list(trajectory.messages)
  last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
  conv = Conversation(tokenizer, messages[0]["content"])
  for m in messages[1:last + 1]:
    if m["role"] == "user":
      conv.add_user(m["content"])
    elif m["role"] == "tool":
      conv.add_tool(m["content"])
    else:
      conv.start_assistant()
      conv.add_assistant_tokens(tokenizer.encode(m["content"]) + [tokenizer.eos_id])
      conv.end_assistant()
  return SFTExample(trajectory.id, np.asarray(conv.ids, np.int32),
                    np.asarray(conv.loss_mask, np.int8))


def load_examples(path: str | os.PathLike, tokenizer: Tokenizer,
                  max_len: int | None = None) -> list[SFTExample]:
  """Tokenised trajectories of a JSONL file; with `max_len`, longer ones raise (nothing is
  silently cut: a cut trajectory would teach the model to stop mid-task)."""
  examples = [tokenize(t, tokenizer) for t in read_jsonl(path)]
  if max_len is not None and (long := longer_than(examples, max_len)):
    raise FormatError(f"{path}: {len(long)} trajectories exceed {max_len} tokens (the "
                      f"engine's max_len), e.g. {long[0][0]} with {long[0][1]}")
  return examples


def longer_than(examples: Iterable[SFTExample], max_len: int) -> list[tuple[str, int]]:
  """(id, tokens) of each example longer than `max_len` tokens."""
  return [(e.id, len(e.tokens)) for e in examples if len(e.tokens) > max_len]


def longest_reply(example: SFTExample) -> int:
  """Tokens of the example's longest assistant turn: a run of its loss mask, the end token
  included (what a turn generates)."""
  edges = np.flatnonzero(np.diff(np.concatenate([[0], np.asarray(example.loss_mask, np.int8),
                                                 [0]])))
  return int((edges[1::2] - edges[::2]).max(initial=0))


def fingerprint(examples: Sequence[SFTExample]) -> str:
  """How many examples, and a digest of their ids, tokens and loss masks in order."""
  digest = hashlib.sha256()
  for e in examples:
    for part in (e.id.encode(), np.asarray(e.tokens, np.int32).tobytes(),
                 np.asarray(e.loss_mask, np.int8).tobytes()):
      digest.update(len(part).to_bytes(8, "little") + part)
  return f"{len(examples)} examples, sha256 {digest.hexdigest()[:16]}"


def messages_from_ids(ids: Sequence[int], turns: Sequence[tuple[str, int, int]],
                      tokenizer: Tokenizer) -> list[dict[str, str]]:
  """Messages of a token-level conversation (a rollout record's `tokens` and `turns`): the
  inverse of `tokenize` for conversations built by `Conversation`."""
  out = []
  for role, start, end in turns:
    turn = list(ids[start:end])
    chatml_role = "assistant" if role == "assistant" else ("system" if role == "system"
                                                           else "user")
    if turn[0] != tokenizer.im_start:
      raise ValueError(f"turn {role} at {start} does not start with <|im_start|>")
    body = turn[1:]
    if body and body[-len(tokenizer.newline_ids):] == tokenizer.newline_ids:
      body = body[:-len(tokenizer.newline_ids)]
    if body and body[-1] == tokenizer.im_end:
      body = body[:-1]
    text = tokenizer.decode(body)
    prefix = f"{chatml_role}\n"
    if not text.startswith(prefix):
      raise ValueError(f"turn {role} at {start} does not start with {prefix!r}")
    out.append({"role": role, "content": text[len(prefix):]})
  return out
