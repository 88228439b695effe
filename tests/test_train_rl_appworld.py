"""The RL loop composed with the real Sequential Rollout on the mini AppWorld (scripted expert
policy, real tokenizer, real rewards and advantages), one update of a tiny real-vocabulary
model with chunked logits, metrics and a checkpoint."""

import numpy as np
import pytest

from sage_jax.agent import AgentConfig, Retriever, ScriptedPolicy
from sage_jax.agent.gold_solutions import TextTurnsSession
from sage_jax.envs import appworld
from sage_jax.model import get_preset, init_model
from sage_jax.rl import batch as B
from sage_jax.rl import grpo, rewards, rollout
from sage_jax.tokenizer import Tokenizer
from sage_jax.train import checkpoint as ckpt
from sage_jax.train import rl_loop
from sage_jax.train.metrics import MetricsConfig, read_jsonl
from sage_jax.train.optimizer import OptimizerConfig
from tests import appworld_fixtures


@pytest.mark.slow
def test_rl_loop_with_the_appworld_sequential_rollout(tmp_path):
  root = appworld.ensure_mini_world()
  tok = Tokenizer()
  with appworld.EnvPool(appworld_fixtures.pool_config(
      root, str(tmp_path / "outputs"),
      max_output_chars=appworld.EnvPoolConfig.max_output_chars)) as pool:
    ctx = rollout.RolloutContext(ScriptedPolicy(root, tok), pool, tok, AgentConfig(),
                                 Retriever(), root)
    run = rl_loop.appworld_rollout(ctx, appworld.read_split(root, "train"),
                                   rollout.RolloutConfig(chain_length=2, group_size=2),
                                   rewards.RewardConfig(), num_chains=1)
    config = grpo.GRPOConfig(logprob_chunk=256)
    trainer = rl_loop.grpo_trainer(init_model(get_preset("tiny"), seed=0), config,
                                   OptimizerConfig(learning_rate=1e-3))
    before = np.asarray(trainer.params["norm"]["weight"][...]).copy()
    result = rl_loop.run_rl(
        trainer, rollout=run, config=rl_loop.RLLoopConfig(total_steps=1), grpo_config=config,
        batch_config=B.BatchConfig(micro_batch_tokens=1536, num_micro_batches=2,
                                   length_buckets=(768, 1024, 2048)),
        checkpointer=ckpt.Checkpointer(ckpt.CheckpointConfig(directory=str(tmp_path / "ck"))),
        metrics=MetricsConfig(log_dir=str(tmp_path / "log"), progress=False))
  (h,) = result.history
  # One chain of 2 tasks, 2 rollouts: the expert defines the skill in task 1, uses it in task 2.
  assert h["episodes"] == 4 and h["success"] == 1.0 and h["steps/mean"] == 1.0
  assert h["rollout/skill_usage_rate"] == 100.0 and h["rollout/skills_generated"] == 2
  assert h["rollout/no_code_rate"] == 0.0 and "skill_usage_rate" not in h
  assert h["reward/pos0/mean"] == 2.0 and h["reward/pos1/mean"] == 2.0  # SAGE bonuses
  assert h["advantage/zero_frac"] == 1.0 and h["loss"] == 0.0  # identical rollouts
  assert h["rollout/tgc"] == 100.0 and h["rollout/chain_success"] == 100.0
  assert h["rollout/w_gen_rate"] == h["rollout/w_use_rate"] == 50.0
  assert h["constant_groups"] == 2.0 and h["batch/padding_fraction"] < 0.3
  assert h["loss_tokens"] == h["generated_tokens/total"]
  # What the step spent: 4 episodes, their generated tokens all trained on, and the context.
  assert h["compute/episodes"] == 4
  assert h["compute/generated_tokens"] == h["compute/trained_tokens"] == h["loss_tokens"]
  # n tokens of an episode are n - 1 predicted positions of the batch.
  assert (h["compute/prompt_tokens"] + h["compute/generated_tokens"]
          == h["batch/real_positions"] + h["compute/episodes"])
  assert np.isfinite(h["entropy"]) and h["grad_norm"] == 0.0
  # A zero gradient still takes an AdamW step (decay): the parameters moved, and were saved.
  assert not np.array_equal(before, np.asarray(trainer.params["norm"]["weight"][...]))
  assert [r["step"] for r in read_jsonl(str(tmp_path / "log"))] == [1]
  assert ckpt.Checkpointer(ckpt.CheckpointConfig(directory=str(tmp_path / "ck"))).all_steps() == [1]


