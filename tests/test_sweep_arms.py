"""Each arm of each sweep runs what its name says: its launch command, parsed the way
`sage_jax.train` parses it, resolves to its stage config (configs/sage.py or configs/grpo.py at
the sweep's preset) changed in exactly the swept keys, and to nothing else.

(configs/sweeps/retrieval.py evaluates a trained run instead: tests/test_launch.py checks
its commands.)"""

import dataclasses
import glob
import os

import pytest
from absl import flags

from launch import sweep
from sage_jax import config_file, run_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEPS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "configs", "sweeps",
                                                                    "*.py"))
                if not p.endswith("retrieval.py"))
STAGES = ("configs/sage.py", "configs/grpo.py")


def _resolve_command(argv: list[str]) -> run_config.RunConfig:
  """The RunConfig `python -m sage_jax.train <argv>` runs (its flags, parsed in process)."""
  values = flags.FlagValues()
  config_file.define_flag("config", "", flag_values=values, sys_argv=["train", *argv])
  flags.DEFINE_string("workdir", None, "", flag_values=values)
  values(["train", *argv])
  return run_config.resolve(values.config)


def _leaves(run: run_config.RunConfig) -> dict[str, object]:
  return {f"{section}.{k}" if section != "seed" else "seed": v
          for section, value in dataclasses.asdict(run).items()
          for k, v in (value.items() if isinstance(value, dict) else [("", value)])}


def _built_key(key: str) -> str:
  """The RunConfig field a config key sets (a GRPO knob `grpo.<k>` builds another section)."""
  section, _, name = key.partition(".")
  if section == "grpo" and name in run_config.GRPO_KNOBS:
    return ".".join(run_config.GRPO_KNOBS[name])
  return key


def _arm_problems(run: sweep.Run, preset: str) -> list[str]:
  """What makes `run` other than its stage command plus its swept keys: another stage config
  or preset; a key that differs from the stage without being swept; a swept value that does
  not arrive; overrides that turn one stage into the other (most of the keys that tell SAGE
  and the baseline apart set to the other's values)."""
  stage, _, arm_preset = run.config.partition(":")
  if stage not in STAGES or arm_preset != preset:
    return [f"{run.name}: config {run.config!r} is not one of {STAGES} at {preset!r}"]
  command = sweep.commands_for(run, "local")[-1]
  arm = _leaves(_resolve_command(command[command.index("sage_jax.train") + 1:]))
  stages = {s: _leaves(_resolve_command([f"--config={s}:{preset}", "--workdir=w"]))
            for s in STAGES}
  base, (other,) = stages[stage], [v for s, v in stages.items() if s != stage]
  overrides = {_built_key(k): v for k, v in run.overrides.items()}
  swept = set(overrides)
  if "seed" in swept:  # the run seed moves every derived section seed
    swept |= {f"{s}.seed" for s in run_config.SEEDED_SECTIONS}
  problems = [f"{run.name}: {k} = {arm[k]!r} differs from {run.config} but is not swept"
              for k in sorted(arm) if arm[k] != base[k] and k not in swept]
  problems += [f"{run.name}: {k} resolves to {arm[k]!r}, swept {v!r}"
               for k, v in overrides.items() if arm[k] != v]
  method = [k for k in base if base[k] != other[k]]
  if sum(arm[k] == other[k] for k in method) > len(method) / 2:
    problems.append(f"{run.name}: its overrides make {run.config} the other stage; name that "
                    "stage's config instead")
  return problems


@pytest.mark.parametrize("preset", ["demo", "qwen2.5-7b"])
@pytest.mark.parametrize("name", SWEEPS)
def test_every_arm_is_its_stage_command_plus_the_swept_keys(name, preset, monkeypatch):
  monkeypatch.chdir(REPO)
  runs = sweep.expand(sweep.load_sweep(f"configs/sweeps/{name}:{preset}"), "runs")
  assert runs and [p for r in runs for p in _arm_problems(r, preset)] == []


def test_the_check_catches_arms_that_are_not_their_stage(monkeypatch):
  monkeypatch.chdir(REPO)
  baseline_from_sage = {"grpo.single_task": True, "grpo.chain_length": 1,
                        "agent.use_library": False, "retrieval.strategy": "none",
                        "reward.variant": "outcome"}
  runs = sweep.expand({"config": "configs/sage.py:demo", "axes": [{
      "grpo": baseline_from_sage, "other_preset": {"config": "configs/grpo.py:qwen2.5-7b"},
      "sft": {"config": "configs/sft.py:demo"}}]}, "runs")
  problems = {r.name: _arm_problems(r, "demo") for r in runs}
  assert problems["grpo"] == ["grpo: its overrides make configs/sage.py:demo the other stage; "
                               "name that stage's config instead"]
  assert "is not one of" in problems["other_preset"][0]
  assert "is not one of" in problems["sft"][0]
