"""Qwen2 architecture in Flax NNX."""

from sage_jax.model.config import PRESETS, Qwen2Config, get_preset
from sage_jax.model.qwen2 import KVCache, Qwen2, abstract_model, init_model

__all__ = ["PRESETS", "Qwen2Config", "get_preset", "KVCache", "Qwen2", "abstract_model",
           "init_model"]
