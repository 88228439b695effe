"""Episodes on which the environment failed are left out of their group's normalisation and
of the loss, and counted."""

import jax
import numpy as np
import pytest

from sage_jax.model import get_preset, init_model
from sage_jax.rl import advantages, episode, grpo
from sage_jax.rl import rewards as rewards_lib
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
  # A first prompt longer than every row ended its episode before any turn: nothing to train.
  overflow = _episode(40, 1.0)
  overflow["loss_mask"][:] = 0
  out = rl_loop.grpo_update(trainer, [_episode(8, 1.0), overflow], config, batch_config)
  assert out["updates"] == 1.0 and out["batch/real_positions"] == 7


def _two_rollouts(config, later_fails):
  """Two rollouts of one 3-task chain that write skill f at task 1; rollout 1's task
  `later_fails` meets an environment failure. Rewards and advantages assigned."""
  chains = []
  for rollout_id in (0, 1):
    chain = [rec(0, True, generated=["f"], rollout=rollout_id),
             rec(1, True, used=["f"], rollout=rollout_id),
             rec(2, True, used=["f"], rollout=rollout_id)]
    chains.append(chain)
  chains[1][later_fails] = _failed(rec(later_fails, False, rollout=1))
  rewards_lib.assign_rewards(chains, config)
  stats = advantages.assign_advantages([r for c in chains for r in c])
  return chains, stats


def test_a_bonus_that_hangs_on_a_failed_environment_is_not_trained_on():
  # Task 3 failed under rollout 1: task 1's generation bonus is still known (task 2 credits
  # it) and task 2 saved nothing, so everything but the failed episode is trained on.
  chains, stats = _two_rollouts(rewards_lib.RewardConfig(), later_fails=2)
  assert [[episode.trained_on(r) for r in c] for c in chains] == [[1, 1, 1], [1, 1, 0]]
  assert stats.num_env_failures == 1 and stats.num_rewards_unknown == 0
  # Task 2 failed and task 3 credits task 1: known too.
  chains, _ = _two_rollouts(rewards_lib.RewardConfig(), later_fails=1)
  assert [episode.trained_on(r) for r in chains[1]] == [True, False, True]
  # Chain bonus: the chain would have succeeded but for the failed task, so no earlier or
  # later task's bonus is known; scored as a failure, task 1 would get 1 instead of 2 and a
  # negative advantage for a chain it did nothing wrong in.
  chains, stats = _two_rollouts(rewards_lib.RewardConfig(variant="chain"), later_fails=1)
  assert [episode.trained_on(r) for r in chains[1]] == [False, False, False]
  assert stats.num_rewards_unknown == 2
  assert [r.advantage for r in chains[1]] == [0.0, 0.0, 0.0]
  assert [r.advantage for r in chains[0]] == [0.0, 0.0, 0.0]  # alone in its set now
  # Outcome rewards never look ahead.
  chains, _ = _two_rollouts(rewards_lib.RewardConfig(variant="outcome"), later_fails=1)
  assert [episode.trained_on(r) for r in chains[1]] == [True, False, True]


def test_a_sage_generation_bonus_no_later_task_credits_is_unknown_after_a_failure():
  chain = [rec(0, True, generated=["f"]), _failed(rec(1, False)), rec(2, True)]
  rewards_lib.chain_rewards(chain, rewards_lib.RewardConfig())
  assert [r.reward_unknown for r in chain] == [True, False, False]
  assert [episode.trained_on(r) for r in chain] == [False, False, True]
  chain[0].no_code_turns = 1  # the no-code penalty replaces any bonus: known
  rewards_lib.chain_rewards(chain, rewards_lib.RewardConfig())
  assert [episode.trained_on(r) for r in chain] == [True, False, True]
  for k, record in enumerate(chain):  # a mapping the update reads carries the same flags
    assert episode.trained_on({"env_failed": record.env_failed,
                               "reward_unknown": record.reward_unknown}) == (k != 1)


def test_a_task_the_environment_failed_under_credits_no_generation_bonus():
  """AppWorld may still score the task a success (it evaluates the state the episode left);
  its use of task 1's skill earns task 1 nothing, which then is unknown, as after a failure
  AppWorld scored a fail."""
  for later_success in (True, False):
    chain = [rec(0, True, generated=["f"]), _failed(rec(1, later_success, used=["f"]))]
    rewards = rewards_lib.chain_rewards(chain, rewards_lib.RewardConfig())
    assert rewards[0] == 1.0 and chain[0].reward_unknown
    assert [episode.trained_on(r) for r in chain] == [False, False]
  # A later task the environment did not fail under still credits it.
  chain = [rec(0, True, generated=["f"]), _failed(rec(1, True, used=["f"])),
           rec(2, True, used=["f"])]
  assert rewards_lib.chain_rewards(chain, rewards_lib.RewardConfig())[0] == 2.0
  assert [episode.trained_on(r) for r in chain] == [True, False, True]


