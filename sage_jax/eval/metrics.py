"""Evaluation metrics over task episode records (`rl.metrics`, per scenario), per
difficulty (SGC over scenarios whose tasks all have it), and their markdown table."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from collections.abc import Sequence

from sage_jax.rl.episode import EpisodeRecord
from sage_jax.rl.metrics import task_metrics


def summarize(records: Sequence[EpisodeRecord]) -> dict:
  return {**task_metrics(records, unit="scenario"),
          "end_reasons": dict(collections.Counter(r.end_reason for r in records))}


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
            ("P(success | use) %", "p_success_given_use", "{:.1f}"),
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


def appworld_scores(outputs_root: str, experiment: str, task_ids: Sequence[str]) -> dict:
  """AppWorld's own evaluation of an experiment's saved outputs (TGC, SGC in percent), run in
  a child process so that this one never imports appworld."""
  code = (
      "import json, sys, logging\n"
      "logging.disable(logging.WARNING)\n"
      "from appworld.evaluator import evaluate_tasks\n"
      "m = evaluate_tasks(json.loads(sys.argv[1]), experiment_name=sys.argv[2],"
      " include_details=True, save_reports=False)\n"
      "sys.__stdout__.write('METRICS' + json.dumps(m['aggregate']))\n")
  done = subprocess.run([sys.executable, "-c", code, json.dumps(list(task_ids)), experiment],
                        capture_output=True, text=True,
                        env=dict(os.environ, APPWORLD_ROOT=outputs_root))
  if done.returncode != 0 or "METRICS" not in done.stdout:
    raise RuntimeError(f"AppWorld's evaluation failed:\n{(done.stdout + done.stderr)[-3000:]}")
  return json.loads(done.stdout.rpartition("METRICS")[2])
