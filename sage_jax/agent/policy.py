"""The policy abstraction the agent drives: per conversation, the next assistant turn's ids.

The real policy is the sampler engine (`sage_jax.rl.rollout.SamplerPolicy`); the scripted one
(`sage_jax.agent.gold_solutions.ScriptedPolicy`) replays gold solutions in the skill format. Both see
the same requests and go through the same agent, rollout and evaluation code.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from sage_jax.agent.library import Skill


@dataclasses.dataclass(frozen=True)
class TaskContext:
  """What a policy may know about the task it plays (a model only sees the tokens)."""

  task_id: str
  scenario: str
  instruction: str
  skills: tuple[Skill, ...]  # the library skills shown and installed
  use_library: bool
  seed: int = 0


@dataclasses.dataclass(frozen=True)
class TurnRequest:
  """One assistant turn to generate.

  prompt_ids: the whole conversation up to and including the open assistant header.
  new_ids: what was appended since the policy's previous turn ended (its sampled tokens are
  already part of the sequence): the whole prompt on the first turn. max_new_tokens: this
  turn's budget. max_context: the longest the sequence may grow.
  """

  prompt_ids: list[int]
  new_ids: list[int]
  turn_index: int
  max_new_tokens: int
  max_context: int


@dataclasses.dataclass(frozen=True)
class PolicyTurn:
  """A generated turn: ids as produced, logprobs per id (zeros for scripted turns).

  finish_reason: "eos" (the turn ended with the end-of-turn token, included in tokens),
  "stop_string", "max_new_tokens" or "context_full".
  """

  tokens: list[int]
  sample_logprobs: np.ndarray
  model_logprobs: np.ndarray
  finish_reason: str


class PolicySession(Protocol):
  async def generate(self, request: TurnRequest) -> PolicyTurn:
    ...

  async def close(self) -> None:
    ...


class Policy(Protocol):
  def session(self, context: TaskContext) -> PolicySession:
    """A new conversation (one task episode)."""
