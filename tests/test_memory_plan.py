"""Memory planner: exact parameter counts and per-device bytes from shapes alone."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from sage_jax.model import get_preset
from sage_jax.tools import memory_plan

QWEN32B_PARAMS = 32_763_876_352


def test_qwen25_32b_full_finetune_on_64_way_fsdp():
  cfg = get_preset("qwen2.5-32b", param_dtype="float32")
  result = memory_plan.plan(cfg, (1, 64, 1))
  assert result.num_params == QWEN32B_PARAMS == cfg.num_params()
  # fsdp shards the 5120-wide model axis of every matrix 64 ways; norms and the q/k/v
  # biases (no "embed" axis) stay replicated: 64 layers x (2 x 5120 norms + 5120 + 2 x 1024
  # biases) + the final 5120 norm.
  replicated = 64 * (2 * 5120 + 5120 + 2 * 1024) + 5120
  per_device = (QWEN32B_PARAMS - replicated) // 64 + replicated
  assert result.params_bytes_per_device == 4 * per_device
  assert result.grads_bytes_per_device == 4 * per_device
  assert result.optimizer_bytes_per_device == 2 * 4 * per_device  # AdamW mu + nu in fp32
  assert 7.6 < result.total_bytes_per_device / 2**30 < 7.7


def test_bf16_params_with_fp32_moments_and_tensor_parallel():
  cfg = get_preset("qwen2.5-7b", param_dtype="bfloat16")
  result = memory_plan.plan(cfg, (1, 4, 2), mu_dtype="float32")
  assert result.num_params == cfg.num_params()
  assert result.params_bytes_per_device < 2 * cfg.num_params() / 8 * 1.01
  assert result.optimizer_bytes_per_device > 2 * result.params_bytes_per_device  # fp32 mu


def test_command_prints_json():
  out = subprocess.run(
      [sys.executable, "-m", "sage_jax.tools.memory_plan", "--preset=qwen2.5-0.5b",
       "--mesh=1,8,1"], capture_output=True, text=True, check=True, timeout=300)
  result = json.loads(out.stdout)
  assert result["num_params"] == get_preset("qwen2.5-0.5b").num_params() == 494_032_768
  assert result["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}


def _run(name, preset, hosts, devices_per_host):
  from sage_jax import run_config  # noqa: PLC0415
  from tests.test_run_config import _config  # noqa: PLC0415
  return run_config.resolve(_config(name, preset), hosts * devices_per_host, devices_per_host)


def test_run_plan_counts_the_sampler_kv_cache_reference_and_activations():
  run = _run("sage", "qwen2.5-32b", hosts=8, devices_per_host=4)
  result = memory_plan.run_plan(run, hosts=8, devices_per_host=4, device_memory_gib=95)
  cfg = get_preset("qwen2.5-32b")
  # KV cache: 32 slots x 16384 positions x 64 layers x (K and V) x 8 KV heads / 4-way tensor
  # x 128 x bf16, the slots on one host's one data slice; a presence byte per slot and id.
  assert result.kv_cache_bytes_per_device == (32 * 16384 * 64 * 2 * 2 * 128 * 2
                                              + 32 * cfg.vocab_size)
  # The bf16 sampling copy, tensor-parallel over a host's 4 chips (norms replicated).
  assert 2 * cfg.num_params() / 4 < result.sampler_copy_bytes_per_device < (
      2 * cfg.num_params() / 4 * 1.01)
  assert result.reference_bytes_per_device == 0 and result.activation_bytes_per_device > 0
  assert result.fits
  with_kl = _run("sage", "qwen2.5-32b", hosts=8, devices_per_host=4)
  with_kl = with_kl.__class__(**{**with_kl.__dict__,
                                 "grpo": with_kl.grpo.__class__(kl_coef=0.01)})
  kl = memory_plan.run_plan(with_kl, hosts=8, devices_per_host=4, device_memory_gib=95)
  assert kl.reference_bytes_per_device == result.train.params_bytes_per_device


def test_a_run_plans_the_activations_of_its_largest_stage_and_kl_only_for_rl():
  """SFT's rows are as long as the longest example a run loads (engine.max_len), its logits
  in sft.logprob_chunk; RL's rows as long as the longest episode, in grpo.logprob_chunk. A
  run of both stages needs the larger; only RL keeps a KL reference."""
  run = _run("sage", "qwen2.5-32b", hosts=8, devices_per_host=4)

  def planned(stages, **sections):
    changed = {name: dataclasses.replace(getattr(run, name), **keys)
               for name, keys in sections.items()}
    return memory_plan.run_plan(dataclasses.replace(
        run, pipeline=dataclasses.replace(run.pipeline, stages=stages), **changed),
        hosts=8, devices_per_host=4)

  # Micro-batches of 8192 tokens: 2 RL rows of 4096, or one SFT row of 16384.
  short = dict(agent=dict(max_episode_tokens=4096), batch=dict(micro_batch_tokens=8192))
  sft = planned(("sft",), **short).activation_bytes_per_device
  rl = planned(("rl",), **short).activation_bytes_per_device
  assert sft > rl > 0
  assert planned(("sft", "rl"), **short).activation_bytes_per_device == sft
  whole = dict(logprob_chunk=0)  # the logits of a whole micro-batch at once
  assert planned(("sft",), **short, sft=whole).activation_bytes_per_device > sft
  assert planned(("rl",), **short, sft=whole).activation_bytes_per_device == rl
  assert planned(("rl",), **short, grpo=whole).activation_bytes_per_device > rl
  kl = dict(kl_coef=0.01)
  assert planned(("sft",), grpo=kl).reference_bytes_per_device == 0
  assert planned(("sft", "rl"), grpo=kl).reference_bytes_per_device > 0


def test_activations_count_the_working_sets_of_the_layers_not_rematted():
  """Only the layers in model.remat_layers drop their working set: each one left out of the
  list keeps one more, and rematting one layer of 24 saves nothing (its working set is live
  again while it is recomputed). A run's plan reads the list from its model section."""
  from sage_jax.weights.loader import ModelSpec  # noqa: PLC0415
  cfg = get_preset("qwen2.5-0.5b")

  def activations(**remat):
    return memory_plan.activation_bytes(cfg.replace(**remat), rows_per_device=2, row_len=4096,
                                        tensor=1, logprob_chunk=1024)

  every, none = activations(remat="full"), activations(remat="none")
  one, two = (activations(remat="full", remat_layers=layers) for layers in ((0,), (0, 1)))
  assert every == activations(remat="full", remat_layers=tuple(range(24))) < two < one == none
  assert one - two == (none - every) / 23  # a working set, of the 23 that full remat saves
  spec = ModelSpec(preset="tiny", remat="dots", remat_layers=(1,))
  assert memory_plan.model_config(spec).remat_layers == (1,)


