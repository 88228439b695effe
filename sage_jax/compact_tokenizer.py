"""Qwen2.5's byte-level BPE cut down to the tokens a corpus uses, for small models.

A random-init model with Qwen2.5's 151,665 tokens spends most of its compute in the embedding
and the output head. The compact tokenizer keeps the corpus's tokens, the 256 byte tokens, every
token a kept merge is built from, and Qwen2.5's added tokens, renumbered densely. It is still a
complete byte-level BPE (any text encodes, falling back to shorter pieces and bytes where a
token was dropped), and on the corpus it tokenizes exactly as Qwen2.5 does: every merge the full
tokenizer applies to a corpus word produces a kept token, and the merges that were dropped never
fired on it. The directory it writes loads in `Tokenizer` and in transformers' `AutoTokenizer`.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Iterable

import tokenizers
from etils import epath

from sage_jax import storage
from sage_jax import tokenizer as qwen_tokenizer


def _merge_pairs(merges: list) -> list[tuple[str, str]]:
  """Merges as pairs, from either serialisation (`["a", "b"]` or `"a b"`)."""
  return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in merges]


def compact_spec(full: dict, used_ids: Iterable[int]) -> dict:
  """The tokenizer.json spec `full` restricted to `used_ids` (plus bytes, merge parts and
  added tokens), with dense ids: regular tokens in their original order, then added tokens."""
  model = full["model"]
  id_to_token = {i: t for t, i in model["vocab"].items()}
  merges = _merge_pairs(model["merges"])
  parts = {a + b: (a, b) for a, b in merges}
  added = {t["id"] for t in full["added_tokens"]}
  keep = set(tokenizers.pre_tokenizers.ByteLevel.alphabet())
  stack = [id_to_token[i] for i in used_ids if i not in added]
  while stack:
    token = stack.pop()
    if token in keep:
      continue
    keep.add(token)
    stack.extend(parts.get(token, ()))
  regular = sorted(keep, key=model["vocab"].__getitem__)
  vocab = {token: i for i, token in enumerate(regular)}
  added_tokens = [{**t, "id": len(vocab) + n}
                  for n, t in enumerate(sorted(full["added_tokens"], key=lambda t: t["id"]))]
  return {**full, "added_tokens": added_tokens,
          "model": {**model, "vocab": vocab,
                    "merges": [[a, b] for a, b in merges if a + b in keep]}}


# What `write_compact_tokenizer` writes, in the order it writes them: tokenizer.json, the file
# a reader loads, last.
FILES = ("vocab.json", "merges.txt", "tokenizer_config.json", "tokenizer.json")


def write_compact_tokenizer(out_dir: str | os.PathLike, *, texts: Iterable[str] = (),
                            ids: Iterable[int] = (),
                            source: str | os.PathLike | None = None) -> epath.Path:
  """Writes the tokenizer of `source` (default Qwen2.5) cut down to the tokens `ids` (of the
  full tokenizer) and what `texts` encode to into `out_dir` (local or remote); returns the
  directory. Give the ids of the corpus as the model reads it: text encoded in other pieces
  (a whole conversation where each turn is encoded apart) can use other tokens."""
  source = pathlib.Path(source or qwen_tokenizer.ensure_qwen25_tokenizer_dir())
  text = (source / "tokenizer.json").read_text(encoding="utf-8")
  full = json.loads(text)
  encoder = tokenizers.Tokenizer.from_str(text)
  used: set[int] = set(ids)
  for text in texts:
    used.update(encoder.encode(text, add_special_tokens=False).ids)
  spec = compact_spec(full, used)
  first_added = len(spec["model"]["vocab"])
  contents = {
      "vocab.json": json.dumps(spec["model"]["vocab"], ensure_ascii=False),
      "merges.txt": "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in spec["model"]["merges"]),
      "tokenizer_config.json": json.dumps(qwen_tokenizer.tokenizer_config(first_added), indent=2,
                                          ensure_ascii=False),
      "tokenizer.json": json.dumps(spec, ensure_ascii=False)}
  out = storage.path(out_dir)
  for name in FILES:  # each whole
    storage.write_text(out / name, contents[name])
  return out


def is_complete(directory: str | os.PathLike) -> bool:
  """Whether `directory` holds every file of a compact tokenizer: a write that was cut short
  (each file is written whole, one after another) leaves some out."""
  directory = storage.path(directory)
  return all((directory / name).exists() for name in FILES)


RUN_SUBDIR = "tokenizer"  # where a run with a compact vocabulary keeps its tokenizer


def run_tokenizer_dir(workdir: str | os.PathLike, vocabulary: str) -> epath.Path:
  """The tokenizer directory of the run in `workdir` (its model section's `vocabulary`)."""
  if vocabulary == "compact":
    return storage.path(workdir) / RUN_SUBDIR
  return epath.Path(qwen_tokenizer.ensure_qwen25_tokenizer_dir())
