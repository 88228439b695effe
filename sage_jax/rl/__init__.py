"""Reinforcement learning: sequential rollout, rewards, advantages, the GRPO loss, batching.

Import the submodules directly (`sage_jax.rl.grpo`, `sage_jax.rl.batch`, ...).
"""
