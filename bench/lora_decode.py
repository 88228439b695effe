r"""One decode step (all 24 layers, batch 8, 1024 cached positions) of the Qwen2.5-0.5B shape
with plain weights, with unmerged rank-16 adapters on every projection (a sampler that shares
the trainer's arrays), and with those adapters merged into the sampling copy
(`multihost.WeightSync` with the LoRA config: a sampler with a copy of its own), interleaved
round by round in one process; prints JSON.

  python bench/lora_decode.py [--rank=16] [--batch=8] [--rounds=20] [--dtype=bfloat16]

Weights and adapters are cast to `--dtype`, as the sampler's copy is (float32 on CPU,
bfloat16 on accelerators).
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from sage_jax import multihost
from sage_jax.model import get_preset, init_model, lora
from sage_jax.model.qwen2 import KVCache

flags.DEFINE_integer("rank", 16, "Adapter rank.")
flags.DEFINE_integer("batch", 8, "Sequences per decode step.")
flags.DEFINE_integer("rounds", 20, "Timed steps of each variant.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights' and compute dtype.")
ATTEND = 1024


def _decode_step(model, batch, dtype, merge_lora="never"):
  sync = multihost.WeightSync(nnx.state(model), multihost.SamplerMeshConfig(
      param_dtype=dtype, merge_lora=merge_lora), lora_config=model.config.lora)
  graphdef, state = nnx.split(sync.sampling_model(model))
  cfg = model.config

  @jax.jit
  def step(state, cache, tokens, positions):
    return nnx.merge(graphdef, state).hidden_states(tokens, positions, cache=cache,
                                                    attend_len=ATTEND)

  args = (state, KVCache.zeros(cfg, batch, ATTEND), jnp.zeros((batch, 1), jnp.int32),
          jnp.full((batch, 1), ATTEND // 2))
  jax.block_until_ready(step(*args))
  return lambda: jax.block_until_ready(step(*args))


def main(argv):
  del argv
  f = flags.FLAGS
  model = init_model(get_preset("qwen2.5-0.5b", dtype=f.dtype))
  variants = {"plain": _decode_step(model, f.batch, f.dtype)}
  lora.add_adapters(model, lora.LoraConfig(rank=f.rank))
  variants["unmerged_lora"] = _decode_step(model, f.batch, f.dtype)
  variants["merged_lora"] = _decode_step(model, f.batch, f.dtype, merge_lora="always")
  times = {name: [] for name in variants}
  for _ in range(f.rounds):
    for name, run in variants.items():
      start = time.perf_counter()
      run()
      times[name].append(time.perf_counter() - start)
  print(json.dumps({name: {"median_ms": round(float(np.median(t)) * 1e3, 1),
                           "min_ms": round(min(t) * 1e3, 1)} for name, t in times.items()}
                   | {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
                      "dtype": f.dtype, "rank": f.rank, "batch": f.batch}))


if __name__ == "__main__":
  app.run(main)
