"""SAGE on AppWorld, the README's main job: every RL step trains on a learning signal, and
the updates keep the SFT policy working (no collapse).

The run is the README's main job at seed 0 without its evaluations and export: SFT (160
steps on the gold trajectories of 3 mini-world training scenarios), then 12 SAGE steps of
3 whole-scenario chains x 4 rollouts at temperature 0.6 on the real path (sampler, AppWorld
worker pool and scoring, Skill-integrated Reward, GRPO update). Measured on the episodes each
step samples.

What this does not check, and why: that SAGE raises the sampled success beyond run-to-run
noise. At this scale it does not, reliably (BENCHMARKS.md, "Learning on the mini AppWorld").
The SFT policy the run starts from is chaotic in the SFT's numerics: the same config at
seed 0 started RL at 39% sampled success before the fused LM head and the blocked-attention
layout (commits 6f178d4, 5a79921; gradients equal to 1.7e-6), at 79% after them and at 67%
after the attention backward's next change; between 140 and 160 SFT steps the start moves
from 7% to 79%. From the 39% start SAGE gained +.25 and +.21 (last 4 steps minus first 2,
two rollout seeds) against +.06 and +.10 for a frozen control (the same run at learning
rate 0); from the 79% start it went .83 -> .66; at temperature 0.8 (start 25%) SAGE tracked
the frozen control step for step within its noise (per-step standard deviation .12). An SFT run to convergence starts every seed alike (12%
sampled at temperature 1), but SAGE did not sharpen that policy in 12 steps either. A margin
that passes only at one SFT endpoint tests float rounding, not learning.

What it checks: every step has a non-zero gradient (a chain without signal is redrawn), and
the last 4 steps' success and skill use stay within COLLAPSE_MARGIN of the first 2 steps'
(3 spreads of the statistic below zero; the runs above stayed within .17). Learning rates
that do collapse the policy fail it: from the 39% start one step at 1e-3 dropped the sampled
success to 3%.
"""

import json
import os
import statistics
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_DEVICE = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}

# Fraction of sampled tasks (skill use: of tasks at chain positions > 0) by which the last 4
# steps may fall below the first 2.
COLLAPSE_MARGIN = 0.3


def test_sage_trains_every_step_and_keeps_the_policy_working(tmp_path):
  workdir = tmp_path / "run"
  done = subprocess.run(
      [sys.executable, "-m", "sage_jax.train", "--config=configs/sage.py:demo",
       f"--workdir={workdir}", "--config.pipeline.eval_before=false",
       "--config.pipeline.eval_after=false", "--config.pipeline.export=false",
       "--config.pipeline.plot=false"],
      cwd=REPO, capture_output=True, text=True, timeout=2400, env=ONE_DEVICE)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  assert [r["step"] for r in rows] == list(range(1, 13))
  assert all(r["grad_norm"] > 0 for r in rows)  # every step trained on a learning signal

  def gain(key):
    values = [r[key] / 100 for r in rows]
    return statistics.mean(values[-4:]) - statistics.mean(values[:2]), values

  success_gain, success = gain("rollout/tgc")
  use_gain, use = gain("rollout/later_skill_usage_rate")
  assert success_gain >= -COLLAPSE_MARGIN, success
  assert use_gain >= -COLLAPSE_MARGIN, use
