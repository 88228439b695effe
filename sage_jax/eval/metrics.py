"""Evaluation metrics over task episode records (`rl.metrics`, per scenario), per
difficulty (SGC over scenarios whose tasks all have it), and their markdown table."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from collections.abc import Sequence

from sage_jax.envs.appworld.config import EnvPoolConfig
from sage_jax.envs.appworld.process import child_environment
from sage_jax.rl.episode import EpisodeRecord
from sage_jax.rl.metrics import PER_POSITION, task_metrics


def summarize(records: Sequence[EpisodeRecord]) -> dict:
  return {**task_metrics(records, unit="scenario"),
          "end_reasons": dict(collections.Counter(r.end_reason for r in records))}


def reported_numbers() -> list[str]:
  """The numbers an evaluation reports (`summarize`'s, without the per-position rates)."""
  return [k for k, v in summarize([]).items() if not isinstance(v, dict)]


def reports(name: str) -> bool:
  """Whether an evaluation reports a number called `name` ("tgc", "no_code_rate/pos1")."""
  rate, _, position = name.rpartition("/pos")
  return name in reported_numbers() or (rate in PER_POSITION and position.isdigit())


def evaluation_metrics(records: Sequence[EpisodeRecord]) -> dict:
  """Overall metrics and the same per difficulty."""
  by_difficulty = collections.defaultdict(list)
  for r in records:
    by_difficulty[r.difficulty].append(r)
  return {
      "overall": summarize(records),
      "by_difficulty": {str(d): summarize(rs) for d, rs in
                        sorted(by_difficulty.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))},
  }


_COLUMNS = (("tasks", "num_tasks", "{:d}"), ("TGC", "tgc", "{:.1f}"), ("SGC", "sgc", "{:.1f}"),
            ("steps", "avg_steps", "{:.2f}"), ("gen. tokens", "avg_generated_tokens", "{:.0f}"),
            ("skill use %", "skill_usage_rate", "{:.1f}"),
            ("success skill use %", "success_skill_usage_rate", "{:.1f}"),
            ("P(success given use) %", "p_success_given_use", "{:.1f}"),  # no "|" in a cell
            ("no-code %", "no_code_rate", "{:.1f}"))


def markdown_table(metrics: dict, title: str = "") -> str:
  rows = [("all", metrics["overall"])]
  rows += [(f"difficulty {d}", m) for d, m in metrics["by_difficulty"].items()]
  head = "| subset | " + " | ".join(c for c, _, _ in _COLUMNS) + " |"
  lines = [f"### {title}\n" if title else "", head, "|" + "---|" * (len(_COLUMNS) + 1)]
  for name, m in rows:
    cells = ["-" if m[key] is None else fmt.format(m[key]) for _, key, fmt in _COLUMNS]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(l for l in lines if l) + "\n"


def appworld_scores(outputs_root: str, experiment: str, task_ids: Sequence[str],
                    evaluation_timeout_s: float = EnvPoolConfig.evaluation_timeout_s) -> dict:
  """AppWorld's own evaluation of an experiment's saved outputs (TGC, SGC in percent), run in
  a child process so that this one never imports appworld.

  Each task's saved state is evaluated as the pool evaluates it (checked, confined, within
  `evaluation_timeout_s`; sage_jax/envs/appworld/evaluation.py): the outputs were written by
  agent code. A refused state counts as a failed task.
  """
  command = [sys.executable, "-m", "sage_jax.envs.appworld.evaluation", outputs_root,
             experiment, json.dumps(list(task_ids)), str(evaluation_timeout_s)]
  # Each task is bounded by its own limit; this one only guards against the child hanging.
  limit = 120 + len(task_ids) * (evaluation_timeout_s + 5)
  try:
    done = subprocess.run(command, capture_output=True, text=True, timeout=limit,
                          env=child_environment(APPWORLD_ROOT=outputs_root))
  except subprocess.TimeoutExpired as e:
    raise RuntimeError(f"AppWorld's evaluation did not end within {limit:g} s") from e
  if done.returncode != 0 or "METRICS" not in done.stdout:
    raise RuntimeError(f"AppWorld's evaluation failed:\n{(done.stdout + done.stderr)[-3000:]}")
  return json.loads(done.stdout.rpartition("METRICS")[2])
