"""Evaluation presets: `python -m sage_jax.evaluate --config=configs/eval.py:<preset> --workdir=DIR`.

  demo                 the scripted expert (gold solutions in the skill format) on the mini dev
                       split: the whole agent + rollout + evaluation path without a model
  tiny                 a tiny random-init model through the real sampler on the mini dev split
  qwen2.5-coder-0.5b   the real Qwen2.5-Coder-0.5B-Instruct (untrained baseline), greedy
  run                  a trained run's checkpoint (`--run=RUN_DIR [--step=N]`), greedy, every
                       scenario of the dev split: only the eval, retrieval and pool sections
                       count, the model, agent, engine and sampler_mesh are the run's (the
                       last two can be set for this host: --config.sampler_mesh.tensor=1;
                       configs/sweeps/retrieval.py evaluates one run under each retrieval
                       strategy)

Sections map field by field onto EvalConfig, AgentConfig, RetrievalConfig, EnvPoolConfig,
ModelSpec, the sampler's EngineConfig and SamplerMeshConfig (the model is loaded straight
onto each host's sampling mesh, sharded over `sampler_mesh.tensor` devices per copy: set it
for a model larger than one device); all but the model start from their dataclass defaults,
so that every key of theirs can be set (`--config.pool.sandbox=off`).
"""

import ml_collections

from sage_jax import run_config


def get_config(preset: str = "demo") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  defaults = run_config.defaults()
  for name in ("eval", "agent", "retrieval", "pool", "engine", "sampler_mesh"):
    c[name] = defaults[name]
  c.eval.update(split="dev", data="mini", policy="model", experiment="eval",
                max_concurrent_scenarios=0, max_scenarios=0, appworld_check=True, seed=0,
                temperature=0.0)
  c.agent.update(use_library=True, max_steps=6, max_turn_tokens=384, max_episode_tokens=6144,
                 max_observation_chars=3000)
  c.retrieval.update(strategy="same_scenario", top_k=5, embedding_model="minilm")
  c.pool.update(num_workers=3, max_interactions=50, timeout_seconds=60, call_timeout_s=120.0)
  c.model = dict(spec="qwen2.5-coder-0.5b-instruct", preset="")
  c.engine.update(num_slots=4, max_len=6144, prefill_buckets=(32, 128, 512), min_attend=256,
                  steps_per_call=8, max_top_k=64)
  if preset == "demo":
    c.eval.policy = "scripted"
  elif preset == "tiny":
    c.model = dict(spec="", preset="tiny", seed=0)
    c.agent.max_steps = 3
    c.agent.max_turn_tokens = 32
    c.agent.max_episode_tokens = 2048
    c.eval.temperature = 1.0
    c.engine.max_len = 2048
  elif preset == "run":
    c.model = dict(spec="", preset="")  # the run's own: `--run=RUN_DIR` names it
  elif preset != "qwen2.5-coder-0.5b":
    raise ValueError(f"unknown eval preset {preset!r}; known: demo, tiny, qwen2.5-coder-0.5b, "
                     "run")
  return c
