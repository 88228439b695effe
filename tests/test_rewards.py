"""Rewards on hand-built episode records: every variant and the edge cases."""

import numpy as np
import pytest

from sage_jax.agent.skills import SkillEvents
from sage_jax.rl import rewards
from sage_jax.rl.episode import EpisodeRecord


def rec(k, success, *, used=(), sources=None, generated=(), no_code=0, steps=1, fraction=None,
        task=None, group=0, rollout=0, idle=()):
  """A record of chain position k (task id 's_<k+1>' unless given)."""
  n = 4
  return EpisodeRecord(
      task_id=task or f"s_{k + 1}", scenario="s", chain_position=k, group=group,
      rollout=rollout, experiment="e", tokens=np.zeros(n, np.int32),
      loss_mask=np.zeros(n, np.int8), sampler_logprobs=np.zeros(n, np.float32),
      model_logprobs=np.zeros(n, np.float32), turns=[],
      events=SkillEvents(generated=tuple(generated), used=tuple(used),
                         saved=tuple(generated), idle_uses=tuple(idle)),
      used_skill_sources=dict(sources if sources is not None
                              else {u: "s_1" for u in used}),
      visible_skills=tuple(used), num_steps=steps, generated_tokens=10, no_code_turns=no_code,
      end_reason="completed", success=success,
      fraction_passed=(1.0 if success else 0.0) if fraction is None else fraction,
      num_tests=4, task_completed=True)


SAGE = rewards.RewardConfig()
OUTCOME = rewards.RewardConfig(variant="outcome")
CHAIN = rewards.RewardConfig(variant="chain")


def test_sage_full_credit():
  chain = [rec(0, True, generated=["f"]), rec(1, True, used=["f"])]
  assert rewards.chain_rewards(chain, SAGE) == [2.0, 2.0]
  assert [r.reward for r in chain] == [2.0, 2.0]
  assert rewards.chain_rewards(chain, OUTCOME) == [1.0, 1.0]
  assert rewards.chain_rewards(chain, CHAIN) == [2.0, 2.0]


def test_all_fail():
  chain = [rec(0, False), rec(1, False)]
  for cfg in (SAGE, OUTCOME, CHAIN):
    assert rewards.chain_rewards(chain, cfg) == [0.0, 0.0]


def test_skill_defined_but_never_used():
  chain = [rec(0, True, generated=["f"]), rec(1, True)]
  assert rewards.chain_rewards(chain, SAGE) == [1.0, 1.0]
  assert rewards.chain_rewards(chain, CHAIN) == [2.0, 2.0]  # chain bonus asks no skill


def test_skill_used_but_task_failed():
  chain = [rec(0, True, generated=["f"]), rec(1, False, used=["f"])]
  assert rewards.chain_rewards(chain, SAGE) == [1.0, 0.0]
  assert rewards.chain_rewards(chain, CHAIN) == [1.0, 0.0]


def test_generation_credited_even_when_task1_failed():
  # Task 1 failed but saved a skill that task 2 used successfully.
  chain = [rec(0, False, generated=["f"]), rec(1, True, used=["f"])]
  assert rewards.chain_rewards(chain, SAGE) == [1.0, 2.0]
  assert rewards.chain_rewards(chain, CHAIN) == [0.0, 1.0]


def test_redefinition_is_not_use():
  # Task 2 redefined the library skill (an update): no usage event, so no bonus.
  chain = [rec(0, True, generated=["f"]), rec(1, True)]
  chain[1].events = SkillEvents(updated=("f",), saved=("f",))
  assert rewards.chain_rewards(chain, SAGE) == [1.0, 1.0]


def test_idle_uses_earn_the_bonuses_unless_told_not_to():
  # Task 2 used "f", whose calls made no app request (e.g. `def f(): pass`), and "g", which
  # did: only "g" pays when idle uses are not credited, and "g" came from another task.
  strict = rewards.RewardConfig(credit_idle_uses=False)
  chain = [rec(0, True, generated=["f"]), rec(1, True, used=["f"], idle=["f"])]
  assert rewards.chain_rewards(chain, SAGE) == [2.0, 2.0]  # the paper's: every use pays
  assert rewards.chain_rewards(chain, strict) == [1.0, 1.0]
  chain = [rec(0, True, generated=["f"]),
           rec(1, True, used=["f", "g"], idle=["f"], sources={"f": "s_1", "g": "other_1"})]
  assert rewards.chain_rewards(chain, strict) == [1.0, 2.0]
  assert not rewards.generation_credited(chain, 0, credit_idle_uses=False)
  assert rewards.generation_credited(chain, 0)


