"""Export of a LoRA-adapted model: merged full weights reload in transformers' Qwen2 with our
logits, and the PEFT adapter applied by `peft` to the base weights gives the same logits."""

import json
import os
import warnings

import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file

from sage_jax.model import lora
from sage_jax.weights import hf
from sage_jax.weights.peft_adapter import save_peft_adapter
from tests.hf_reference import hf_logits, tiny_hf_model

TOKENS = np.random.RandomState(0).randint(0, 512, (2, 16))


def _adapted(src, targets=lora.PROJECTIONS):
  model = lora.add_adapters(hf.load_hf(src), lora.LoraConfig(rank=4, alpha=8.0,
                                                             targets=targets), rngs=nnx.Rngs(3))
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


def test_a_float32_export_of_a_bfloat16_base_keeps_the_merged_sum(tmp_path):
  """The adapters train in float32 over a bfloat16 base: exported in float32, base + delta
  is summed and kept in float32, not rounded back to the base's bfloat16 first."""
  tiny_hf_model(str(tmp_path / "src"), dtype=torch.bfloat16)
  model = _adapted(str(tmp_path / "src"))
  path = ("layers", 0, "mlp", "up_proj", "kernel")
  kernel = dict(nnx.to_flat_state(nnx.state(model)))[path].get_value()
  assert kernel.dtype == jnp.bfloat16
  adapter = lora.adapters_by_kernel(model)[path]
  delta = adapter.scale * (adapter.b[...] @ adapter.a[...])
  want = np.asarray(kernel, np.float32) + np.asarray(delta)
  hf.save_hf(model, str(tmp_path / "f32"), dtype="float32")
  name = "model.layers.0.mlp.up_proj.weight"
  index = json.load(open(tmp_path / "f32" / "model.safetensors.index.json"))
  got = load_file(str(tmp_path / "f32" / index["weight_map"][name]))[name]
  assert got.dtype == np.float32
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  assert not np.array_equal(got, want.astype(jnp.bfloat16).astype(np.float32))


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


def _lora_run(run_dir, step, **model):
  """A LoRA run's workdir (config.json, a checkpoint at `step`) of a model whose adapters are
  random (B starts at zero); returns its trainer and resolved config."""
  from sage_jax import run_config  # noqa: PLC0415
  from sage_jax.rl import grpo  # noqa: PLC0415
  from sage_jax.train.checkpoint import CheckpointConfig, Checkpointer  # noqa: PLC0415
  from sage_jax.train.step import Trainer  # noqa: PLC0415
  from sage_jax.weights import loader  # noqa: PLC0415

  config = run_config.defaults()
  config.model.update(lora_rank=4, lora_alpha=8.0, **model)
  run = run_config.resolve(config)
  built = loader.build_model(run.model)
  rng = np.random.default_rng(2)
  for path, var in nnx.to_flat_state(nnx.state(built, lora.LoraParam)):
    var.set_value(jnp.asarray(rng.normal(size=var.shape) * 0.05, jnp.float32))
  trainer = Trainer(built, grpo.make_loss_fn(grpo.GRPOConfig()), run.optimizer)
  run_dir.mkdir(exist_ok=True)
  with open(run_dir / "config.json", "w") as f:
    json.dump(run_config.with_seeds(config, run), f)
  checkpointer = Checkpointer(CheckpointConfig(directory=str(run_dir / "checkpoints"),
                                               async_save=False))
  checkpointer.save(step, trainer.state)
  checkpointer.close()
  return trainer, run


def test_run_export_writes_merged_weights_and_the_peft_adapter(tmp_path):
  """A LoRA run's checkpoint through `sage_jax.export`: the merged model and the adapter."""
  from sage_jax import export, run_checkpoint  # noqa: PLC0415
  from sage_jax.weights import loader  # noqa: PLC0415

  trainer, run = _lora_run(tmp_path, 3, preset="tiny")
  export.export(str(tmp_path), str(tmp_path / "hf"))
  ours = _logits(trainer.model())
  np.testing.assert_allclose(hf_logits(_load(str(tmp_path / "hf")), TOKENS), ours, atol=1e-4)
  config_json = json.load(open(tmp_path / "hf" / export.ADAPTER_DIR / "adapter_config.json"))
  assert (config_json["r"], config_json["lora_alpha"]) == (4, 8.0)
  # Adapters of the bundled model name its Hugging Face release as their base, which PEFT
  # (AutoPeftModelForCausalLM) can fetch, and those of a Hugging Face cache snapshot its
  # repository at that revision; another path is kept as it is.
  snapshot = tmp_path / "hub" / "models--Qwen--Qwen2.5-7B-Instruct" / "snapshots" / "a09a3545"
  snapshot.mkdir(parents=True)
  for i, (base, named, revision) in enumerate((
      (loader.BUNDLED_0P5B, "Qwen/Qwen2.5-Coder-0.5B-Instruct", None),
      (str(snapshot), "Qwen/Qwen2.5-7B-Instruct", "a09a3545"),
      ("/ckpt/Qwen2.5-7B-Instruct", "/ckpt/Qwen2.5-7B-Instruct", None))):
    out = tmp_path / f"hf_{i}"
    export.write_model(trainer.model(), str(out), run_checkpoint.tokenizer_dir(str(tmp_path), run),
                       base_model=base)
    adapter = json.load(open(out / export.ADAPTER_DIR / "adapter_config.json"))
    assert (adapter["base_model_name_or_path"], adapter["revision"]) == (named, revision)


def test_a_runs_adapters_load_on_the_base_they_name(tmp_path, monkeypatch):
  """`AutoPeftModelForCausalLM` loads the adapters of a run from an HF directory (given
  relative to where the run started, with the preset of its shape) on that directory's
  weights, named by its absolute path."""
  from sage_jax import export  # noqa: PLC0415

  tiny_hf_model(str(tmp_path / "base"), vocab=151936)  # the "tiny" preset's architecture
  monkeypatch.chdir(tmp_path)
  trainer, _ = _lora_run(tmp_path / "run", 1, spec="base", preset="tiny")
  export.export(str(tmp_path / "run"), str(tmp_path / "hf"))
  adapter_dir = tmp_path / "hf" / export.ADAPTER_DIR
  base = json.load(open(adapter_dir / "adapter_config.json"))["base_model_name_or_path"]
  assert os.path.isabs(base) and os.path.samefile(base, tmp_path / "base")
  adapted = peft.AutoPeftModelForCausalLM.from_pretrained(str(adapter_dir)).eval()
  np.testing.assert_allclose(hf_logits(adapted, TOKENS), _logits(trainer.model()), atol=1e-4)


def test_a_run_from_a_checkpoint_exports_without_reading_its_base_weights(tmp_path):
  """The checkpoint holds every weight (the frozen base too): restoring it needs the base's
  config.json, not its weights, which a 32B run would otherwise read whole to learn shapes."""
  from sage_jax import export  # noqa: PLC0415

  tiny_hf_model(str(tmp_path / "base"), tied=False)
  trainer, _ = _lora_run(tmp_path / "run", 2, spec=str(tmp_path / "base"), preset="")
  (tmp_path / "base" / "model.safetensors").unlink()  # only its config.json stays
  export.export(str(tmp_path / "run"), str(tmp_path / "hf"))
  np.testing.assert_allclose(hf_logits(_load(str(tmp_path / "hf")), TOKENS),
                             _logits(trainer.model()), atol=1e-4)
