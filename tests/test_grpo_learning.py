"""Learning proof: a tiny Qwen2 trained with our GRPO (sampling through the project's engine,
real group-relative advantages, the RL loop) raises its mean reward on a checkable synthetic
task from below 0.2 to above 0.8 within a fixed step budget."""

import numpy as np

from sage_jax.model import get_preset, init_model
from sage_jax.rl import batch as B
from sage_jax.rl import grpo
from sage_jax.sampler import Engine, EngineConfig
from sage_jax.train import rl_loop
from sage_jax.train.metrics import MetricsConfig
from sage_jax.train.optimizer import OptimizerConfig
from sage_jax.train.synthetic import SyntheticTask, SyntheticTaskConfig

VOCAB = 16
STEPS = 60


def test_grpo_raises_reward_from_below_02_to_above_08(tmp_path):
  # Answer "3 1 4" to every prompt; reward = half the share of right positions + half for the
  # exact answer. A random policy scores ~0.03.
  task_config = SyntheticTaskConfig(vocab_size=VOCAB, task="fixed", target=(3, 1, 4),
                                    answer_eos=False, num_prompts=8, group_size=16)
  model = init_model(get_preset("tiny").replace(vocab_size=VOCAB), seed=0)
  slots = task_config.num_prompts * task_config.group_size
  engine = Engine(model, EngineConfig(num_slots=slots, max_len=16, prefill_buckets=(8,),
                                      min_attend=16, steps_per_call=4, max_top_k=4),
                  eos_ids=[VOCAB - 1])
  task = SyntheticTask(engine, task_config)
  config = grpo.GRPOConfig()  # the paper's default: strictly on-policy, token-mean, no KL
  # 2e-3: at init seeds 0-7 the last 5 steps averaged 0.91-0.96 and every final greedy dev
  # reward was 1.0. At 3e-3 the nearly deterministic policy of the late steps took gradient
  # spikes (norms 17-19 at 3 of 4 seeds) and, on some CPUs, fell apart at the last step.
  trainer = rl_loop.grpo_trainer(model, config, OptimizerConfig(learning_rate=2e-3,
                                                                weight_decay=0.0))
  result = rl_loop.run_rl(
      trainer, rollout=task.rollout, score=task.score, evaluate=task.evaluate,
      sync_params=engine.update_params,
      config=rl_loop.RLLoopConfig(total_steps=STEPS, eval_every=20, seed=0), grpo_config=config,
      batch_config=B.BatchConfig(micro_batch_tokens=1024, num_micro_batches=2,
                                 length_buckets=(8,)),
      metrics=MetricsConfig(log_dir=str(tmp_path), progress=False))
  rewards = [h["reward/mean"] for h in result.history]
  assert len(rewards) == STEPS
  assert rewards[0] < 0.2, rewards[:3]
  assert np.mean(rewards[-5:]) > 0.8, rewards
  assert result.history[-1]["dev/reward"] > 0.8  # greedy answers on held-out prompts
  assert trainer.num_compiled == 1  # one shape for the whole run
  # The update really was on-policy: pi_theta == pi_old at the start of every update.
  assert all(abs(h["ratio_mean"] - 1) < 1e-4 for h in result.history)
