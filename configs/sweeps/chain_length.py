"""Chain length K of the Sequential Rollout, everything else as the preset has it. At K=1 a
chain is one task: its library starts empty and no later task can use what it saves, so the
skill terms pay nothing, while the prompts keep their library section as at K=2 and 3. The
GRPO baseline without any library is configs/grpo.py."""


def get_sweep(preset: str = "qwen2.5-7b"):
  return {
      "config": f"configs/sage.py:{preset}",
      "axes": [{f"k{k}": {"grpo.chain_length": k} for k in (1, 2, 3)}],
  }
