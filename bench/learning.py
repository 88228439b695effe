r"""How much the demo's RL improves its sampled policy on the training chains, against the
run-to-run noise of a policy that does not learn; prints JSON.

  python bench/learning.py --seeds=0 --rollout_seeds=derived,1,2 --variants=sage,outcome,frozen \
      --workdir=DIR [--steps=12] [--overrides=key=value,...]

Per run seed s, the demo's SFT runs once (`DIR/seed<s>/sft_only`); each RL arm starts from a
copy of it (`DIR/seed<s>/<variant>_r<r>`) with rollout seed r (which chains are drawn and how
rollouts sample; `derived`: the one the run seed derives, as the demo runs). Variants: `sage` and `outcome` set `reward.variant`; `frozen` is the SAGE
run with learning rate 0: its steps sample the SFT policy, so the spread of its numbers is
the noise a learning run has to clear. A run already finished in DIR is read, not rerun.

Reported per run, from the sampled episodes of each step (`rollout/tgc` and
`rollout/later_skill_usage_rate`: tasks at chain positions > 0 that used a library skill):
the mean over the first `--first` steps and over the last `--last` steps, their
difference (the gain), the steps without a gradient, and the reward of every step. Across
the runs of one variant: mean and sample std of each.
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

_SEEDS = flags.DEFINE_list("seeds", ["0"], "Run seeds (each one SFT).")
_ROLLOUT_SEEDS = flags.DEFINE_list(
    "rollout_seeds", ["derived", "1", "2"],
    "Rollout seeds of the RL arms started from each SFT (`derived`: the run seed's).")
_VARIANTS = flags.DEFINE_list("variants", ["sage", "outcome", "frozen"],
                              "reward.variant of each arm, or `frozen` (SAGE, learning rate 0).")
_STEPS = flags.DEFINE_integer("steps", 12, "RL steps of every run.")
_FIRST = flags.DEFINE_integer("first", 2, "Steps averaged for the start of a run.")
_LAST = flags.DEFINE_integer("last", 4, "Steps averaged for the end of a run.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the runs go (kept: reruns resume).")
_OVERRIDES = flags.DEFINE_list("overrides", [], "More <key>=<value> for every run.")

METRICS = {"tgc": "rollout/tgc", "later_skill_usage": "rollout/later_skill_usage_rate"}


def _pipeline(workdir: str, seed: str, *overrides: str) -> None:
  cmd = [sys.executable, "-m", "sage_jax.pipeline", "--config=configs/sage.py:demo",
         f"--workdir={workdir}", f"--config.seed={seed}",
         f"--config.rl.total_steps={_STEPS.value}", "--config.pipeline.eval_before=false",
         "--config.pipeline.eval_after=false", "--config.pipeline.eval_train=false",
         "--config.pipeline.export=false", "--config.pipeline.plot=false",
         *[f"--config.{o}" for o in _OVERRIDES.value], *overrides]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
  done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
  if done.returncode:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")


def run_arm(seed: str, rollout_seed: str, variant: str) -> dict:
  base = os.path.join(_WORKDIR.value, f"seed{seed}")
  sft_only = os.path.join(base, "sft_only")
  if not os.path.exists(os.path.join(sft_only, "sft", "done.json")):
    _pipeline(sft_only, seed, "--config.pipeline.stages=('sft',)")
  workdir = os.path.join(base, f"{variant}_r{rollout_seed}")
  started = time.time()
  if not os.path.exists(os.path.join(workdir, "summary.json")):
    if not os.path.exists(workdir):
      # The SFT result only (AppWorld's data link and outputs, the summary, and the config,
      # which the arm's own replaces, stay).
      shutil.copytree(sft_only, workdir, symlinks=True,
                      ignore=shutil.ignore_patterns("appworld", "summary.json", "config.json"))
    arm = (("--config.reward.variant=sage", "--config.optimizer.learning_rate=0.0")
           if variant == "frozen" else (f"--config.reward.variant={variant}",))
    if rollout_seed != "derived":
      arm += (f"--config.rollout.seed={rollout_seed}",)
    _pipeline(workdir, seed, *arm)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  out = {"seed": int(seed), "rollout_seed": rollout_seed, "variant": variant,
         "wall_s": round(time.time() - started, 1)}
  for name, key in METRICS.items():
    values = [r[key] for r in rows]
    out[f"{name}_first"] = statistics.mean(values[:_FIRST.value])
    out[f"{name}_last"] = statistics.mean(values[-_LAST.value:])
    out[f"{name}_gain"] = out[f"{name}_last"] - out[f"{name}_first"]
    out[f"{name}_by_step"] = [round(v, 1) for v in values]
  # A step without an update (no draw had a signal) logs no gradient norm.
  out["zero_grad_steps"] = sum(r.get("grad_norm", 0.0) == 0.0 for r in rows)
  # A step whose every reward is unknown (the environment failed under it) logs none.
  out["reward_by_step"] = [round(r["rollout/reward"], 3) if "rollout/reward" in r else None
                           for r in rows]
  return out


def _spread(values: list[float]) -> dict:
  return {"mean": statistics.mean(values),
          "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def main(argv) -> None:
  del argv
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required")
  runs = [run_arm(s, r, v) for s in _SEEDS.value for v in _VARIANTS.value
          for r in _ROLLOUT_SEEDS.value]
  across = {}
  for variant in _VARIANTS.value:
    mine = [r for r in runs if r["variant"] == variant]
    across[variant] = {f"{name}_{part}": _spread([r[f"{name}_{part}"] for r in mine])
                       for name in METRICS for part in ("first", "last", "gain")}
  print(json.dumps({"bench": "learning", "machine": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "steps": _STEPS.value, "first": _FIRST.value,
                    "last": _LAST.value, "runs": runs, "across_runs": across}, indent=1))


if __name__ == "__main__":
  app.run(main)
