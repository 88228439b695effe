"""SAGE learns on AppWorld: the README's main job raises the skill use of its training chains,
which the Skill-integrated Reward pays for, by a margin well outside the run-to-run noise of a
policy that does not learn, and keeps their sampled success at the SFT policy's level or above.

The run is the README's main job at seed 0 without its evaluations and export (its SFT data
made once for the test session: the same bytes as a run's own, tests/test_demo.py): SFT to
convergence (320 steps) on the gold trajectories of 3 mini-world training scenarios, whose
later tasks are shown both calling the library's skill and writing it again, then 10 SAGE
steps of 3 whole-scenario chains x 4 rollouts at temperature 0.8 on the real path (sampler,
AppWorld worker pool and scoring, Skill-integrated Reward, GRPO update). Measured on the
episodes each step samples: skill use (`rollout/later_skill_usage_rate`: tasks at chain
positions > 0 that called a library skill) and success (`rollout/tgc`).

The reference is the SFT policy itself: the same run at learning rate 0 ("frozen": every
step samples the policy SFT left) samples SFT_SKILL_USE and SFT_SUCCESS over the last 8 of its
10 steps (seed 0, measured on the 2-core AMD EPYC of BENCHMARKS.md: .599 and .795), with a
per-step standard deviation of .10 (skill use) and .09 (success): a step samples 3 chains x 4
rollouts, and a chain whose first task fails rarely solves the later ones. Over 8 steps that
is about .037 and .033. The test averages the last 8 of the 10 steps (the first 2 are the
warm-up of the learning rate) and asks for skill use SKILL_USE_MARGIN (3.3 standard
deviations of that mean) above the SFT policy's, and for success no lower than
SUCCESS_TOLERANCE (about one standard deviation) below the SFT policy's. The run measures
.773 and .808 there (BENCHMARKS.md, "Learning on the mini AppWorld").

Why skill use and not success: a run's trajectory depends on the CPU (XLA:CPU rounds
differently with other vector instructions). Skill use rose over the frozen policy at every
SFT seed on both CPUs measured; success rose at some seeds and CPUs and stayed at the frozen
policy's at others (seed 0 here: .808 against .795), so a success margin would test the CPU
and the seed, not the method.

What fails it: an update that does not learn (the frozen run), or one that breaks the sharp
SFT policy: 4 updates at 3e-4 without warm-up took success from .78 to .32 in one step, and
with the warm-up 3e-4 took it from .70 to .27 at step 10 (last 8 steps: .675 skill use, .713
success).
"""

import json
import os
import statistics
import subprocess
import sys

import pytest

from tests.appworld_fixtures import demo_expert_file  # noqa: F401 - pytest fixture
from tests.appworld_fixtures import mini_root  # noqa: F401 - pytest fixture

pytestmark = [pytest.mark.slow, pytest.mark.long]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_DEVICE = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}

# The SFT policy's sampled skill use and success (frozen runs), the margin asked above the
# first and the tolerance below the second.
SFT_SKILL_USE, SFT_SUCCESS = 0.60, 0.79
SKILL_USE_MARGIN, SUCCESS_TOLERANCE = 0.12, 0.04
LAST = 8


def test_sage_raises_skill_use_and_keeps_success_on_its_training_chains(
    tmp_path, demo_expert_file):  # noqa: F811
  workdir = tmp_path / "run"
  done = subprocess.run(
      [sys.executable, "-m", "sage_jax.train", "--config=configs/sage.py:demo",
       f"--workdir={workdir}", "--config.pipeline.eval_before=false",
       "--config.pipeline.eval_after=false", "--config.pipeline.eval_train=false",
       "--config.pipeline.export=false", "--config.pipeline.plot=false",
       f"--config.pipeline.expert_trajectories={demo_expert_file}"],
      cwd=REPO, capture_output=True, text=True, timeout=2400, env=ONE_DEVICE)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  assert [r["step"] for r in rows] == list(range(1, 11))
  assert all(r["grad_norm"] > 0 for r in rows)  # every step trained on a learning signal

  success = [r["rollout/tgc"] / 100 for r in rows]
  use = [r["rollout/later_skill_usage_rate"] / 100 for r in rows]
  assert statistics.mean(use[-LAST:]) >= SFT_SKILL_USE + SKILL_USE_MARGIN, use
  assert statistics.mean(success[-LAST:]) >= SFT_SUCCESS - SUCCESS_TOLERANCE, success
