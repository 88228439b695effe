"""Rewards of Sequential Rollout episodes: outcome-only, chain-based, Skill-integrated (SAGE).

Per rollout, a chain of K tasks e_0 .. e_{K-1} (one rollout walks them in order with its own
library). o_k is the outcome of task k: 1.0 on success (default) or the fraction of tests
passed.

- "outcome": r_k = o_k.
- "chain": r_k = o_k + chain_bonus when every task of the chain succeeded.
- "sage" (Skill-integrated Reward): r_k = o_k
    + w_gen  if some later task j > k succeeded and used a skill whose library version task k
             saved (skill-generation reward; for K = 2: task 1 gets it when task 2 succeeded
             and used a skill generated in task 1),
    + w_use  if k > 0 and task k succeeded and used a library skill (skill-usage reward).
  "used" and "saved" are the run-time events of `agent.skills`: a library skill counts as used
  only when a call of it returned, so swallowed exceptions, dead branches and skills replaced
  after failing earn no bonus. With credit_idle_uses=False, a use also needs a returned call
  that made an app request (`SkillEvents.idle_uses` are left out): a skill that asks nothing
  of the apps (`def f(): pass`, saved by one task and called by the next) then earns neither
  bonus. The default (True) pays for every use, as the paper defines it.
  For K > 2 this is the natural generalisation: a task is credited once (not per later
  user) for a skill version it wrote that a later successful task used; credit goes to the
  task that saved the version that ran, so a task that updated a skill earns it, and every
  task after the first can earn the usage reward.
- No-code penalty: an episode with a response without code gets r_k = no_code_penalty
  (default -1.0) instead of the above. no_code_mode "any" (default): any turn without code
  triggers it; "all": only when no turn had code. Turns cut by a token limit before any code
  (`truncated_turns`) are counted apart; truncated_turns "no_code" (default) counts them as
  responses without code: the paper penalises a response that holds no code, and a cut
  response holds none (not penalising it would let a policy escape the penalty by running
  out of tokens); "outcome" leaves them to the outcome reward alone.
- Environment failures: an episode on which the environment failed is not trained on
  (`rl.episode.trained_on`), and neither is an earlier task of its chain whose bonus hangs on
  it (`reward_unknown`): a SAGE task that saved a skill no other later task credits (a
  failed task's outcome, even one AppWorld scored a success, credits nothing), or a
  chain-based task whose chain the failed one alone keeps from succeeding. Scoring the failed
  task as a failure instead would take the bonus from the skills an environment fault hid.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from sage_jax.rl.episode import EpisodeRecord

VARIANTS = ("outcome", "chain", "sage")
OUTCOMES = ("success", "fraction")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """variant: "outcome", "chain" or "sage". outcome: "success" or "fraction" (of tests
  passed). w_gen / w_use: SAGE's skill-generation and skill-usage weights. credit_idle_uses:
  whether a skill use with no app request earns them. chain_bonus: the chain-based bonus.
  no_code_penalty / no_code_mode / truncated_turns: see the module docstring."""

  variant: str = "sage"
  outcome: str = "success"
  w_gen: float = 1.0
  w_use: float = 1.0
  credit_idle_uses: bool = True
  chain_bonus: float = 1.0
  no_code_penalty: float = -1.0
  no_code_mode: str = "any"
  truncated_turns: str = "no_code"

  def __post_init__(self):
    if self.variant not in VARIANTS:
      raise ValueError(f"variant={self.variant!r}; expected one of {VARIANTS}")
    if self.outcome not in OUTCOMES:
      raise ValueError(f"outcome={self.outcome!r}; expected one of {OUTCOMES}")
    if self.no_code_mode not in ("any", "all"):
      raise ValueError(f"no_code_mode={self.no_code_mode!r}; expected 'any' or 'all'")
    if self.truncated_turns not in ("no_code", "outcome"):
      raise ValueError(f"truncated_turns={self.truncated_turns!r}; expected 'no_code' or "
                       "'outcome'")


def outcome(record: EpisodeRecord, config: RewardConfig) -> float:
  if config.outcome == "fraction":
    return float(record.fraction_passed)
  return 1.0 if record.success else 0.0


def no_code(record: EpisodeRecord, config: RewardConfig) -> bool:
  """Whether the no-code penalty applies to the episode."""
  turns = record.no_code_turns + (record.truncated_turns
                                  if config.truncated_turns == "no_code" else 0)
  if config.no_code_mode == "all":
    return record.num_steps > 0 and turns == record.num_steps
  return turns > 0


def credited_uses(record: EpisodeRecord, credit_idle_uses: bool = True) -> dict[str, str]:
  """The library skills `record` used that earn the bonuses -> the task that saved each one's
  version: every use, or only those that made an app request."""
  if credit_idle_uses:
    return record.used_skill_sources
  return {name: source for name, source in record.used_skill_sources.items()
          if name not in record.events.idle_uses}


def generation_credited(chain: Sequence[EpisodeRecord], k: int,
                        credit_idle_uses: bool = True) -> bool:
  """Whether a later task of the chain succeeded using a skill version task k saved. A task
  the environment failed under credits nothing, whatever AppWorld scored of it."""
  source = chain[k].task_id
  return any(later.success and not later.env_failed
             and source in credited_uses(later, credit_idle_uses).values()
             for later in chain[k + 1:])


def chain_rewards(chain: Sequence[EpisodeRecord], config: RewardConfig) -> list[float]:
  """Rewards of one rollout's chain (records in chain order); also stored in `.reward`, with
  `.reward_unknown` where a bonus depends on a task the environment failed under."""
  rewards = []
  all_succeeded = all(r.success for r in chain)
  # Every task that ran succeeded: only the failed environment can have cost the bonus.
  chain_unknown = any(r.env_failed for r in chain) and all(
      r.success for r in chain if not r.env_failed)
  for k, record in enumerate(chain):
    record.reward_unknown = False
    if no_code(record, config):
      reward = config.no_code_penalty
    else:
      reward = outcome(record, config)
      if config.variant == "chain":
        if all_succeeded:
          reward += config.chain_bonus
        record.reward_unknown = chain_unknown
      elif config.variant == "sage":
        if generation_credited(chain, k, config.credit_idle_uses):
          reward += config.w_gen
        elif record.events.saved:  # a failed later task might have used what it saved
          record.reward_unknown = any(later.env_failed for later in chain[k + 1:])
        if k > 0 and record.success and credited_uses(record, config.credit_idle_uses):
          reward += config.w_use
    record.reward = float(reward)
    rewards.append(float(reward))
  return rewards


def assign_rewards(rollouts: Iterable[Sequence[EpisodeRecord]],
                   config: RewardConfig) -> list[list[float]]:
  """`chain_rewards` of every rollout (each a chain of records in order)."""
  return [chain_rewards(sorted(chain, key=lambda r: r.chain_position), config)
          for chain in rollouts]
