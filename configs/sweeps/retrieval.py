"""Which library skills a new task sees: the four retrieval strategies."""

STRATEGIES = ("same_scenario", "query_ngram", "query_embedding", "skill_embedding")


def get_sweep(preset: str = "qwen2.5-7b"):
  return {
      "config": f"configs/sage.py:{preset}",
      "axes": [{s: {"retrieval.strategy": s} for s in STRATEGIES}],
  }
