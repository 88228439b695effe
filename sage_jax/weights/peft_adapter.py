"""LoRA adapters in PEFT's format: adapter_config.json and adapter_model.safetensors.

`peft.PeftModel.from_pretrained(base, DIR)` applies them to the transformers model of the
base weights, so the adapters can be shared without the 32B they adapt. Tensor names are
PEFT's for `Qwen2ForCausalLM`: the HF name of the adapted weight with `.weight` replaced by
`.lora_A.weight` ([rank, in]) or `.lora_B.weight` ([out, rank]), under `base_model.model.`.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from safetensors.numpy import save_file

from sage_jax.model import lora
from sage_jax.model.qwen2 import Qwen2
from sage_jax.weights.hf import _to_host, check_export_target, export_dir, path_to_hf

_PREFIX = "base_model.model."


def adapter_config(config: lora.LoraConfig, base_model: str,
                   base_revision: str | None = None) -> dict:
  """PEFT's LoraConfig dict for adapters scaled by alpha / rank, without dropout or bias, on
  `base_model` at `base_revision` (what `AutoPeftModelForCausalLM` loads them on)."""
  return {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
      "revision": base_revision,
      "r": config.rank, "lora_alpha": config.alpha, "target_modules": sorted(config.targets),
      "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
      "use_dora": False, "init_lora_weights": True, "modules_to_save": None,
      "inference_mode": True,
  }


def save_peft_adapter(model: Qwen2, out_dir: str, *, base_model: str = "",
                      base_revision: str | None = None) -> list[str]:
  """Writes `model`'s adapters to `out_dir` (`write_peft_adapter`); returns the tensor names.
  Like `hf.save_hf`: every process of a multi-host run calls it and process 0 writes, through
  `hf.export_dir`, replacing only a previous export (`hf.check_export_target`)."""
  check_export_target(out_dir)
  with export_dir(out_dir, writer=jax.process_index() == 0) as directory:
    return write_peft_adapter(model, directory, base_model=base_model,
                              base_revision=base_revision)


def write_peft_adapter(model: Qwen2, directory: str | None, *, base_model: str = "",
                       base_revision: str | None = None) -> list[str]:
  """Writes `model`'s adapters (float32) and their adapter_config.json (for `base_model` at
  `base_revision`) into `directory` (None: gather only, on the processes that do not write);
  returns the tensor names."""
  config = model.config.lora
  if not config.enabled:
    raise ValueError("the model has no LoRA adapters to export")
  tensors = {}
  for path, adapter in lora.adapters_by_kernel(model).items():
    hf_name, _ = path_to_hf(".".join(map(str, path)))
    stem = _PREFIX + hf_name[:-len(".weight")]
    tensors[stem + ".lora_A.weight"] = np.asarray(_to_host(adapter.a[...]), np.float32)
    tensors[stem + ".lora_B.weight"] = np.asarray(_to_host(adapter.b[...]), np.float32)
  if directory is None:
    return sorted(tensors)
  os.makedirs(directory, exist_ok=True)
  save_file(tensors, os.path.join(directory, "adapter_model.safetensors"),
            metadata={"format": "pt"})
  with open(os.path.join(directory, "adapter_config.json"), "w") as f:
    json.dump(adapter_config(config, base_model, base_revision), f, indent=2)
  return sorted(tensors)
