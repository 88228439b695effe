r"""One decode step (all 24 layers, batch 8, 1024 cached positions) of the Qwen2.5-0.5B shape
in each weight layout the sampler can read, interleaved round by round in one process;
prints JSON. Every layout's copy is made by `multihost.WeightSync`, as the sampler's is:

  plain            separate q/k/v and gate/up projections (HF's layout, the trainer's)
  plain_fused      q/k/v and gate/up as one matmul each (`sampler_mesh.fuse_projections`;
                   "auto", the default, fuses wherever the sync writes a copy)
  unmerged_lora    rank-`--rank` adapters on every projection, applied at each step (a
                   sampler that shares the trainer's arrays)
  merged_lora      those adapters folded into the copy, projections separate
  merged_lora_fused  folded and fused (an adapted model's copy, by default)

  python bench/decode_layouts.py [--rank=16] [--batch=8] [--rounds=20] [--dtype=bfloat16]

Weights and adapters are cast to `--dtype`, as the sampler's copy is (float32 on CPU,
bfloat16 on accelerators). `speed_over_plain`: the median over rounds of plain's time over
the variant's in the same round.
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


def _decode_step(model, batch, dtype, *, fuse: bool, merge_lora: str = "auto"):
  sync = multihost.WeightSync(model, multihost.SamplerMeshConfig(
      param_dtype=dtype, merge_lora=merge_lora, fuse_projections="always" if fuse else "never"))
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
  variants = {"plain": _decode_step(model, f.batch, f.dtype, fuse=False),
              "plain_fused": _decode_step(model, f.batch, f.dtype, fuse=True)}
  lora.add_adapters(model, lora.LoraConfig(rank=f.rank))
  variants["unmerged_lora"] = _decode_step(model, f.batch, f.dtype, fuse=False,
                                           merge_lora="never")
  variants["merged_lora"] = _decode_step(model, f.batch, f.dtype, fuse=False,
                                         merge_lora="always")
  variants["merged_lora_fused"] = _decode_step(model, f.batch, f.dtype, fuse=True)
  times = {name: [] for name in variants}
  for round_ in range(f.rounds):
    order = list(variants.items())
    for name, run in order[::-1] if round_ % 2 else order:  # no variant always goes first
      start = time.perf_counter()
      run()
      times[name].append(time.perf_counter() - start)
  # Each round runs every variant back to back, so a ratio within a round sees the same
  # machine (its memory bandwidth drifts over minutes); the median of those ratios.
  plain = np.asarray(times["plain"])
  print(json.dumps({name: {"median_ms": round(float(np.median(t)) * 1e3, 1),
                           "min_ms": round(min(t) * 1e3, 1),
                           "speed_over_plain": round(float(np.median(plain / t)), 3)}
                    for name, t in times.items()}
                   | {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
                      "dtype": f.dtype, "rank": f.rank, "batch": f.batch}))


if __name__ == "__main__":
  app.run(main)
