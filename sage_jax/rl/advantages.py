"""Group-relative advantages per chain position.

A group is the G rollouts of one chain. For each (group, chain position) the G rewards are
normalised among themselves:

- GRPO: A_i = (r_i - mean) / (std + epsilon), std the population std (ddof 0, the GRPO
  paper's formula) or the unbiased one (ddof 1, as tunix and verl compute it);
- Dr.GRPO: A_i = r_i - mean (no std division);
- RLOO: A_i = r_i - mean_{j != i} r_j (leave-one-out baseline; = G / (G - 1) (r_i - mean)).

A (group, position) whose rewards are all equal gives zero advantages (it carries no learning
signal) and is counted in the statistics.

Episodes on which the environment failed (`EpisodeRecord.env_failed`), and those whose
reward hangs on a later task on which it failed (`reward_unknown`, see `rl.rewards`), are
left out of their set's normalisation (and of the reward statistics) and get advantage 0; the
update leaves them out of the loss (`rl.episode.trained_on`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

from sage_jax.rl.episode import EpisodeRecord, trained_on

ESTIMATORS = ("grpo", "drgrpo", "rloo")
STDS = ("population", "unbiased")


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
  """estimator: "grpo" (mean and std), "drgrpo" (mean only) or "rloo" (leave-one-out mean).
  std: GRPO's std, "population" (ddof 0) or "unbiased" (ddof 1). epsilon: added to the
  std."""

  estimator: str = "grpo"
  std: str = "population"
  epsilon: float = 1e-6

  def __post_init__(self):
    if self.estimator not in ESTIMATORS:
      raise ValueError(f"estimator={self.estimator!r}; expected one of {ESTIMATORS}")
    if self.std not in STDS:
      raise ValueError(f"std={self.std!r}; expected one of {STDS}")
    if self.epsilon < 0:
      raise ValueError(f"epsilon must be >= 0, got {self.epsilon}")
    if self.estimator != "grpo" and (self.std, self.epsilon) != (AdvantageConfig.std,
                                                                 AdvantageConfig.epsilon):
      raise ValueError(f"std={self.std!r} with epsilon={self.epsilon}: GRPO's division by "
                       f"the group's std (+ epsilon), which {self.estimator!r} does not "
                       "divide by; leave both at their defaults")


@dataclasses.dataclass(frozen=True)
class AdvantageStats:
  num_groups: int  # (group, chain position) sets normalised together
  num_constant_groups: int  # of which all rewards were equal (zero advantage)
  num_env_failures: int  # episodes left out because the environment failed under them
  num_rewards_unknown: int  # left out because a later task's environment failed
  # Rewards of the episodes normalised (those left out have no outcome's reward); NaN
  # where there is none. By position: one entry per chain position of the records.
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
  if config.estimator == "rloo":
    return centred * (r.size / (r.size - 1))  # r_i - (sum - r_i) / (G - 1)
  return centred / (r.std(ddof=1 if config.std == "unbiased" else 0) + config.epsilon)


def _mean(values: Sequence[float]) -> float:
  return float(np.mean(values)) if len(values) else np.nan


def assign_advantages(records: Sequence[EpisodeRecord],
                      config: AdvantageConfig = AdvantageConfig()) -> AdvantageStats:
  """Sets `.advantage` of every record from its (group, chain position) peers."""
  sets = collections.defaultdict(list)
  for record in records:
    if not trained_on(record):
      record.advantage = 0.0
      continue
    sets[(record.group, record.chain_position)].append(record)
  constant = 0
  for members in sets.values():
    rewards = [m.reward for m in members]
    if all(r == rewards[0] for r in rewards):
      constant += 1
    for m, a in zip(members, group_advantages(rewards, config)):
      m.advantage = float(a)
  known = [m for members in sets.values() for m in members]
  rewards = np.asarray([r.reward for r in known], np.float64)
  by_position = tuple(_mean([r.reward for r in known if r.chain_position == p])
                      for p in sorted({r.chain_position for r in records}))
  return AdvantageStats(
      num_groups=len(sets), num_constant_groups=constant,
      num_env_failures=sum(bool(getattr(r, "env_failed", False)) for r in records),
      num_rewards_unknown=sum(bool(getattr(r, "reward_unknown", False))
                              and not getattr(r, "env_failed", False) for r in records),
      reward_mean=_mean(rewards), reward_std=float(rewards.std()) if rewards.size else np.nan,
      reward_mean_by_position=by_position)
