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
  c.agent.use_library = False  # the SFT data is played as this agent too: no library
  c.retrieval.strategy = "none"
  c.reward.variant = "outcome"
  return c
