"""Episodes on which the environment failed are left out of their group's normalisation and
of the loss, and counted."""

import jax
import numpy as np
import pytest

from sage_jax.model import get_preset, init_model
from sage_jax.rl import advantages, grpo, rollout
from sage_jax.rl import metrics as rl_metrics
from sage_jax.rl import batch as B
from sage_jax.train import rl_loop
from sage_jax.train.optimizer import OptimizerConfig
from tests.test_rewards import rec

FAULT = "worker exited unexpectedly"


def _failed(record):
  record.errors = [FAULT]
  return record


def test_failed_episodes_are_left_out_of_normalisation():
  group = [rec(0, True, rollout=0), rec(0, False, rollout=1), _failed(rec(0, False, rollout=2))]
  for r, reward in zip(group, (1.0, 0.0, 0.0)):
    r.reward = reward
  stats = advantages.assign_advantages(group)
  # Population std of [1, 0] is 0.5: the failed episode's 0 is not a peer's outcome.
  assert np.allclose([r.advantage for r in group], [1.0, -1.0, 0.0], atol=1e-5)
  assert stats.num_env_failures == 1 and stats.num_groups == 1
  metrics = rl_metrics.task_metrics(group, unit="chain")
  assert metrics["env_failure_rate"] == pytest.approx(100 / 3)


def _episode(length, advantage, failed=False):
  tokens = np.arange(length, dtype=np.int32) % 16
  mask = np.r_[0, np.ones(length - 1)].astype(np.int8)
  return {"tokens": tokens, "loss_mask": mask, "advantage": advantage,
          "model_logprobs": np.zeros(length, np.float32), "env_failed": failed}


def test_failed_episodes_are_left_out_of_the_loss():
  model = init_model(get_preset("tiny").replace(vocab_size=16), seed=0)
  config = grpo.GRPOConfig()
  trainer = rl_loop.grpo_trainer(model, config, OptimizerConfig(learning_rate=1e-2))
  batch_config = B.BatchConfig(micro_batch_tokens=64, num_micro_batches=1, length_buckets=(16,))
  before = jax.device_get(trainer.params)
  out = rl_loop.grpo_update(trainer, [_episode(8, 1.0, failed=True)], config, batch_config)
  assert out["updates"] == 0.0  # nothing to train on: no update at all
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before),
                                                  jax.tree.leaves(jax.device_get(trainer.params))))
  out = rl_loop.grpo_update(trainer, [_episode(8, 1.0), _episode(6, -1.0),
                                      _episode(12, 1.0, failed=True)], config, batch_config)
  assert out["updates"] == 1.0 and out["batch/real_positions"] == 7 + 5
