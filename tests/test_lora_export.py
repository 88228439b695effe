"""Export of a LoRA-adapted model: merged full weights reload in transformers' Qwen2 with our
logits, and the PEFT adapter applied by `peft` to the base weights gives the same logits."""

import json
import warnings

import jax.numpy as jnp
import numpy as np
import peft
import pytest
import transformers
from flax import nnx
from safetensors.numpy import load_file

from sage_jax.checkpoint import hf
from sage_jax.checkpoint.peft_adapter import save_peft_adapter
from sage_jax.model import lora
from tests.hf_reference import hf_logits, tiny_hf_model

TOKENS = np.random.RandomState(0).randint(0, 512, (2, 16))


def _adapted(src, targets=lora.PROJECTIONS):
  model = lora.add_adapters(hf.load_hf(src), lora.LoraConfig(rank=4, alpha=8.0,
                                                             targets=targets), seed=3)
  rng = np.random.default_rng(1)
  for path, var in nnx.to_flat_state(nnx.state(model, lora.LoraParam)):
    if path[-1] == "b":  # B starts at zero; make the adapters matter
      var.set_value(jnp.asarray(rng.normal(size=var.shape) * 0.05, jnp.float32))
  return model


def _logits(model):
  positions = jnp.broadcast_to(jnp.arange(TOKENS.shape[1]), TOKENS.shape)
  return np.asarray(model(jnp.asarray(TOKENS), positions)[0])


def _load(directory):
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no missing / unexpected weight warnings
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager", output_loading_info=True)
  assert not any(info.values()), info
  return model.eval()


@pytest.mark.parametrize("tied", [True, False])
def test_merged_export_reloads_in_transformers_with_same_logits(tmp_path, tied):
  tiny_hf_model(str(tmp_path / "src"), tied=tied)
  model = _adapted(str(tmp_path / "src"))
  ours = _logits(model)
  base = hf_logits(_load(str(tmp_path / "src")), TOKENS)
  assert np.abs(ours - base).max() > 1e-2  # the adapters change the model
  hf.save_hf(model, str(tmp_path / "merged"))
  index = json.load(open(tmp_path / "merged" / "model.safetensors.index.json"))
  assert not any("lora" in name for name in index["weight_map"])
  np.testing.assert_allclose(hf_logits(_load(str(tmp_path / "merged")), TOKENS), ours,
                             atol=1e-4)


def test_peft_adapter_loads_in_peft_with_same_logits(tmp_path):
  tiny_hf_model(str(tmp_path / "src"), tied=False)
  model = _adapted(str(tmp_path / "src"), targets=("q_proj", "o_proj", "down_proj"))
  names = save_peft_adapter(model, str(tmp_path / "adapter"), base_model=str(tmp_path / "src"))
  assert "base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight" in names
  saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
  assert saved["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 64)
  assert saved["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].shape == (64, 4)
  assert len(saved) == 2 * 3 * 2
  base = _load(str(tmp_path / "src"))
  assert np.abs(hf_logits(base, TOKENS) - _logits(model)).max() > 1e-2
  adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
  np.testing.assert_allclose(hf_logits(adapted, TOKENS), _logits(model), atol=1e-4)


def test_peft_export_of_a_model_without_adapters_is_refused(tmp_path):
  tiny_hf_model(str(tmp_path / "src"))
  with pytest.raises(ValueError, match="no LoRA adapters"):
    save_peft_adapter(hf.load_hf(str(tmp_path / "src")), str(tmp_path / "adapter"))
  assert not (tmp_path / "adapter").exists()