def test_skill_from_elsewhere_gets_use_but_no_generation_credit():
  chain = [rec(0, True, generated=["f"]), rec(1, True, used=["g"], sources={"g": "other_1"})]
  assert rewards.chain_rewards(chain, SAGE) == [1.0, 2.0]


def test_no_code_penalty_any_and_all():
  chain = [rec(0, True, generated=["f"], no_code=1, steps=2), rec(1, True, used=["f"])]
  assert rewards.chain_rewards(chain, SAGE) == [-1.0, 2.0]  # the penalty replaces outcome and bonus
  all_mode = rewards.RewardConfig(no_code_mode="all")
  assert rewards.chain_rewards(chain, all_mode) == [2.0, 2.0]
  chain[0].no_code_turns = 2
  assert rewards.chain_rewards(chain, all_mode) == [-1.0, 2.0]
  assert rewards.chain_rewards(chain, OUTCOME) == [-1.0, 1.0]
  custom = rewards.RewardConfig(no_code_penalty=-0.5)
  assert rewards.chain_rewards(chain, custom)[0] == -0.5


def test_truncated_turns_have_their_own_choice():
  chain = [rec(0, True, generated=["f"], steps=2), rec(1, True, used=["f"])]
  chain[0].truncated_turns = 1  # cut by the token limit before any code
  assert rewards.chain_rewards(chain, SAGE) == [-1.0, 2.0]  # default: a response without code
  outcome_only = rewards.RewardConfig(truncated_turns="outcome")
  assert rewards.chain_rewards(chain, outcome_only) == [2.0, 2.0]
  chain[0].no_code_turns = 1  # and one turn that ended without code: penalised either way
  assert rewards.chain_rewards(chain, outcome_only) == [-1.0, 2.0]
  all_mode = rewards.RewardConfig(no_code_mode="all")
  assert rewards.chain_rewards(chain, all_mode) == [-1.0, 2.0]  # 1 + 1 of 2 turns
  assert rewards.chain_rewards(chain, rewards.RewardConfig(
      no_code_mode="all", truncated_turns="outcome")) == [2.0, 2.0]
  with pytest.raises(ValueError, match="truncated_turns"):
    rewards.RewardConfig(truncated_turns="ignore")


def test_fraction_outcome_and_weights():
  chain = [rec(0, False, generated=["f"], fraction=0.5), rec(1, True, used=["f"])]
  cfg = rewards.RewardConfig(outcome="fraction", w_gen=0.3, w_use=0.2)
  assert rewards.chain_rewards(chain, cfg) == pytest.approx([0.8, 1.2])
  assert rewards.chain_rewards(chain, rewards.RewardConfig(variant="outcome",
                                                           outcome="fraction")) == [0.5, 1.0]


def test_longer_chains_credit_the_task_that_saved_the_version():
  # K = 3: task 2 updated f (its version), task 3 used it; task 1's skill g used by task 2.
  chain = [rec(0, True, generated=["f", "g"]),
           rec(1, True, used=["g"], sources={"g": "s_1"}),
           rec(2, True, used=["f"], sources={"f": "s_2"})]
  assert rewards.chain_rewards(chain, SAGE) == [2.0, 3.0, 2.0]
  chain[2].success = False
  assert rewards.chain_rewards(chain, SAGE) == [2.0, 2.0, 0.0]
  assert rewards.chain_rewards(chain, CHAIN) == [1.0, 1.0, 0.0]
  # Credited once however many later tasks use it.
  chain = [rec(0, True, generated=["f"]), rec(1, True, used=["f"]), rec(2, True, used=["f"])]
  assert rewards.chain_rewards(chain, SAGE) == [2.0, 2.0, 2.0]


def test_single_task_chain():
  assert rewards.chain_rewards([rec(0, True, generated=["f"])], SAGE) == [1.0]
  assert rewards.chain_rewards([rec(0, True)], CHAIN) == [2.0]


def test_assign_rewards_orders_by_position_and_config_checks():
  chain = [rec(1, True, used=["f"]), rec(0, True, generated=["f"])]
  assert rewards.assign_rewards([chain], SAGE) == [[2.0, 2.0]]
  with pytest.raises(ValueError, match="variant"):
    rewards.RewardConfig(variant="skill")
  with pytest.raises(ValueError, match="outcome"):
    rewards.RewardConfig(outcome="tests")
