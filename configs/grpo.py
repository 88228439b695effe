"""The paper's GRPO baseline: single-task rollouts (K=1), no skill library, outcome reward.

Same presets, model and scale as configs/sage.py; only the method differs.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sage  # noqa: E402  (configs/sage.py)


def get_config(preset: str = "demo"):
  c = sage.get_config(preset)
  c.grpo.single_task = True
  c.grpo.chain_length = 1
  c.agent.use_library = False
  c.retrieval.strategy = "none"
  c.reward.variant = "outcome"
  c.expert.use_library = False
  return c
