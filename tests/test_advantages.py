"""Group-relative advantages per chain position (GRPO and Dr.GRPO)."""

import numpy as np
import pytest

from sage_jax.rl import advantages
from tests.test_rewards import rec


def _group(rewards_by_rollout, group=0):
  records = []
  for r, chain_rewards in enumerate(rewards_by_rollout):
    for k, value in enumerate(chain_rewards):
      record = rec(k, True, group=group, rollout=r)
      record.reward = value
      records.append(record)
  return records


def test_grpo_normalises_per_position():
  records = _group([[2.0, 1.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
  stats = advantages.assign_advantages(records)
  first = np.array([r.advantage for r in records if r.chain_position == 0])
  expected = (np.array([2.0, 0.0, 1.0, 1.0]) - 1.0) / (np.std([2.0, 0.0, 1.0, 1.0]) + 1e-6)
  assert first == pytest.approx(expected)
  assert all(r.advantage == 0.0 for r in records if r.chain_position == 1)
  assert stats.num_groups == 2 and stats.num_constant_groups == 1
  assert stats.constant_fraction == 0.5
  assert stats.reward_mean_by_position == pytest.approx((1.0, 1.0))


def test_drgrpo_centres_only():
  records = _group([[2.0], [0.0], [1.0], [3.0]])
  advantages.assign_advantages(records, advantages.AdvantageConfig(estimator="drgrpo"))
  assert [r.advantage for r in records] == pytest.approx([0.5, -1.5, -0.5, 1.5])


def test_groups_do_not_mix_and_all_equal_is_zero():
  records = _group([[1.0], [0.0]], group=0) + _group([[-1.0], [-1.0]], group=1)
  stats = advantages.assign_advantages(records)
  assert [r.advantage for r in records[:2]] == pytest.approx([1.0, -1.0], abs=1e-5)
  assert [r.advantage for r in records[2:]] == [0.0, 0.0]
  assert stats.num_constant_groups == 1 and stats.to_dict()["constant_fraction"] == 0.5
  single = _group([[1.0]])
  advantages.assign_advantages(single)
  assert single[0].advantage == 0.0
  with pytest.raises(ValueError, match="estimator"):
    advantages.AdvantageConfig(estimator="ppo")
