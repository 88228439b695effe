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
      f.write(json.dumps({"step": s, "reward/mean_pos1": offset + 0.1 * s,
                          "reward/mean_pos2": offset + 0.05 * s, "batch/tgc": 0.1 * s,
                          "steps/mean": 5 - 0.1 * s, "tokens/generated_mean": 100 + s,
                          "skill/usage_rate": 0.02 * s, "loss": 1.0 / (s + 1),
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
      "reward per chain position", "task / scenario success", "interaction steps",
      "generated tokens", "skill usage", "loss"}


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
