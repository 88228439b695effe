"""Per-step metrics to JSONL and TensorBoard, and a console progress bar.

`metrics.jsonl` holds one JSON object per step (`{"step": s, "time": ..., <name>: value}`),
`s` counting completed steps (1 = after the first update). A run resumed after `start_step`
completed steps first drops the lines of later steps, which it will redo (TensorBoard purges
them too), so the logs of an interrupted + resumed run read like those of a straight run; what
it logs at `start_step` itself (an evaluation the interrupted run owed) joins that step's line.
With several processes only process 0 writes (the values it gets are already global).
In a remote log_dir (gs://...), both files are written locally and copied up whole after each
step (`storage.LocalMirror`): a bucket cannot append.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import sys
import time
from typing import Any, Mapping

import jax
import numpy as np

from sage_jax import multihost, storage
from sage_jax.train import tensorboard

METRICS_FILE = "metrics.jsonl"


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
  """log_dir: where metrics.jsonl and TensorBoard events go ("" = no files).
  jsonl / tensorboard: which sinks. progress: a console progress bar (stderr).
  progress_keys: metrics shown on the bar (those present)."""

  log_dir: str = ""
  jsonl: bool = True
  tensorboard: bool = True
  progress: bool = True
  progress_keys: tuple[str, ...] = ("reward/mean", "success", "loss", "grad_norm",
                                    "clip_frac", "tokens_per_s")


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
  """The finite-or-not float scalars of `metrics` (device arrays fetched, others dropped)."""
  out = {}
  for k, v in metrics.items():
    try:
      arr = np.asarray(v)
    except Exception:
      continue
    if arr.shape == () and arr.dtype.kind in "biuf":
      out[k] = float(arr)
  return out


def memory_metrics() -> dict[str, float]:
  """Peak memory of the run so far in GiB, the largest of any process: the host's resident set
  (`memory/host_peak_gib`, what a CPU run or the host of an accelerator holds) and, where the
  devices report it, the largest local device's (`memory/device_peak_gib`). A collective."""
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  host = rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux
  device = max((d.memory_stats() or {}).get("peak_bytes_in_use", -1)
               for d in jax.local_devices())
  host, device = multihost.allgather(np.asarray([host, device], np.float64)).max(0) / 2**30
  out = {"memory/host_peak_gib": float(host)}
  if device >= 0:
    out["memory/device_peak_gib"] = float(device)
  return out


def _kept_lines(path, start_step: int) -> list[str]:
  """The lines of metrics file `path` up to step `start_step` (a line cut by a kill dropped)."""
  if not path.exists():
    return []
  kept = []
  for line in path.read_text().splitlines(keepends=True):
    try:
      if line.strip() and json.loads(line).get("step", -1) <= start_step:
        kept.append(line)
    except json.JSONDecodeError:
      continue
  return kept


class MetricsWriter:
  """Writes a dict of scalars per step to every configured sink."""

  def __init__(self, config: MetricsConfig = MetricsConfig(), *, total_steps: int | None = None,
               start_step: int = 0, description: str = "train"):
    self.config = config
    self._jsonl = None
    self._tb = None
    self._bar = None
    self._mirror = None
    self._kept: list[str] = []  # the resumed file's lines, while start_step's may still grow
    self._start_step = start_step
    lead = multihost.is_lead()
    if config.log_dir and lead:
      self._mirror = storage.LocalMirror(config.log_dir)
      if config.jsonl:
        self._path = os.path.join(self._mirror.local, METRICS_FILE)
        self._kept = _kept_lines(self._mirror.target / METRICS_FILE, start_step)
        storage.write_text(self._path, "".join(self._kept))
        self._jsonl = open(self._path, "a")
      if config.tensorboard:
        # Steps after start_step are redone: TensorBoard drops their earlier events (also a
        # run's that started over from step 0, killed before its first checkpoint).
        earlier = (self._mirror.target / "tb").exists() and any(
            (self._mirror.target / "tb").iterdir())
        self._tb = tensorboard.ScalarWriter(
            os.path.join(self._mirror.local, "tb"),
            purge_step=start_step + 1 if start_step or earlier else None)
    if config.progress and lead:
      from tqdm import tqdm
      self._bar = tqdm(total=total_steps, initial=start_step, desc=description,
                       dynamic_ncols=True, file=sys.stderr)

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
    """Logs the scalars of `metrics` at `step`; returns them."""
    values = scalars(metrics)
    if self._jsonl is not None:
      record = {"step": int(step), "time": time.time()}
      record.update({k: (v if math.isfinite(v) else str(v)) for k, v in values.items()})
      if step == self._start_step and self._kept and (
          (last := json.loads(self._kept[-1])).get("step") == step):
        self._jsonl.close()  # one line per step: the step's earlier line takes the new values
        record = {**last, **record}
        storage.write_text(self._path, "".join(self._kept[:-1]))
        self._jsonl = open(self._path, "a")
      self._kept = []
      self._jsonl.write(json.dumps(record, sort_keys=True) + "\n")
      self._jsonl.flush()
    if self._tb is not None:
      self._tb.write(step, {k: v for k, v in values.items() if math.isfinite(v)})
    if self._mirror is not None:
      self._mirror.sync()
    return values

  def progress(self, step: int, values: Mapping[str, float]) -> None:
    """Advances the bar to `step` (completed steps) with the key numbers."""
    if self._bar is None:
      return
    shown = {(k[:-5] if k.endswith("/mean") else k): f"{values[k]:.4g}"
             for k in self.config.progress_keys if k in values}
    self._bar.set_postfix(shown, refresh=False)
    self._bar.update(step - self._bar.n)

  def close(self) -> None:
    if self._jsonl is not None:
      self._jsonl.close()
      self._jsonl = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if self._bar is not None:
      self._bar.close()
      self._bar = None
    if self._mirror is not None:
      self._mirror.close()
      self._mirror = None


def read_jsonl(log_dir: str) -> list[dict]:
  """The records of `log_dir/metrics.jsonl`."""
  text = (storage.path(log_dir) / METRICS_FILE).read_text()
  return [json.loads(line) for line in text.splitlines() if line.strip()]
