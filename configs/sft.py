"""SFT only: expert trajectories in the skill-library format (from the gold solutions unless
`pipeline.expert_trajectories` names a JSONL file), then dev evaluation and HF export."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sage  # noqa: E402  (configs/sage.py)


def get_config(preset: str = "demo"):
  c = sage.get_config(preset)
  c.pipeline.stages = ("sft",)
  return c