def test_fewer_episodes_than_mini_batches_make_fewer_updates():
  # Failures (or dynamic sampling) can leave a step fewer episodes than its mini-batches; a
  # process may even hold none (tests/multihost_job.py, step 1). Each remaining episode is
  # trained on; the mini-batches no episode reaches are skipped, not an error.
  model = init_model(get_preset("tiny").replace(vocab_size=16), seed=0)
  config = grpo.GRPOConfig(num_mini_batches=4)
  trainer = rl_loop.grpo_trainer(model, config, OptimizerConfig(learning_rate=1e-2))
  batch_config = B.BatchConfig(micro_batch_tokens=64, num_micro_batches=1, length_buckets=(16,))
  out = rl_loop.grpo_update(trainer, [_episode(8, 1.0), _episode(6, -1.0),
                                      _episode(12, 1.0, failed=True)], config, batch_config)
  assert out["updates"] == 2.0 and out["batch/real_positions"] == 7 + 5


def _sage_group():
  """One group of G = 3 rollouts of a 2-task chain, SAGE rewards: rollout 0 writes skill f and
  uses it (2, 2); the environment fails under rollout 1's task 2, so its task 1's generation
  bonus is unknown (neither is trained on); rollout 2 succeeds, then fails (1, 0)."""
  return [[rec(0, True, generated=["f"], rollout=0), rec(1, True, used=["f"], rollout=0)],
          [rec(0, True, generated=["f"], rollout=1), _failed(rec(1, False, rollout=1))],
          [rec(0, True, rollout=2), rec(1, False, rollout=2)]]


def test_reward_and_advantage_metrics_cover_the_episodes_trained_on():
  # Rewards of episodes never trained on (their outcome or bonus unknown) stay out of the
  # reward curves, and their advantage of 0 out of the advantage statistics.
  chains = _sage_group()
  rewards_lib.assign_rewards(chains, rewards_lib.RewardConfig())
  records = [r for c in chains for r in c]
  assert [episode.trained_on(r) for r in records] == [True, True, False, False, True, True]
  stats = advantages.assign_advantages(records)
  assert stats.reward_mean == pytest.approx(1.25)  # of 2, 2, 1, 0
  assert stats.reward_std == pytest.approx(np.std([2.0, 2.0, 1.0, 0.0]))
  assert stats.reward_mean_by_position == pytest.approx((1.5, 1.0))
  assert rl_metrics.advantage_metrics(records) == pytest.approx(
      {"advantage/abs_mean": 1.0, "advantage/zero_frac": 0.0}, abs=1e-5)
  m = rl_metrics.sample_metrics(records)
  assert m["reward/mean"] == pytest.approx(1.25) and m["reward/pos0/mean"] == 1.5
  assert m["reward/pos1/mean"] == 1.0 and m["reward/pos1/std"] == 1.0
  assert m["episodes"] == 6 and m["success"] == pytest.approx(4 / 6)  # what was sampled
  assert rl_metrics.advantage_metrics(records[2:4]) == {}  # none trained on: no statistic
  assert "reward/mean" not in rl_metrics.sample_metrics(records[2:4])


def test_the_rollout_reward_covers_episodes_whose_reward_is_known(monkeypatch):
  """appworld_rollout's metrics of a step whose episodes the environment partly failed under:
  the played groups are stubbed (`rollout.run_groups`), rewards and advantages are real."""
  from sage_jax.rl import rollout

  async def run_groups(ctx, chains, config, *, first_group=0):
    assert len(chains) == 1 and config.group_size == 3
    return rollout.RolloutBatch(list(chains), [_sage_group()], [[None] * 3])

  monkeypatch.setattr(rollout, "run_groups", run_groups)
  run = rl_loop.appworld_rollout(None, ["s_1", "s_2"], rollout.RolloutConfig(
      chain_length=2, group_size=3), rewards_lib.RewardConfig(), num_chains=1)
  episodes, values = run(0, 0)
  assert len(episodes) == 6
  assert values["rollout/reward"] == pytest.approx(1.25)
  assert values["rollout/reward/pos0"] == 1.5 and values["rollout/reward/pos1"] == 1.0
  assert values["reward/mean"] == pytest.approx(1.25)
  # The left-out episodes are counted by metrics of their own.
  assert values["num_env_failures"] == values["num_rewards_unknown"] == 1
  assert values["rollout/env_failure_rate"] == pytest.approx(100 / 6)