class _FailsOddRollouts:
  """The scripted expert, except that in `scenario` every rollout with an odd seed answers
  without code: its groups (consecutive rollout seeds) always mix success and failure, while
  every other scenario's groups succeed throughout (zero advantage)."""

  def __init__(self, root, tokenizer, scenario):
    self._expert = ScriptedPolicy(root, tokenizer)
    self._tok = tokenizer
    self._scenario = scenario

  def session(self, context):
    if context.scenario == self._scenario and (context.seed // 1000) % 2:
      return TextTurnsSession(["I cannot do this task."] * 20, self._tok)
    return self._expert.session(context)


@pytest.mark.slow
def test_dynamic_sampling_redraws_chains_without_signal(tmp_path):
  root = appworld.ensure_mini_world()
  tok = Tokenizer()
  scenarios = appworld.group_by_scenario(appworld.read_split(root, "train"))
  steady, mixed = sorted(scenarios)[:2]
  config = rollout.RolloutConfig(chain_length=2, group_size=2, max_redraws=2)
  with appworld.EnvPool(appworld_fixtures.pool_config(
      root, str(tmp_path / "outputs"),
      max_output_chars=appworld.EnvPoolConfig.max_output_chars)) as pool:
    ctx = rollout.RolloutContext(_FailsOddRollouts(root, tok, mixed), pool, tok,
                                 AgentConfig(max_steps=2), Retriever(), root)
    # Two scenarios, two chains: the first draw has one chain of each and keeps the mixed
    # scenario's; the second draws only the one chain still missing (at this seed the mixed
    # scenario's) and completes the two chains with a signal.
    run = rl_loop.appworld_rollout(ctx, scenarios[steady] + scenarios[mixed], config,
                                   rewards.RewardConfig(), num_chains=2)
    episodes, values = run(0, 1)
    assert values["sampling/draws"] == 2 and values["sampling/kept_chains"] == 2
    assert {appworld.scenario_id(e.task_id) for e in episodes} == {mixed}
    assert len(episodes) == 2 * 2 * 2 and all(e.advantage != 0 for e in episodes)
    assert len({e.group for e in episodes}) == 2  # group ids stay unique across draws
    # What was sampled, not only what is trained on: 2 + 1 chains x G x K episodes, the
    # steady scenario's chain all successes (2 constant groups), the mixed ones' half.
    assert values["compute/episodes"] == 12 and values["constant_groups"] == 2
    assert values["rollout/tgc"] == pytest.approx(100 * 8 / 12)
    assert values["episodes"] == 12 and values["success"] == pytest.approx(8 / 12)
    assert values["num_env_failures"] == values["num_rewards_unknown"] == 0
    assert values["rollout/reward/pos0"] < 2.0
    # Only chains without a signal: every draw is spent and the step trains on nothing.
    run = rl_loop.appworld_rollout(ctx, scenarios[steady], config, rewards.RewardConfig(),
                                   num_chains=1)
    trainer = rl_loop.grpo_trainer(init_model(get_preset("tiny"), seed=0))
    result = rl_loop.run_rl(trainer, rollout=run, config=rl_loop.RLLoopConfig(total_steps=1),
                            metrics=MetricsConfig(log_dir=str(tmp_path / "log"),
                                                  progress=False))
  (h,) = result.history
  assert h["sampling/draws"] == 3 and h["sampling/kept_chains"] == 0
  assert h["episodes"] == 12 and h["updates"] == 0 and h["compute/episodes"] == 12
  assert h["success"] == 1.0 and "advantage/zero_frac" not in h  # sampled; nothing trained
