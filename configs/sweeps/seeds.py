"""SAGE vs the GRPO baseline over seeds: the headline comparison with error bars.

Arms: `sage` (configs/sage.py), `grpo` (configs/grpo.py, the paper's baseline as its own stage
command) and `grpo_matched`: the baseline with as many episodes per update as SAGE (a SAGE
step runs chains x G rollouts x K tasks, a baseline step chains x G single tasks, so the
matched arm draws K times the chains). Each arm runs once per seed (`config.seed`).
"""

import importlib.util
import os

CONFIGS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stage(name: str, preset: str):
  spec = importlib.util.spec_from_file_location(f"stage_{name}", os.path.join(CONFIGS,
                                                                              f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(preset)


def get_sweep(preset: str = "qwen2.5-7b", num_seeds: int | str = 3):
  """`seeds.py[:PRESET[:NUM_SEEDS]]`."""
  num_seeds = int(num_seeds)
  if num_seeds < 1:
    raise ValueError(f"NUM_SEEDS must be at least 1, got {num_seeds}")
  sage, baseline = _stage("sage", preset), _stage("grpo", preset)
  sage_episodes = (sage.pipeline.chains_per_step * sage.grpo.group_size
                   * sage.grpo.chain_length)
  matched_chains, rest = divmod(sage_episodes, baseline.grpo.group_size)
  if rest:
    raise ValueError(f"{preset}: SAGE's {sage_episodes} episodes per step do not split into "
                     f"groups of {baseline.grpo.group_size}")
  grpo_config = f"configs/grpo.py:{preset}"
  return {
      "config": f"configs/sage.py:{preset}",
      "axes": [
          {"sage": {}, "grpo": {"config": grpo_config},
           "grpo_matched": {"config": grpo_config,
                            "pipeline.chains_per_step": matched_chains}},
          {f"seed{s}": {"seed": s} for s in range(num_seeds)},
      ],
  }
