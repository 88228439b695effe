"""The record of one task episode of a rollout: what the trainer, rewards and metrics read.

Per-token arrays cover the whole conversation, exactly the ids the sampler produced and the
observation ids appended (never re-tokenised):

  tokens            int32   [L]
  loss_mask         int8    [L]  1 on model-generated tokens only
  sampler_logprobs  float32 [L]  sampling-distribution logprob of each generated token, else 0
  model_logprobs    float32 [L]  unmodified-model logprob of each generated token, else 0

`reward` and `advantage` are filled by `rl.rewards` and `rl.advantages`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from sage_jax.agent.agent import TaskTrace
from sage_jax.agent.skills import SkillEvents


@dataclasses.dataclass
class EpisodeRecord:
  # ids
  task_id: str
  scenario: str
  chain_position: int  # 0-based position of the task in its chain
  group: int  # index of the group (G rollouts of one chain) in the batch
  rollout: int  # index of the rollout in its group
  experiment: str  # AppWorld experiment name holding the episode's outputs
  # tokens (never re-tokenised)
  tokens: np.ndarray
  loss_mask: np.ndarray
  sampler_logprobs: np.ndarray
  model_logprobs: np.ndarray
  turns: list[tuple[str, int, int]]  # (role, start, end) of each ChatML turn
  # agent behaviour
  events: SkillEvents
  used_skill_sources: dict[str, str]  # used library skill -> task that saved its version
  visible_skills: tuple[str, ...]  # library skills shown and installed
  num_steps: int  # assistant turns
  generated_tokens: int
  no_code_turns: int  # turns that ended without a code block
  end_reason: str  # completed | max_steps | token_limit | env_error
  # AppWorld evaluation
  success: bool
  fraction_passed: float
  num_tests: int
  task_completed: bool  # the agent called complete_task
  errors: list[str] = dataclasses.field(default_factory=list)
  difficulty: int | None = None
  truncated_turns: int = 0  # turns without a code block because a token limit cut them
  # why AppWorld's evaluation did not score the state the episode's code saved (forged, not
  # replayable, too slow): a failure of the agent (`Evaluation.refused`)
  evaluation_refused: str | None = None
  # the environment's errors under earlier attempts at the task, each played again from its
  # start (`EnvPoolConfig.episode_retries`); this record is the last attempt's
  retried_errors: list[str] = dataclasses.field(default_factory=list)
  # what those earlier attempts cost: all their tokens, and those the model generated
  retried_tokens: int = 0
  retried_generated_tokens: int = 0
  # filled by rewards / advantages
  reward: float = 0.0
  advantage: float = 0.0
  # set by rewards: the reward depends on a later task of the chain on which the environment
  # failed (a skill-generation or chain bonus that cannot be known)
  reward_unknown: bool = False

  def __post_init__(self):
    n = len(self.tokens)
    for name in ("loss_mask", "sampler_logprobs", "model_logprobs"):
      if len(getattr(self, name)) != n:
        raise ValueError(f"{name} has {len(getattr(self, name))} entries, tokens has {n}")

  @property
  def used_skill(self) -> bool:
    return bool(self.events.used)

  @property
  def env_failed(self) -> bool:
    """The environment failed under the episode (worker crash, pool timeout, a refused
    request): its outcome says nothing about the policy, so it is not trained on."""
    return bool(self.errors)

  @property
  def no_code(self) -> bool:
    return self.no_code_turns > 0

  @property
  def truncated(self) -> bool:
    return self.truncated_turns > 0

  @classmethod
  def from_trace(cls, trace: TaskTrace, result: Any, *, chain_position: int, group: int,
                 rollout: int, experiment: str, used_skill_sources: dict[str, str],
                 difficulty: int | None = None) -> "EpisodeRecord":
    """Builds the record from the agent's trace and the pool's `EpisodeResult`."""
    conv = trace.conversation
    errors = [e for e in (trace.env_error, getattr(result, "error", None)) if e]
    evaluation = getattr(result, "evaluation", None)
    return cls(
        task_id=trace.task_id, scenario=trace.scenario, chain_position=chain_position,
        group=group, rollout=rollout, experiment=experiment,
        tokens=np.asarray(conv.ids, np.int32), loss_mask=np.asarray(conv.loss_mask, np.int8),
        sampler_logprobs=trace.sampler_logprobs.astype(np.float32),
        model_logprobs=trace.model_logprobs.astype(np.float32),
        turns=[(t.role, t.start, t.end) for t in conv.turns], events=trace.events,
        used_skill_sources=dict(used_skill_sources),
        visible_skills=tuple(s.name for s in trace.visible_skills),
        num_steps=trace.num_steps, generated_tokens=trace.generated_tokens,
        no_code_turns=trace.no_code_turns, end_reason=trace.end_reason,
        success=bool(result is not None and result.success),
        fraction_passed=float(result.fraction_passed) if result is not None else 0.0,
        num_tests=evaluation.num_tests if evaluation is not None else 0,
        task_completed=bool(getattr(result, "task_completed", False)),
        errors=list(dict.fromkeys(errors)), difficulty=difficulty,
        truncated_turns=trace.truncated_turns,
        evaluation_refused=getattr(evaluation, "refused", None))

  def summary(self) -> dict:
    """JSON-friendly fields (no per-token arrays)."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
           if f.name not in ("tokens", "loss_mask", "sampler_logprobs", "model_logprobs",
                             "turns", "events")}
    out["events"] = self.events.to_dict()
    out["visible_skills"] = list(self.visible_skills)
    out["length"] = int(len(self.tokens))
    return out


_REQUIRED = object()


def _field(episode: Any, name: str, default: Any = _REQUIRED) -> Any:
  """A field of an episode given as a record or as a mapping (its JSON form); without a
  default, a missing field raises (KeyError / AttributeError)."""
  if isinstance(episode, Mapping):
    return episode[name] if default is _REQUIRED else episode.get(name, default)
  return getattr(episode, name) if default is _REQUIRED else getattr(episode, name, default)


def trained_on(episode: Any) -> bool:
  """Whether advantages and the update use the episode (a record or a mapping): not when the
  environment failed under it, nor when its reward is unknown for a failure under a later
  task of its chain."""
  return not (_field(episode, "env_failed", False) or _field(episode, "reward_unknown", False))


def has_loss_tokens(episode: Any) -> bool:
  """Whether any of the episode's tokens is trained (a record or a mapping): none when its
  first prompt alone filled its token budget."""
  return bool(np.any(_field(episode, "loss_mask")))
