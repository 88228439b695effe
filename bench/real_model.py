r"""The real Qwen2.5-Coder-0.5B-Instruct through the whole method: SFT on the mini train split,
then a SAGE run and a GRPO-baseline run from the same SFT model, each state evaluated
(greedy) on the mini dev and test splits; prints JSON.

  python bench/real_model.py --workdir=DIR [--rl_steps=N] [--splits=dev,test] \
      [--overrides=key=value,...] [--sft_overrides=...] [--rl_overrides=...] \
      [--grpo_overrides=...] [--eval_overrides=...] \
      [--stages=sft,eval_sft,sage,eval_sage,grpo,eval_grpo,eval_base]

Stages run in the order given, each a separate process, and each is skipped when its result
is already in DIR, so a run that stops (a long CPU run, a preempted machine) goes on where it
stopped when started again with the same command; training stages resume from their latest
checkpoint. Layout:

  DIR/sft/                  configs/sft.py:qwen2.5-coder-0.5b (the SFT model)
  DIR/sage/ DIR/grpo/       copies of DIR/sft, then configs/sage.py or configs/grpo.py RL
  DIR/eval/<state>_<split>/ `sage_jax.evaluate` reports (state: base, sft, sage, grpo)
  DIR/stages.json           each finished stage's command and wall time

`--overrides` go to every training run (and the base model's evaluation shares their agent
settings, so every state acts under the same limits); the evaluations of trained states use
the run's own model, agent and sampler settings (`sage_jax.evaluate --run`).
"""

import json
import os
import platform
import shutil
import subprocess
import sys
import time

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = "qwen2.5-coder-0.5b"
STAGES = ("sft", "eval_sft", "sage", "eval_sage", "grpo", "eval_grpo", "eval_base")
AGENT_KEYS = ("agent.",)  # what the base model's evaluation takes from --overrides

_WORKDIR = flags.DEFINE_string("workdir", None, "Where the runs and reports go (reruns resume).")
_STAGES = flags.DEFINE_list("stages", list(STAGES), f"Stages to run, in order; of {STAGES}.")
_SPLITS = flags.DEFINE_list("splits", ["dev", "test"], "Splits every state is evaluated on.")
_RL_STEPS = flags.DEFINE_integer("rl_steps", 20, "RL steps of the SAGE and GRPO runs.")
_OVERRIDES = flags.DEFINE_list("overrides", [], "<key>=<value> for every training run.")
_SFT_OVERRIDES = flags.DEFINE_list("sft_overrides", [], "<key>=<value> for SFT only.")
_RL_OVERRIDES = flags.DEFINE_list("rl_overrides", [], "<key>=<value> for both RL runs.")
_GRPO_OVERRIDES = flags.DEFINE_list(
    "grpo_overrides", [], "<key>=<value> for the GRPO run after --rl_overrides (e.g. K times "
    "SAGE's chains per step, so that both train on as many tasks a step).")
_EVAL_OVERRIDES = flags.DEFINE_list(
    "eval_overrides", [], "<key>=<value> for every evaluation (e.g. eval.max_scenarios=N to "
    "evaluate each split's first N scenarios).")

# What the table reports from each evaluation's overall metrics.
COLUMNS = {"tgc": "tgc", "sgc": "sgc", "steps": "avg_steps", "tokens": "avg_generated_tokens",
           "skill_usage": "later_skill_usage_rate", "no_code": "no_code_rate"}


def _log_path() -> str:
  return os.path.join(_WORKDIR.value, "stages.json")


def _finished() -> dict:
  try:
    with open(_log_path()) as f:
      return json.load(f)
  except FileNotFoundError:
    return {}


def _run(name: str, cmd: list[str]) -> None:
  """Runs one stage's command (output to DIR/<name>.log) and records it as finished."""
  started = time.time()
  with open(os.path.join(_WORKDIR.value, f"{name}.log"), "a") as log:
    done = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
  if done.returncode:
    raise RuntimeError(f"stage {name} failed (exit {done.returncode}); see "
                       f"{_WORKDIR.value}/{name}.log:\n{' '.join(cmd)}")
  finished = _finished()
  finished[name] = {"command": " ".join(cmd), "wall_s": round(time.time() - started, 1)}
  with open(_log_path() + ".tmp", "w") as f:
    json.dump(finished, f, indent=1)
  os.replace(_log_path() + ".tmp", _log_path())


