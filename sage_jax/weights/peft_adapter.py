"""LoRA adapters in PEFT's format: adapter_config.json and adapter_model.safetensors.

`peft.PeftModel.from_pretrained(base, DIR)` applies them to the transformers model of the
base weights, so the adapters can be shared without the 32B they adapt. Tensor names are
PEFT's for `Qwen2ForCausalLM`: the HF name of the adapted weight with `.weight` replaced by
`.lora_A.weight` ([rank, in]) or `.lora_B.weight` ([out, rank]), under `base_model.model.`.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
from safetensors.numpy import save_file

from sage_jax.model import lora
from sage_jax.model.qwen2 import Qwen2
from sage_jax.weights.hf import _to_host, check_export_target, move_into_place, path_to_hf

_PREFIX = "base_model.model."


def adapter_config(config: lora.LoraConfig, base_model: str) -> dict:
  """PEFT's LoraConfig dict for adapters scaled by alpha / rank, without dropout or bias."""
  return {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
      "r": config.rank, "lora_alpha": config.alpha, "target_modules": sorted(config.targets),
      "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
      "use_dora": False, "init_lora_weights": True, "modules_to_save": None,
      "inference_mode": True,
  }


def save_peft_adapter(model: Qwen2, out_dir: str, *, base_model: str = "") -> list[str]:
  """Writes `model`'s adapters (float32) to `out_dir`; returns the tensor names. Like
  `hf.save_hf`, every process of a multi-host run calls it and process 0 writes, through
  `<out_dir>.tmp` so an interrupted export never looks complete, and replacing only a previous
  export (`hf.check_export_target`)."""
  config = model.config.lora
  if not config.enabled:
    raise ValueError("the model has no LoRA adapters to export")
  check_export_target(out_dir)
  tensors = {}
  for path, adapter in lora.adapters_by_kernel(model).items():
    hf_name, _ = path_to_hf(".".join(map(str, path)))
    stem = _PREFIX + hf_name[:-len(".weight")]
    tensors[stem + ".lora_A.weight"] = np.asarray(_to_host(adapter.a[...]), np.float32)
    tensors[stem + ".lora_B.weight"] = np.asarray(_to_host(adapter.b[...]), np.float32)
  if jax.process_index() != 0:
    return sorted(tensors)
  tmp = out_dir.rstrip("/") + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
    json.dump(adapter_config(config, base_model), f, indent=2)
  move_into_place(tmp, out_dir)
  return sorted(tensors)
