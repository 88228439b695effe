"""Group-relative advantages per chain position.

A group is the G rollouts of one chain. For each (group, chain position) the G rewards are
normalised among themselves: GRPO A = (r - mean) / (std + epsilon) (population std), or
Dr.GRPO A = r - mean (no std division). A (group, position) whose rewards are all equal gives
zero advantages (it carries no learning signal) and is counted in the statistics.

Episodes on which the environment failed (`EpisodeRecord.env_failed`) are left out of their
set's normalisation and get advantage 0; the update leaves them out of the loss
(`train.rl_loop.grpo_update`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

from sage_jax.rl.episode import EpisodeRecord

ESTIMATORS = ("grpo", "drgrpo")


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
  """estimator: "grpo" (mean and std) or "drgrpo" (mean only). epsilon: added to the std."""

  estimator: str = "grpo"
  epsilon: float = 1e-6

  def __post_init__(self):
    if self.estimator not in ESTIMATORS:
      raise ValueError(f"estimator={self.estimator!r}; expected one of {ESTIMATORS}")
    if self.epsilon < 0:
      raise ValueError(f"epsilon must be >= 0, got {self.epsilon}")


@dataclasses.dataclass(frozen=True)
class AdvantageStats:
  num_groups: int  # (group, chain position) sets normalised together
  num_constant_groups: int  # of which all rewards were equal (zero advantage)
  num_env_failures: int  # episodes left out because the environment failed under them
  reward_mean: float
  reward_std: float
  reward_mean_by_position: tuple[float, ...]

  @property
  def constant_fraction(self) -> float:
    return self.num_constant_groups / self.num_groups if self.num_groups else 0.0

  def to_dict(self) -> dict:
    return {**dataclasses.asdict(self), "constant_fraction": self.constant_fraction}


def group_advantages(rewards: Sequence[float], config: AdvantageConfig) -> np.ndarray:
  r = np.asarray(rewards, np.float64)
  if r.size == 0 or np.all(r == r[0]):
    return np.zeros_like(r)
  centred = r - r.mean()
  if config.estimator == "drgrpo":
    return centred
  return centred / (r.std() + config.epsilon)


def assign_advantages(records: Sequence[EpisodeRecord],
                      config: AdvantageConfig = AdvantageConfig()) -> AdvantageStats:
  """Sets `.advantage` of every record from its (group, chain position) peers."""
  sets = collections.defaultdict(list)
  failed = 0
  for record in records:
    if getattr(record, "env_failed", False):
      record.advantage = 0.0
      failed += 1
      continue
    sets[(record.group, record.chain_position)].append(record)
  constant = 0
  for members in sets.values():
    rewards = [m.reward for m in members]
    if all(r == rewards[0] for r in rewards):
      constant += 1
    for m, a in zip(members, group_advantages(rewards, config)):
      m.advantage = float(a)
  rewards = np.asarray([r.reward for r in records], np.float64)
  positions = sorted({r.chain_position for r in records})
  by_position = tuple(float(np.mean([r.reward for r in records if r.chain_position == p]))
                      for p in positions)
  return AdvantageStats(
      num_groups=len(sets), num_constant_groups=constant, num_env_failures=failed,
      reward_mean=float(rewards.mean()) if rewards.size else 0.0,
      reward_std=float(rewards.std()) if rewards.size else 0.0,
      reward_mean_by_position=by_position)
