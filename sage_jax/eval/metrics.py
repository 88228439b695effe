"""Evaluation metrics over task episode records, and their markdown table.

TGC: share of tasks whose tests all pass. SGC: share of scenarios all of whose tasks pass.
Steps: assistant turns per task. Generated tokens: model tokens per task. Skill usage rate:
share of tasks that saw at least one library skill and used one (`skill_usage_rate_all_tasks`:
share of all tasks that used one). Success given skill use:
TGC over the tasks that used a library skill. No-code rate: share of tasks with a response
without code. All rates in percent. Per difficulty: the same over the tasks of that AppWorld
difficulty (SGC over scenarios whose tasks all have it).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from collections.abc import Sequence

from sage_jax.rl.episode import EpisodeRecord


def _pct(num: float, den: float) -> float | None:
  return 100.0 * num / den if den else None


def _mean(values: Sequence[float]) -> float | None:
  return sum(values) / len(values) if values else None


def summarize(records: Sequence[EpisodeRecord]) -> dict:
  scenarios = collections.defaultdict(list)
  for r in records:
    scenarios[r.scenario].append(r.success)
  with_library = [r for r in records if r.visible_skills]
  users = [r for r in records if r.used_skill]
  return {
      "num_tasks": len(records),
      "num_scenarios": len(scenarios),
      "tgc": _pct(sum(r.success for r in records), len(records)),
      "sgc": _pct(sum(all(v) for v in scenarios.values()), len(scenarios)),
      "avg_steps": _mean([r.num_steps for r in records]),
      "avg_generated_tokens": _mean([r.generated_tokens for r in records]),
      "skill_usage_rate": _pct(sum(r.used_skill for r in with_library), len(with_library)),
      "skill_usage_rate_all_tasks": _pct(len(users), len(records)),
      "success_given_skill_use": _pct(sum(r.success for r in users), len(users)),
      "no_code_rate": _pct(sum(r.no_code for r in records), len(records)),
      "avg_fraction_passed": _mean([r.fraction_passed for r in records]),
      "skills_generated": sum(len(r.events.generated) for r in records),
      "skills_updated": sum(len(r.events.updated) for r in records),
      "env_errors": sum(bool(r.errors) for r in records),
      "end_reasons": dict(collections.Counter(r.end_reason for r in records)),
  }


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
            ("success given skill use %", "success_given_skill_use", "{:.1f}"),
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