def test_the_32b_sampler_does_not_fit_one_chip_per_copy():
  run = _run("sage", "qwen2.5-32b", hosts=8, devices_per_host=4)
  one_chip = run.__class__(**{**run.__dict__,
                              "sampler_mesh": run.sampler_mesh.__class__(tensor=1)})
  result = memory_plan.run_plan(one_chip, hosts=8, devices_per_host=4, device_memory_gib=95)
  assert result.fits is False


def test_config_command_prints_the_run_plan():
  out = subprocess.run(
      [sys.executable, "-m", "sage_jax.tools.memory_plan", "--config=configs/sage.py:qwen2.5-7b",
       "--hosts=1", "--devices_per_host=8", "--device_memory_gib=80"],
      capture_output=True, text=True, check=True, timeout=300)
  result = json.loads(out.stdout)
  assert result["mesh"] == {"data": 1, "fsdp": 4, "tensor": 2} and result["fits"] is True
  assert set(result["gib_per_device"]) == {"params", "grads", "optimizer", "kl_reference",
                                           "activations", "sampler_weights", "kv_cache", "total"}
  misspelt = subprocess.run(
      [sys.executable, "-m", "sage_jax.tools.memory_plan", "--config=configs/sage.py:qwen2.5-7b",
       "--config.grpo.group_sise=4"], capture_output=True, text=True, timeout=300)
  assert misspelt.returncode != 0 and "Traceback" not in misspelt.stderr
  assert "config section 'grpo' has no key 'group_sise'" in misspelt.stderr


def test_config_command_exits_1_naming_the_keys_when_the_run_does_not_fit():
  """A script gating a launch on the plan reads its status, and the advice the run's own
  start check would give comes with it."""
  out = subprocess.run(
      [sys.executable, "-m", "sage_jax.tools.memory_plan", "--config=configs/sage.py:qwen2.5-7b",
       "--hosts=1", "--devices_per_host=8", "--device_memory_gib=20"],
      capture_output=True, text=True, timeout=300)
  assert out.returncode == 1 and json.loads(out.stdout)["fits"] is False
  assert "does not fit: the run needs" in out.stderr and "Traceback" not in out.stderr
  assert "config.sampler_mesh.tensor" in out.stderr


