"""Training curves and sweep comparisons as PNG files.

  python -m sage_jax.plot --workdir=RUN            # RUN/plots/training.png (RL), sft.png (SFT)
  python -m sage_jax.plot --sweep_root=SWEEP_DIR   # SWEEP_DIR/comparison.png over its runs

Reads the per-step metrics (`metrics.jsonl`: one JSON object per line with a "step") that the
training loops write: RL's in the run's workdir, SFT's in its sft/ directory. RUN and
SWEEP_DIR may be remote (gs://...; `sage_jax.storage`). Panels group metrics by name, so new
metrics appear without edits here.
"""

from __future__ import annotations

import io
import json
import math
import os
from typing import Iterable

from absl import app, flags

from sage_jax import storage

METRICS_FILE = "metrics.jsonl"

# (title, substrings, headline candidates): a metric goes to the first panel whose substring
# it contains, so that one panel holds one unit (percentages, fractions, counts, tokens per
# episode or per step). A sweep compares runs on the first headline candidate they have: a
# per-task quantity, comparable across chain lengths and methods.
PANELS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("reward", ("reward",), ("rollout/reward", "reward/mean")),
    ("skill usage (%)", ("skill_usage", "p_success_given_use", "w_use_rate", "w_gen_rate"),
     ("dev/later_skill_usage_rate", "rollout/later_skill_usage_rate")),
    ("skills saved (count)", ("skills_generated", "skills_updated"), ()),
    ("task / scenario success (%)", ("tgc", "sgc", "chain_success"), ("dev/tgc", "rollout/tgc")),
    ("success (fraction of episodes)", ("success",), ("success",)),
    ("interaction steps per task", ("steps",), ("rollout/avg_steps", "steps/mean")),
    ("generated tokens per task", ("avg_generated_tokens", "generated_tokens/mean"),
     ("rollout/avg_generated_tokens", "generated_tokens/mean")),
    ("tokens per step", ("tokens",), ("compute/generated_tokens",)),
    ("loss", ("loss",), ("loss",)),
)
_EXCLUDE = ("tokens_per_s", "time", "rewards_unknown")  # the last: a count, not a reward
# A run's stages that log metrics: where, under its workdir, and the figure of each.
STAGE_PLOTS = (("", "training.png"), ("sft", "sft.png"))


def read_metrics(workdir: str) -> list[dict]:
  """All metric rows of a run, in file order (a partial last line is skipped)."""
  path = storage.path(workdir) / METRICS_FILE
  if not path.exists():
    raise FileNotFoundError(f"{path} does not exist: is {workdir!r} a training workdir?")
  rows = []
  for line in path.read_text().splitlines():
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return rows


def _series(rows: list[dict]) -> dict[str, tuple[list[float], list[float]]]:
  out: dict[str, tuple[list[float], list[float]]] = {}
  for row in rows:
    step = row.get("step")
    if step is None:
      continue
    for key, value in row.items():
      if key == "step" or not isinstance(value, (int, float)) or isinstance(value, bool):
        continue
      xs, ys = out.setdefault(key, ([], []))
      xs.append(step)
      ys.append(float(value))
  return out


def _panels(keys: Iterable[str]) -> dict[str, list[str]]:
  """Panel title -> its metrics, headline first."""
  panels: dict[str, list[str]] = {title: [] for title, _, _ in PANELS}
  for key in sorted(keys):
    low = key.lower()
    if any(x in low for x in _EXCLUDE):
      continue
    for title, needles, _ in PANELS:
      if any(n in low for n in needles):
        panels[title].append(key)
        break
  for title, _, headlines in PANELS:
    first = next((h for h in headlines if h in panels[title]), None)
    if first is not None:
      panels[title].remove(first)
      panels[title].insert(0, first)
  return {t: ks for t, ks in panels.items() if ks}


def _pyplot():
  """matplotlib on its file-only backend, imported when a figure is drawn (a run that imports
  this module to plot at its end does not pay for it at its start)."""
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  return plt


def _grid(n: int):
  plt = _pyplot()
  cols = min(3, n)
  rows = math.ceil(n / cols)
  fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
  for ax in list(axes.flat)[n:]:
    ax.axis("off")
  return fig, list(axes.flat)[:n]


def _save(fig, title: str, out_path: str) -> str:
  fig.suptitle(title)
  fig.tight_layout()
  png = io.BytesIO()
  fig.savefig(png, format="png", dpi=110)
  _pyplot().close(fig)
  out = storage.path(out_path)
  if not storage.is_remote(out):
    out.parent.mkdir(parents=True, exist_ok=True)
  out.write_bytes(png.getvalue())
  return out_path


def plot_stages(workdir: str) -> list[str]:
  """Writes the curves of each stage of the run that logged metrics (`STAGE_PLOTS`, under
  workdir/plots/); returns the PNG paths, none when no stage did."""
  root = storage.path(workdir)
  return [plot_run(os.fspath(root / stage), os.fspath(root / "plots" / figure),
                   title=f"{root.name}: {stage.upper()}" if stage else root.name)
          for stage, figure in STAGE_PLOTS if (root / stage / METRICS_FILE).exists()]


def plot_run(workdir: str, out_path: str | None = None, title: str | None = None) -> str:
  """Writes the curves of the metrics in `workdir` (default: to its plots/training.png);
  returns the PNG path."""
  series = _series(read_metrics(workdir))
  panels = _panels(series)
  if not panels:
    raise ValueError(f"{workdir}/{METRICS_FILE} holds no metrics to plot")
  fig, axes = _grid(len(panels))
  for ax, (panel, keys) in zip(axes, panels.items()):
    for key in keys:
      xs, ys = series[key]
      ax.plot(xs, ys, marker="o" if len(xs) < 20 else None, label=key)
    ax.set_title(panel)
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
  root = storage.path(workdir)
  return _save(fig, title or root.name, out_path or os.fspath(root / "plots" / "training.png"))


def plot_sweep(sweep_root: str, out_path: str | None = None) -> str:
  """Overlays the runs under `sweep_root` (each a workdir), one panel per metric group."""
  root = storage.path(sweep_root)
  runs = sorted(d.name for d in root.iterdir() if (d / METRICS_FILE).exists())
  if not runs:
    raise FileNotFoundError(f"{sweep_root}: no run directories with {METRICS_FILE}")
  per_run = {r: _series(read_metrics(os.fspath(root / r))) for r in runs}
  panels = _panels(set().union(*per_run.values()))
  fig, axes = _grid(len(panels))
  for ax, title in zip(axes, panels):
    key = panels[title][0]  # the panel's headline, compared across runs
    for run, series in per_run.items():
      if key in series:
        ax.plot(*series[key], label=run)
    ax.set_title(f"{title}: {key}")
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
  return _save(fig, root.name, out_path or os.fspath(root / "comparison.png"))


def main(argv):
  del argv
  if bool(FLAGS.workdir) == bool(FLAGS.sweep_root):
    raise app.UsageError("pass exactly one of --workdir and --sweep_root")
  if FLAGS.sweep_root:
    print(plot_sweep(FLAGS.sweep_root))
    return
  paths = plot_stages(FLAGS.workdir)
  if not paths:
    raise app.UsageError(f"{FLAGS.workdir}: neither {METRICS_FILE} nor sft/{METRICS_FILE}: is "
                         "it a training run's workdir?")
  print("\n".join(paths))


FLAGS = flags.FLAGS

if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "A training run's workdir.")
  flags.DEFINE_string("sweep_root", None, "A directory whose subdirectories are runs.")
  app.run(main)
