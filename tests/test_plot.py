"""Plots from metrics files: one run, and a sweep's comparison."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from sage_jax import plot


def _write_run(path, steps, offset=0.0):
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, plot.METRICS_FILE), "w") as f:
    for s in range(steps):
      f.write(json.dumps({"step": s, "reward/pos0/mean": offset + 0.1 * s,
                          "reward/pos1/mean": offset + 0.05 * s, "rollout/tgc": 10.0 * s,
                          "steps/mean": 5 - 0.1 * s, "generated_tokens/mean": 100 + s,
                          "rollout/skill_usage_rate": 2.0 * s, "loss": 1.0 / (s + 1),
                          "time/update_s": 1.0}) + "\n")
    f.write('{"step": 99, "rew')  # a run killed mid-write leaves a partial line


def test_plot_run_writes_a_png_with_every_panel(tmp_path):
  _write_run(tmp_path / "run", 6)
  out = plot.plot_run(str(tmp_path / "run"))
  assert out == str(tmp_path / "run" / "plots" / "training.png")
  image = np.asarray(Image.open(out).convert("L"))
  assert image.shape[0] > 300 and image.shape[1] > 1000
  assert image.std() > 10  # not a blank canvas
  assert set(plot._panels(plot._series(plot.read_metrics(str(tmp_path / "run"))))) == {
      "reward", "task / scenario success (%)", "interaction steps per task",
      "generated tokens per task", "skill usage (%)", "loss"}


def test_plot_run_is_titled_with_the_run(tmp_path, monkeypatch):
  _write_run(tmp_path / "run", 3)
  titles = []
  monkeypatch.setattr(plot, "_save", lambda fig, title, out: titles.append(title) or out)
  plot.plot_run(str(tmp_path / "run"))
  plot.plot_run(str(tmp_path / "run"), title="run: SFT")
  assert titles == ["run", "run: SFT"]  # not the last panel's title


def test_a_panel_holds_one_unit_and_leads_with_a_per_task_headline():
  """Percentages apart from fractions, counts from rates, tokens per task from tokens per
  step; a sweep compares runs on a per-task quantity (a run of K=3 tasks per chain makes 3x
  the tokens per step of K=1 at the same tokens per task)."""
  keys = ["success", "success/pos0", "rollout/tgc", "rollout/chain_success", "dev/tgc",
          "rollout/skills_generated", "rollout/later_skill_usage_rate",
          "rollout/p_success_given_use", "rollout/success_skill_usage_rate",
          "generated_tokens/mean", "generated_tokens/total", "compute/generated_tokens",
          "rollout/avg_generated_tokens", "reward/mean", "rollout/reward"]
  panels = plot._panels(keys)
  assert panels["task / scenario success (%)"] == ["dev/tgc", "rollout/chain_success",
                                                   "rollout/tgc"]
  assert panels["success (fraction of episodes)"] == ["success", "success/pos0"]
  assert panels["skill usage (%)"][0] == "rollout/later_skill_usage_rate"
  assert set(panels["skill usage (%)"]) == {
      "rollout/later_skill_usage_rate", "rollout/p_success_given_use",
      "rollout/success_skill_usage_rate"}
  assert panels["skills saved (count)"] == ["rollout/skills_generated"]
  assert panels["generated tokens per task"] == ["rollout/avg_generated_tokens",
                                                 "generated_tokens/mean"]
  assert panels["tokens per step"] == ["compute/generated_tokens", "generated_tokens/total"]
  assert panels["reward"][0] == "rollout/reward"


def test_plot_run_command(tmp_path):
  _write_run(tmp_path / "run", 3)
  out = subprocess.run([sys.executable, "-m", "sage_jax.plot", f"--workdir={tmp_path}/run"],
                       capture_output=True, text=True, check=True, timeout=120)
  assert out.stdout.strip() == f"{tmp_path}/run/plots/training.png"
  assert os.path.getsize(out.stdout.strip()) > 10_000


def test_plot_sweep_command(tmp_path):
  for i, name in enumerate(["outcome_only", "skill_integrated"]):
    _write_run(tmp_path / "sweep" / name, 4, offset=i)
  out = subprocess.run([sys.executable, "-m", "sage_jax.plot", f"--sweep_root={tmp_path}/sweep"],
                       capture_output=True, text=True, check=True, timeout=120)
  assert out.stdout.strip() == f"{tmp_path}/sweep/comparison.png"
  assert os.path.getsize(out.stdout.strip()) > 10_000


def test_missing_metrics_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="metrics.jsonl does not exist"):
    plot.plot_run(str(tmp_path))


def test_every_stage_that_logged_is_plotted(tmp_path):
  """An SFT-only run (configs/sft.py) logs under sft/: its curves are drawn too."""
  run = tmp_path / "run"
  os.makedirs(run / "sft")
  with open(run / "sft" / plot.METRICS_FILE, "w") as f:
    for s in range(1, 5):
      f.write(json.dumps({"step": s, "loss": 2.0 / s, "loss_tokens": 300.0}) + "\n")
  assert plot.plot_stages(str(run)) == [str(run / "plots" / "sft.png")]
  _write_run(run, 3)  # then RL
  assert plot.plot_stages(str(run)) == [str(run / "plots" / "training.png"),
                                        str(run / "plots" / "sft.png")]
  assert plot.plot_stages(str(tmp_path / "empty")) == []
  out = subprocess.run([sys.executable, "-m", "sage_jax.plot", f"--workdir={tmp_path}/empty"],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode != 0 and "Traceback" not in out.stderr
  assert "neither metrics.jsonl nor sft/metrics.jsonl" in out.stderr


def test_a_count_of_unknown_rewards_is_not_drawn_as_a_reward():
  panels = plot._panels(["reward/mean", "num_rewards_unknown"])
  assert panels == {"reward": ["reward/mean"]}