def test_config_command_names_the_hardware_flags_when_the_preset_needs_more_devices():
  """The hardware defaults to one host of one device: a preset sized for a node says which
  flags plan it there, after the config's own check."""
  out = subprocess.run(
      [sys.executable, "-m", "sage_jax.tools.memory_plan",
       "--config=configs/sage.py:qwen2.5-32b-lora"], capture_output=True, text=True, timeout=300)
  assert out.returncode != 0 and "Traceback" not in out.stderr
  assert ("config.sampler_mesh.tensor: 8 does not divide the 1 devices of a host (the "
          "sampler's mesh is host-local); planned on --hosts=1 x --devices_per_host=1: pass the "
          "hardware the run is for") in out.stderr


@pytest.mark.parametrize("flag", ["--mesh=1,2,1", "--preset=qwen2.5-7b", "--param_dtype=bfloat16",
                                  "--mu_dtype=bfloat16"])
def test_config_command_refuses_the_preset_flags(flag):
  """They were ignored with --config: a plan of another mesh than the one asked for."""
  out = subprocess.run(
      [sys.executable, "-m", "sage_jax.tools.memory_plan", "--config=configs/sage.py:demo", flag],
      capture_output=True, text=True, timeout=300)
  assert out.returncode != 0 and "Traceback" not in out.stderr
  assert f"{flag.split('=')[0]} with --config: the plan follows the run's config" in out.stderr
  refused = subprocess.run(
      [sys.executable, "-m", "sage_jax.tools.memory_plan", "--config=configs/sage.py:qwen2.5-7b",
       "--config.grpo.group_size=0"], capture_output=True, text=True, timeout=300)
  assert refused.returncode != 0 and refused.stderr.strip().splitlines() == [
      "ConfigError: config.grpo.group_size must be >= 1, got 0"]


@pytest.mark.parametrize("args,message", [
    (["--preset=tiny", "--mesh=1,-1,1"], "--mesh='1,-1,1': expected data,fsdp,tensor"),
    (["--preset=tiny", "--mesh=1,x,1"], "--mesh='1,x,1': expected data,fsdp,tensor"),
    (["--preset=tiny", "--mesh=1,0,1"], "--mesh='1,0,1': expected data,fsdp,tensor"),
    (["--config=configs/sage.py:demo", "--hosts=0"], "--hosts=0 --devices_per_host=1: each"),
])
def test_bad_sizes_are_refused_in_one_line(args, message):
  """A -1 axis (the configs' "the rest") planned negative bytes; 0 divided by zero."""
  out = subprocess.run([sys.executable, "-m", "sage_jax.tools.memory_plan", *args],
                       capture_output=True, text=True, timeout=300)
  assert out.returncode != 0 and "Traceback" not in out.stderr and message in out.stderr


def test_lora_plan_trains_the_adapters_only():
  from sage_jax.model.lora import LoraConfig  # noqa: PLC0415

  cfg = get_preset("qwen2.5-32b", param_dtype="bfloat16")
  adapted = memory_plan.plan(cfg.replace(lora=LoraConfig(rank=16)), (1, 8, 1))
  # Rank 16 x (in + out) per projection: q and o (5120 + 5120), k and v (5120 + 1024), gate,
  # up and down (5120 + 27648), 64 layers.
  trainable = 64 * 16 * (2 * 10240 + 2 * 6144 + 3 * 32768)
  assert adapted.num_trainable == trainable and adapted.num_params == QWEN32B_PARAMS + trainable
  # Gradients and both AdamW moments: float32 adapters, at most replicated on every device.
  assert adapted.grads_bytes_per_device <= 4 * trainable
  assert adapted.optimizer_bytes_per_device == 2 * adapted.grads_bytes_per_device
  full = memory_plan.plan(cfg, (1, 8, 1))
  assert adapted.params_bytes_per_device - full.params_bytes_per_device <= 4 * trainable
  assert full.total_bytes_per_device > 3 * adapted.total_bytes_per_device


def test_the_32b_lora_preset_fits_one_node_of_8_h100_and_full_finetuning_does_not():
  """Full fine-tuning as the qwen2.5-32b preset does it (float32 master weights) needs 64 GB
  of train state per GPU before activations, sampler copy and KV cache."""
  run = _run("sage", "qwen2.5-32b-lora", hosts=1, devices_per_host=8)
  result = memory_plan.run_plan(run, hosts=1, devices_per_host=8, device_memory_gib=79.6)
  assert run.model.lora_rank == 16 and result.fits
  full = run.__class__(**{**run.__dict__, "model": run.model.__class__(
      **{**run.model.__dict__, "lora_rank": 0, "param_dtype": "float32"})})
  assert memory_plan.run_plan(full, hosts=1, devices_per_host=8,
                              device_memory_gib=79.6).fits is False