def _config_flags(overrides: list[str]) -> list[str]:
  return [f"--config.{o}" for o in overrides]


def _train(name: str, config: str) -> list[str]:
  run_dir = os.path.join(_WORKDIR.value, name)
  cmd = [sys.executable, "-m", "sage_jax.train", f"--config=configs/{config}:{PRESET}",
         f"--workdir={run_dir}", "--config.pipeline.eval_before=false",
         "--config.pipeline.eval_after=false", "--config.pipeline.export=false",
         *_config_flags(_OVERRIDES.value)]
  if name == "sft":
    return cmd + _config_flags(_SFT_OVERRIDES.value)
  if not os.path.exists(run_dir):
    # The SFT result only: the RL run resumes after its finished SFT stage.
    shutil.copytree(os.path.join(_WORKDIR.value, "sft"), run_dir, symlinks=True,
                    ignore=shutil.ignore_patterns("appworld", "summary.json", "config.json"))
  arm = _GRPO_OVERRIDES.value if name == "grpo" else []
  return cmd + [f"--config.rl.total_steps={_RL_STEPS.value}",
                *_config_flags(_SFT_OVERRIDES.value + _RL_OVERRIDES.value + arm)]


def _evaluate(state: str, split: str) -> list[str]:
  out = os.path.join(_WORKDIR.value, "eval", f"{state}_{split}")
  cmd = [sys.executable, "-m", "sage_jax.evaluate", f"--workdir={out}"]
  extra = _config_flags(_EVAL_OVERRIDES.value)
  if state == "base":  # the untrained model, acting under the training runs' agent limits
    agent = [o for o in _OVERRIDES.value if o.startswith(AGENT_KEYS)]
    return cmd + [f"--config=configs/eval.py:{PRESET}", f"--config.eval.split={split}",
                  *_config_flags(agent), *extra]
  stage = "sft" if state == "sft" else "rl"
  return cmd + ["--config=configs/eval.py:run", f"--config.eval.split={split}",
                f"--run={os.path.join(_WORKDIR.value, state)}", f"--stage={stage}", *extra]


def run_stage(name: str) -> None:
  """A training stage runs once; an evaluation stage runs for each of --splits it has not run
  for (so a later invocation can add a split)."""
  if name in ("sft", "sage", "grpo"):
    if name not in _finished():
      _run(name, _train(name, {"sft": "sft.py", "sage": "sage.py", "grpo": "grpo.py"}[name]))
    return
  state = name.removeprefix("eval_")
  for split in _SPLITS.value:
    if f"{name}_{split}" not in _finished():
      _run(f"{name}_{split}", _evaluate(state, split))


def table() -> list[dict]:
  rows = []
  for state in ("base", "sft", "sage", "grpo"):
    for split in _SPLITS.value:
      path = os.path.join(_WORKDIR.value, "eval", f"{state}_{split}", f"eval_{split}.json")
      if not os.path.exists(path):
        continue
      with open(path) as f:
        report = json.load(f)
      overall = report["metrics"]["overall"]
      rows.append({"state": state, "split": split, "tasks": overall["num_tasks"],
                   **{k: overall[v] for k, v in COLUMNS.items()},
                   "wall_s": round(report["elapsed_s"], 1)})
  return rows


def main(argv) -> None:
  del argv
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required")
  unknown = [s for s in _STAGES.value if s not in STAGES]
  if unknown:
    raise app.UsageError(f"--stages: unknown {unknown}; known: {STAGES}")
  os.makedirs(_WORKDIR.value, exist_ok=True)
  for name in _STAGES.value:
    run_stage(name)
  print(json.dumps({"bench": "real_model", "preset": PRESET,
                    "machine": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "stages": _finished(), "table": table()}, indent=1))


if __name__ == "__main__":
  app.run(main)
