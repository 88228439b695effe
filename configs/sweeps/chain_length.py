"""Chain length K of the Sequential Rollout (K=1 is single-task rollouts, no library carried)."""


def get_sweep(preset: str = "qwen2.5-7b"):
  return {
      "config": f"configs/sage.py:{preset}",
      "axes": [{f"k{k}": {"grpo.chain_length": k} for k in (1, 2, 3)}],
  }
