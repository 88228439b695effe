"""Memory planner: exact parameter counts and per-device bytes from shapes alone."""

import json
import subprocess
import sys

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
