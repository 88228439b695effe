"""A `--config` that does not load (a missing file, a preset its `get_config` does not know, a
syntax error) stops every entry point and launcher with one line naming the file, no
traceback."""

import os
import subprocess
import sys

import ml_collections
import pytest
from absl import flags

from sage_jax import config_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each command that reads a config file, as the README runs it; CONFIG stands for the file.
COMMANDS = {
    "pipeline": ["-m", "sage_jax.pipeline", "--config=CONFIG", "--workdir=runs/x"],
    "train": ["-m", "sage_jax.train", "--config=CONFIG", "--workdir=runs/x"],
    "evaluate": ["-m", "sage_jax.evaluate", "--config=CONFIG", "--workdir=runs/x"],
    "memory_plan": ["-m", "sage_jax.tools.memory_plan", "--config=CONFIG", "--hosts=1"],
    "local": ["launch/local.py", "--config=CONFIG", "--workdir=runs/x", "--dry_run"],
    "tpu_pod": ["launch/tpu_pod.py", "--project=p", "--zone=z", "--tpu=t", "--config=CONFIG",
                "--workdir=gs://b/x", "--dry_run"],
    "sweep": ["launch/sweep.py", "--sweep=CONFIG", "--workdir_root=runs/x", "--dry_run"],
}
SAGE_PRESETS = "known: demo, qwen2.5-coder-0.5b, qwen2.5-7b, qwen2.5-32b, qwen2.5-32b-lora"
EVAL_PRESETS = "known: demo, tiny, qwen2.5-coder-0.5b, run"


def _fails_with_one_line(command: str, config: str) -> str:
  argv = [a.replace("CONFIG", config) for a in COMMANDS[command]]
  out = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode != 0, out.stdout
  assert "Traceback" not in out.stderr, out.stderr
  assert len(out.stderr.strip().splitlines()) == 1, out.stderr
  return out.stderr.strip()


@pytest.mark.parametrize("command", COMMANDS)
def test_a_missing_config_file_is_one_line(command):
  directory = "configs/sweeps" if command == "sweep" else "configs"
  what = "sweep file" if command == "sweep" else "config file"
  line = _fails_with_one_line(command, f"{directory}/missing.py:demo")
  assert line.startswith(f"{directory}/missing.py: no such {what} ({directory}/ has "), line
  assert ("reward_ablation.py" if command == "sweep" else "sage.py") in line


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_preset_is_one_line_listing_the_known(command):
  config = {"evaluate": "configs/eval.py", "sweep": "configs/sweeps/seeds.py"}.get(
      command, "configs/sage.py")
  line = _fails_with_one_line(command, f"{config}:nosuch")
  known = EVAL_PRESETS if command == "evaluate" else SAGE_PRESETS
  assert line == f"{config}:nosuch: unknown{' eval' * (command == 'evaluate')} preset " \
                 f"'nosuch'; {known}", line


def test_an_unknown_preset_of_a_sweeps_arm_stops_the_sweep():
  """The sweep loads, but its arms' config does not: nothing is submitted."""
  line = _fails_with_one_line("sweep", "configs/sweeps/chain_length.py:nosuch")
  assert line == f"configs/sage.py:nosuch: unknown preset 'nosuch'; {SAGE_PRESETS}"


def test_a_syntax_error_is_one_line_with_its_line(tmp_path):
  path = tmp_path / "broken.py"
  path.write_text("import ml_collections\n\ndef get_config(preset):\n  return (\n")
  line = _fails_with_one_line("pipeline", f"{path}:demo")
  assert line == f"{path}:4: syntax error in config file {path}: '(' was never closed"


def _write(tmp_path, text: str) -> str:
  path = tmp_path / "config.py"
  path.write_text(text)
  return str(path)


def test_load_names_the_line_that_raised(tmp_path):
  path = _write(tmp_path, "import ml_collections\nimport no_such_module\n")
  with pytest.raises(config_file.ConfigFileError,
                     match=rf"^{path}:2: config file {path} failed to load: "
                           "ModuleNotFoundError: No module named 'no_such_module'$"):
    config_file.load(path)
  path = _write(tmp_path, "def get_config(preset):\n  sizes = {}\n  return sizes[preset]\n")
  with pytest.raises(config_file.ConfigFileError,
                     match=rf"^{path}:3: get_config\(\) of {path}:big failed: KeyError: 'big'$"):
    config_file.load(f"{path}:big")


def test_load_wants_a_config_dict(tmp_path):
  path = _write(tmp_path, "def get_config():\n  return None\n")
  with pytest.raises(config_file.ConfigFileError,
                     match=rf"^{path}: get_config\(\) returned NoneType, not a ConfigDict$"):
    config_file.load(path)
  path = _write(tmp_path, "CONFIG = 1\n")
  with pytest.raises(config_file.ConfigFileError, match=rf"^{path}: defines no get_config\(\)$"):
    config_file.load(path)


def test_the_flag_loads_the_preset_and_applies_overrides_to_a_locked_config(tmp_path):
  path = _write(tmp_path, "import ml_collections\n\ndef get_config(size):\n"
                "  return ml_collections.ConfigDict({'size': size, 'seed': 0})\n")
  argv = ["main", f"--config={path}:big", "--config.seed=3"]
  values = flags.FlagValues()
  config_file.define_flag("config", "", flag_values=values, sys_argv=argv)
  values(argv)
  assert values.config.to_dict() == {"size": "big", "seed": 3}
  assert isinstance(values.config, ml_collections.ConfigDict)
  with pytest.raises(AttributeError):  # locked: a misspelt key fails
    values.config.sed = 1
  values = flags.FlagValues()
  config_file.define_flag("config", "", flag_values=values, sys_argv=["main"])
  with pytest.raises(config_file.ConfigFileError, match="no such config file"):
    values(["main", f"--config={tmp_path}/missing.py"])
