"""SAGE vs the GRPO baseline over seeds: the headline comparison with error bars."""


def get_sweep(preset: str = "qwen2.5-7b", num_seeds: int = 3):
  return {
      "config": f"configs/sage.py:{preset}",
      "axes": [
          {"sage": {}, "grpo": {"reward.variant": "outcome", "rollout.chain_length": 1}},
          {f"seed{s}": {"seed": s} for s in range(num_seeds)},
      ],
  }