def test_a_lora_kl_reference_counts_the_adapters_only():
  """The KL reference copies what training changes, the adapters, and shares the frozen base
  with the trainer: float32 adapters as large and as sharded as their float32 gradients."""
  run = _run("sage", "qwen2.5-32b-lora", hosts=1, devices_per_host=8)
  run = run.__class__(**{**run.__dict__, "grpo": dataclasses.replace(run.grpo, kl_coef=0.01)})
  result = memory_plan.run_plan(run, hosts=1, devices_per_host=8, device_memory_gib=79.6)
  assert result.reference_bytes_per_device == result.train.grads_bytes_per_device > 0
  assert result.reference_bytes_per_device < result.train.params_bytes_per_device / 20


def _one_row(vocab_size, row_len):
  from sage_jax.rl import batch as B  # noqa: PLC0415
  mask = np.ones(row_len + 1, np.int8)
  mask[0] = 0
  logprobs = np.where(mask, -np.log(vocab_size), 0).astype(np.float32)
  record = dict(tokens=np.random.default_rng(0).integers(0, vocab_size, row_len + 1),
                loss_mask=mask, model_logprobs=logprobs, sampler_logprobs=logprobs,
                advantage=1.0)
  return B.make_batch([record], B.BatchConfig(micro_batch_tokens=row_len,
                                              length_buckets=(row_len,)))[0]


@pytest.mark.parametrize("row_len", [512, 1024])
def test_dense_attention_plans_at_least_the_temporaries_xla_plans_for_the_step(row_len):
  """XLA's backward pass of dense attention keeps several [heads, T, T] float32 arrays per
  layer, not one: the gradient and activations of the plan cover what XLA:CPU plans for the
  real train step (a compact vocabulary, so that attention is most of it), within 25%."""
  from sage_jax.model import init_model  # noqa: PLC0415
  from sage_jax.rl import grpo  # noqa: PLC0415
  from sage_jax.train.optimizer import OptimizerConfig  # noqa: PLC0415
  from sage_jax.train.rl_loop import grpo_trainer  # noqa: PLC0415

  cfg = get_preset("small", vocab_size=4096, attention_impl="xla")
  trainer = grpo_trainer(init_model(cfg), grpo.GRPOConfig(logprob_chunk=512),
                         OptimizerConfig(learning_rate=1e-6))
  temp = trainer.step_temp_bytes(_one_row(cfg.vocab_size, row_len))
  planned = (memory_plan.plan(cfg, (1, 1, 1)).grads_bytes_per_device
             + memory_plan.activation_bytes(cfg, 1, row_len, 1, logprob_chunk=512))
  assert temp <= planned < 1.25 * temp, (temp, planned)


def test_fused_kernels_keep_no_per_head_scores():
  """cuDNN (GPU) and splash (TPU) keep the softmax's log-sum-exp, not [heads, T, T] scores:
  splash's activations grow linearly with the row, cuDNN's only by its [rows, 1, T, T] mask
  bias. "auto" plans the kernel of the platform; without one, XLA's path."""
  from sage_jax.weights.loader import ModelSpec  # noqa: PLC0415
  cfg = get_preset("qwen2.5-7b", dtype="bfloat16", remat="full")

  def activations(platform, row_len):
    return memory_plan.activation_bytes(cfg, rows_per_device=2, row_len=row_len, tensor=2,
                                        logprob_chunk=1024, platform=platform)

  t = 4096
  second_difference = {platform: activations(platform, 3 * t) - 2 * activations(platform, 2 * t)
                       + activations(platform, t) for platform in ("tpu", "gpu", None)}
  assert second_difference["tpu"] == 0
  assert second_difference["gpu"] == 2 * 2 * t * t * 2  # 2 rows, bfloat16
  assert second_difference[None] > 100 * second_difference["gpu"]  # dense XLA, 14 heads
  assert [memory_plan.attention_kernel(cfg, t, platform) for platform in ("gpu", "tpu", None)
          ] == ["cudnn", "splash", "dense"]
  assert memory_plan.attention_kernel(cfg.replace(dtype="float32"), t, "gpu") == "dense"
  assert memory_plan.attention_kernel(cfg.replace(attention_block=1024), t, None) == "blocked"
  assert memory_plan.model_config(ModelSpec(preset="tiny", attention_impl="splash")
                                   ).attention_impl == "splash"
