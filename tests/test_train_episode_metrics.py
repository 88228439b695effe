"""The RL loop's batch metrics of episodes: rewards and success per chain position, steps,
tokens, advantages; skill and chain metrics are `rl.metrics.task_metrics`' (tests/test_metrics.py)."""

import types

import numpy as np
import pytest

from sage_jax.train.loop import step_seed
from sage_jax.rl.metrics import advantage_metrics, sample_metrics


def _episode(group, rollout, position, reward, success, generated=(), used=False, no_code=False):
  return dict(tokens=np.zeros(5, np.int32), loss_mask=np.array([0, 1, 1, 0, 1]),
              group=group, rollout=rollout, chain_position=position, reward=reward,
              success=success, num_steps=2 + position, generated_tokens=10 * (1 + position),
              events=types.SimpleNamespace(generated=tuple(generated)), used_skill=used,
              no_code=no_code, advantage=0.0 if group == 1 else reward - 1.0)


def test_sample_metrics_by_position_and_chain():
  eps = [
      # group 0, rollout 0: both tasks succeed (skill generated in task 1, used in task 2)
      _episode(0, 0, 0, 2.0, True, generated=("f",)), _episode(0, 0, 1, 2.0, True, used=True),
      # group 0, rollout 1: task 2 fails
      _episode(0, 1, 0, 1.0, True, generated=("f",)), _episode(0, 1, 1, 0.0, False),
      # group 1, rollout 0: no code at all
      _episode(1, 0, 0, -1.0, False, no_code=True), _episode(1, 0, 1, -1.0, False, no_code=True),
  ]
  m = sample_metrics(eps)
  assert m["episodes"] == 6
  assert m["reward/mean"] == pytest.approx(0.5)
  assert m["reward/pos0/mean"] == pytest.approx(2 / 3)
  assert m["reward/pos1/mean"] == pytest.approx(1 / 3)
  assert m["reward/pos1/std"] == pytest.approx(np.std([2.0, 0.0, -1.0]))
  assert m["success"] == pytest.approx(3 / 6)
  assert m["success/pos0"] == pytest.approx(2 / 3) and m["success/pos1"] == pytest.approx(1 / 3)
  assert m["steps/mean"] == pytest.approx(2.5)
  assert m["generated_tokens/mean"] == pytest.approx(15.0)
  # One definition of the task metrics: the batch statistics leave them to task_metrics.
  assert not {"tgc", "sgc", "chain_success", "skill_usage_rate", "no_code_rate"} & set(m)
  assert advantage_metrics(eps)["advantage/zero_frac"] == pytest.approx(2 / 6 + 1 / 6)


def test_sample_metrics_with_only_batch_fields():
  eps = [dict(tokens=[1, 2, 3], loss_mask=[0, 1, 1], advantage=0.5)]
  assert sample_metrics(eps) == {"episodes": 1.0, "generated_tokens/mean": 2.0,
                                 "generated_tokens/total": 2.0}
  assert advantage_metrics(eps) == {"advantage/abs_mean": 0.5, "advantage/zero_frac": 0.0}


def test_step_seeds_are_distinct_and_stable():
  seeds = {step_seed(0, s) for s in range(1000)}
  assert len(seeds) == 1000
  assert step_seed(7, 3) == step_seed(7, 3) != step_seed(8, 3)
