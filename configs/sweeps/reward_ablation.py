"""Reward ablation of the paper: outcome-only vs chain-based vs Skill-integrated Reward.

All three use the same Sequential Rollout; only the reward differs.
"""


def get_sweep(preset: str = "qwen2.5-7b"):
  return {
      "config": f"configs/sage.py:{preset}",
      "axes": [{
          "outcome_only": {"reward.variant": "outcome"},
          "chain_based": {"reward.variant": "chain"},
          "skill_integrated": {"reward.variant": "sage"},
      }],
  }
