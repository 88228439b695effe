#!/usr/bin/env bash
# The accelerator measurements of BENCHMARKS.md in one go, most important first: the kernel
# tests on the device, train-step MFU at 4096-token rows (Qwen2.5-0.5B and 1.5B shapes, beside
# PyTorch), decode up to batch 64 against the HBM roofline (beside transformers), the LoRA
# sampler step, and cuDNN against XLA attention in the train step. Random weights: speed does
# not depend on their values.
#
#   bench/gpu_suite.sh OUT_DIR [TOTAL_SECONDS]
#
# Each benchmark's output goes to OUT_DIR/<name>, every log to OUT_DIR/suite.log; one that
# fails or runs past its time limit is reported and the rest still run. The suite ends within
# TOTAL_SECONDS (default 3600): a benchmark gets its own limit or what is left, whichever is
# less, and none starts with under a minute left. JAX and PyTorch share the GPU in one
# process, so JAX takes less than its default share of its memory. `$PYTHON` (default
# python3) runs everything.
set -u
out=${1:?usage: bench/gpu_suite.sh OUT_DIR [TOTAL_SECONDS]}
deadline=$((SECONDS + ${2:-3600}))
py=${PYTHON:-python3}
mkdir -p "$out"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.45}
export PYTHONUNBUFFERED=1

run() {  # run FILE SECONDS COMMAND...
  local name=$1 limit=$2 left=$((deadline - SECONDS))
  shift 2
  if ((left < 60)); then
    echo "== $name: skipped, ${left}s left" | tee -a "$out/suite.log"
    return
  fi
  ((limit > left)) && limit=$left
  echo "== $name ($(date +%T), limit ${limit}s): $*" | tee -a "$out/suite.log"
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" > "$out/$name" 2>> "$out/suite.log"
  local rc=$?
  echo "-- $name rc=$rc in $((SECONDS - start))s: $(tail -c 600 "$out/$name")" | tee -a "$out/suite.log"
}

# The XLA path attends in blocks of 1024 (as the presets do); cuDNN ignores the block.
train=($py bench/train_step.py --seq_len=4096 --rows=1 --micro_batches=4 --dtype=bfloat16
       --attention_block=1024 --logprob_chunk=2048 --peak_n=8192 --steps=3)
# The cuDNN kernel against the XLA path (tests/conftest.py would pin JAX to the CPU).
run kernels_test.txt 150 $py -m pytest -q -p no:cacheprovider --noconftest -k cudnn \
    tests/test_attention_kernels.py
run train_0.5b.json 200 "${train[@]}" --preset=qwen2.5-0.5b --peer=torch
run decode_0.5b.json 200 $py bench/sampler.py --model=random:qwen2.5-0.5b --batches=1,8,64 \
    --systems=ours,transformers --nomultiturn --rounds=3
run train_1.5b.json 200 "${train[@]}" --preset=qwen2.5-1.5b --peer=torch
run decode_layouts.json 130 $py bench/decode_layouts.py --dtype=bfloat16 --batch=64
run train_0.5b_xla.json 150 "${train[@]}" --preset=qwen2.5-0.5b --attention_impl=xla
