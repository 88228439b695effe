"""KV-cache rollout engine: slots, chunked prefill, blocked decode, per-token logprobs."""

from sage_jax.sampler.driver import AsyncEngine
from sage_jax.sampler.engine import (FINISH_REASONS, Engine, EngineConfig, EngineStats,
                                     TurnResult)
from sage_jax.sampler.sampling import GREEDY, SamplingParams

__all__ = ["AsyncEngine", "FINISH_REASONS", "Engine", "EngineConfig", "EngineStats", "GREEDY",
           "SamplingParams", "TurnResult"]
