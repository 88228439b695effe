r"""How close a bfloat16 sampler is to the float32 adapted model, with the LoRA adapters merged
into its weights (the sampling copy `multihost.WeightSync` folds) and unmerged; prints JSON.

  python bench/lora_merge_precision.py [--b_std=2e-4] [--rank=16] [--tokens=32]

The Qwen2.5-0.5B shape with random weights; every adapter's B drawn from N(0, b_std^2) (B
starts at zero; a trained one has moved). Logits of one random sequence: the RMS of each
bfloat16 form's difference from the float32 adapted model's, and the RMS of what the adapters
change in float32 (the update's own size).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from sage_jax import multihost
from sage_jax.model import abstract_model, get_preset, init_model, lora

flags.DEFINE_float("b_std", 2e-4, "Standard deviation of the adapters' B.")
flags.DEFINE_integer("rank", 16, "Adapter rank.")
flags.DEFINE_integer("tokens", 32, "Tokens of the sequence.")


def _logits(model, tokens):
  positions = jnp.arange(tokens.shape[1])[None]
  return np.asarray(model(tokens, positions)[0], np.float64)


def _rms(x):
  return float(np.sqrt(np.mean(x ** 2)))


def main(argv):
  del argv
  f = flags.FLAGS
  config = lora.LoraConfig(rank=f.rank)
  model = lora.add_adapters(init_model(get_preset("qwen2.5-0.5b", dtype="float32")), config)
  key = jax.random.PRNGKey(1)
  for adapter in lora.adapters_by_kernel(model).values():
    key, k = jax.random.split(key)
    adapter.b.set_value(jax.random.normal(k, adapter.b.shape) * f.b_std)
  tokens = jax.random.randint(jax.random.PRNGKey(2), (1, f.tokens), 0, model.config.vocab_size)
  # The bfloat16 sampler's graphs: compute in bfloat16 over a bfloat16 copy of the weights.
  bf16 = model.config.replace(dtype="bfloat16")
  unmerged_graph = nnx.graphdef(abstract_model(bf16))
  unmerged = multihost.WeightSync(model, multihost.SamplerMeshConfig(
      param_dtype="bfloat16", merge_lora="never"))(nnx.state(model))
  merged = multihost.WeightSync(model, multihost.SamplerMeshConfig(param_dtype="bfloat16"))
  assert merged.folds_adapters and merged.fuses
  merged_graph = nnx.graphdef(abstract_model(bf16.replace(lora=lora.LoraConfig(),
                                                          fused_projections=True)))
  reference = _logits(model, tokens)
  got = {"unmerged": _logits(nnx.merge(unmerged_graph, unmerged), tokens),
         "merged": _logits(nnx.merge(merged_graph, merged(nnx.state(model))), tokens)}
  for adapter in lora.adapters_by_kernel(model).values():
    adapter.b.set_value(jnp.zeros_like(adapter.b[...]))
  base = _logits(model, tokens)
  print(json.dumps({
      "b_std": f.b_std, "rank": f.rank, "tokens": f.tokens,
      "update_rms_float32": round(_rms(reference - base), 6),
      **{f"{name}_bf16_error_rms": round(_rms(x - reference), 6) for name, x in got.items()},
      "backend": jax.default_backend()}))


if __name__ == "__main__":
  app.run(main)
