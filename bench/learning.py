r"""How much the demo's RL improves its policy on the training chains, against run-to-run noise,
for each reward variant; prints JSON.

  python bench/learning.py --seeds=0,1,2 --variants=sage,outcome --workdir=DIR [--steps=12]

Per seed, the demo's SFT runs once (`DIR/seed<s>/sft_only`, run seed `s`: initialisation,
data order, rollouts); each variant's RL then starts from a copy of it
(`DIR/seed<s>/<variant>`, `--config.reward.variant=<variant>`), so that variants of one seed
differ only in their reward. Each run evaluates the training scenarios greedily after SFT
and after RL (`pipeline.eval_train`). A run already finished in DIR is read, not rerun.

Reported per run: training-scenario TGC and later_skill_usage_rate (tasks at chain positions
> 0 that used a library skill) after SFT and after RL, the RL steps with a zero gradient or
no update, and the sampled reward (`rollout/reward`) of every step. Across seeds, per variant:
mean and sample std of each after-SFT and after-RL value and of its improvement over SFT.
"""

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Run seeds.")
_VARIANTS = flags.DEFINE_list("variants", ["sage", "outcome"], "reward.variant of each arm.")
_STEPS = flags.DEFINE_integer("steps", 12, "RL steps of every run.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the runs go (kept: reruns resume).")
_OVERRIDES = flags.DEFINE_list("overrides", [], "More --config.<key>=<value> for every run.")

METRICS = ("tgc", "later_skill_usage_rate")


def _pipeline(workdir: str, seed: str, *overrides: str) -> None:
  cmd = [sys.executable, "-m", "sage_jax.pipeline", "--config=configs/sage.py:demo",
         f"--workdir={workdir}", f"--config.seed={seed}",
         f"--config.rl.total_steps={_STEPS.value}",
         "--config.pipeline.eval_before=false", "--config.pipeline.export=false",
         "--config.pipeline.plot=false", *[f"--config.{o}" for o in _OVERRIDES.value],
         *overrides]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
  done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
  if done.returncode:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")


def run_arm(seed: str, variant: str) -> dict:
  base = os.path.join(_WORKDIR.value, f"seed{seed}")
  sft_only = os.path.join(base, "sft_only")
  if not os.path.exists(os.path.join(sft_only, "sft", "done.json")):
    _pipeline(sft_only, seed, "--config.pipeline.stages=('sft',)",
              "--config.pipeline.eval_after=false")
  workdir = os.path.join(base, variant)
  summary_path = os.path.join(workdir, "summary.json")
  started = time.time()
  if not os.path.exists(summary_path):
    if not os.path.exists(workdir):
      # The SFT result only (AppWorld's data link and outputs, and the summary, stay).
      shutil.copytree(sft_only, workdir, symlinks=True,
                      ignore=shutil.ignore_patterns("appworld", "summary.json"))
    _pipeline(workdir, seed, f"--config.reward.variant={variant}")
  with open(summary_path) as f:
    summary = json.load(f)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  out = {"seed": int(seed), "variant": variant, "wall_s": round(time.time() - started, 1)}
  for key in METRICS:
    out[f"{key}_after_sft"] = summary["train_after_sft"].get(key) or 0.0
    out[f"{key}_after_rl"] = summary["train_after"].get(key) or 0.0
    out[f"{key}_gain"] = out[f"{key}_after_rl"] - out[f"{key}_after_sft"]
  # A step without an update (no draw had a signal) logs no gradient norm.
  out["zero_grad_steps"] = sum(r.get("grad_norm", 0.0) == 0.0 for r in rows)
  out["rollout_reward_first"] = rows[0]["rollout/reward"]
  out["rollout_reward_last"] = rows[-1]["rollout/reward"]
  out["rollout_reward_by_step"] = [round(r["rollout/reward"], 3) for r in rows]
  return out


def _spread(values: list[float]) -> dict:
  return {"mean": statistics.mean(values),
          "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def main(argv) -> None:
  del argv
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required")
  runs = [run_arm(s, v) for s in _SEEDS.value for v in _VARIANTS.value]
  across = {}
  for variant in _VARIANTS.value:
    mine = [r for r in runs if r["variant"] == variant]
    across[variant] = {f"{key}_{part}": _spread([r[f"{key}_{part}"] for r in mine])
                       for key in METRICS for part in ("after_sft", "after_rl", "gain")}
  print(json.dumps({"bench": "learning", "machine": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "steps": _STEPS.value, "runs": runs,
                    "across_seeds": across}, indent=1))


if __name__ == "__main__":
  app.run(main)
