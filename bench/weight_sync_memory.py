r"""Per-device memory of a run's weight sync (the trainer's parameters to the sampler's copy)
as XLA plans it: the sync compiled for the run's training and sampling meshes on simulated
CPU devices, from abstract parameters (nothing is allocated, so a 32B plans on a laptop).
Three ways, compared in one run: the sync as one program over the whole model, layer by
layer (`multihost.LayerwiseProgram`), and layer by layer writing into the old copy's buffers
(what `WeightSync` runs when the pipeline hands it the sampler's copy).

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
      python bench/weight_sync_memory.py --config=configs/sage.py:qwen2.5-7b

One host: the devices are the host's (`sampler_mesh` is host-local), the training mesh the
config's over all of them. Prints JSON: GiB per device of the copy and of each way's
temporaries (layer by layer: its largest program's; every layer runs the program of
"layers/0"), the bytes of each program's output written into the old copy, and the ratio of
the temporaries. XLA:CPU's buffer assignment is not an accelerator's: the temporaries are a
plan for this backend.
"""

from __future__ import annotations

import dataclasses
import json

import jax
from absl import flags
from flax import nnx

from sage_jax import config_file, multihost, run_config
from sage_jax import sharding as shd
from sage_jax.model.qwen2 import abstract_model
from sage_jax.tools.memory_plan import model_config

config_file.define_flag("config", "The run's config (configs/sage.py:<preset>).")


def _gib(n: int) -> float:
  return round(n / 2**30, 3)


def main(argv):
  del argv
  devices = jax.device_count()
  run = run_config.resolve(flags.FLAGS.config, devices, devices)
  cfg = model_config(run.model)
  train_mesh = shd.make_mesh(run.mesh)
  model = abstract_model(cfg)
  # The trainer's parameters as abstract arrays, sharded as the trainer holds them.
  shardings = shd.state_shardings(nnx.state(model), train_mesh)
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        nnx.state(model), shardings)
  # "auto" samples in bfloat16 on the accelerators the run is for (float32 on this CPU).
  sampler_mesh = (dataclasses.replace(run.sampler_mesh, param_dtype="bfloat16")
                  if run.sampler_mesh.param_dtype == "auto" else run.sampler_mesh)
  sync = multihost.WeightSync(model, sampler_mesh)
  result = {"config": flags.FLAGS["config"].config_filename, "devices": devices,
            "train_mesh": dict(train_mesh.shape), "sampler_tensor": run.sampler_mesh.tensor,
            "sampling_dtype": str(sync.dtype or cfg.param_dtype),
            "fused": sync.fuses, "adapters_folded": sync.folds_adapters}
  whole = sync.reshard.lower(params, whole=True)
  old_copy = whole["all"].out_info  # the copy a sync replaces: the previous one
  for way, lowered in (("whole", whole), ("layerwise", sync.reshard.lower(params)),
                       ("layerwise_replacing", sync.reshard.lower(params, replacing=old_copy))):
    analyses = {part: low.compile().memory_analysis() for part, low in lowered.items()}
    temps = {part: _gib(a.temp_size_in_bytes) for part, a in analyses.items()}
    result[way] = {"temp_gib": max(temps.values()), "temp_gib_by_program": temps,
                   "output_gib_aliased_to_the_old_copy": {
                       part: _gib(a.alias_size_in_bytes) for part, a in analyses.items()}}
    if way == "whole":
      result["copy_gib"] = _gib(analyses["all"].output_size_in_bytes)
  result["whole_over_layerwise_temp"] = round(
      result["whole"]["temp_gib"] / max(result["layerwise"]["temp_gib"], 1e-9), 1)
  print(json.dumps(result))


if __name__ == "__main__":
  config_file.run(main)
