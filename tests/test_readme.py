"""Every command the README shows is run by CI (.ci/run) or by a test, with every flag and
config file it shows, so the README cannot drift from what is exercised."""

import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Commands that need what CI does not have, and why.
EXTERNAL = {
    "appworld download data": "AppWorld's official data needs the network; the same loader "
                              "runs the mini world (tests/test_appworld_pool.py)",
}


def readme_commands(text: str) -> list[str]:
  """Commands in ```bash blocks (continuations joined, comments dropped) and inline code
  spans that start like a command."""
  commands = []
  for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
    for line in block.replace("\\\n", " ").splitlines():
      line = line.split(" #")[0].strip()
      if line and not line.startswith(("#", "export ")):
        commands.append(re.sub(r"\s+", " ", line))
  prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M).replace("```", "")
  for span in re.findall(r"`([^`]+)`", prose):
    span = re.sub(r"\s+", " ", span)
    if re.match(r"(python3? |sbatch |HOSTS=|appworld )", span):
      commands.append(span)
  return commands


def _read(path):
  with open(path) as f:
    return f.read()


COMMANDS = readme_commands(_read(os.path.join(REPO, "README.md")))
CI = _read(os.path.join(REPO, ".ci", "run"))
TESTS = {os.path.basename(p): _read(p) for p in glob.glob(os.path.join(REPO, "tests", "*.py"))}


def test_the_readme_has_its_commands():
  assert len(COMMANDS) > 20
  assert COMMANDS[:3] == [
      "python3 -m venv .venv && . .venv/bin/activate && pip install -r requirements.txt -e . "
      "&& appworld install",
      "python -m sage_jax.train --config=configs/sage.py:demo --workdir=runs/demo",
      "python -m pytest -q tests"]


@pytest.mark.parametrize("command", COMMANDS)
def test_command_is_exercised(command):
  if any(command.startswith(prefix) for prefix in EXTERNAL):
    return
  if command in CI:
    return
  entry = re.search(r"-m (\S+)|(launch/\S+)", command)
  assert entry, f"README command {command!r} has no entry point this test knows"
  name = entry.group(1) or entry.group(2)
  runs = f'"-m", "{name}"' if entry.group(1) else name
  runners = {f: t for f, t in TESTS.items() if runs in t}
  assert runners, f"no test runs {name} (README: {command!r})"
  shown = set(re.findall(r"--[a-z_]+", command[entry.end():]))
  shown |= set(re.findall(r"configs/\S+?\.py", command))
  missing = sorted(s for s in shown if not any(s in t for t in runners.values()))
  assert not missing, f"{sorted(runners)} run {name} but never with {missing}"
