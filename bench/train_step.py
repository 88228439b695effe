"""Train-step throughput and model FLOPs utilisation; prints one JSON object.

    python bench/train_step.py --preset=small --seq_len=512 --rows=4 --micro_batches=2

Measures, in the same process and interleaved round by round (so both see the same machine
load): (1) the peak of this machine, the best of 3 large float32 (or the compute dtype's)
matmuls per round; (2) one warm GRPO train step per round (compile excluded) on packed
random sequences of `seq_len` tokens: tokens/s and model FLOPs/s, where model FLOPs per token
= 6 * (matmul parameters, LM head included) + 12 * layers * heads * head_dim * seq_len (the
attention scores and values, forward + backward; PaLM's MFU definition). MFU = model FLOP/s /
peak. Rematerialisation is extra work that MFU does not credit.

`temp_bytes` is what XLA plans for the step's temporaries (activations, logits, attention
scores), read from the compiled step. `setup_bytes_over_params`: the bytes of every live
array once the model and its trainer exist (parameters, optimiser state), over the
parameters' bytes: 3 under AdamW when the trainer holds the model's own arrays.

`--zero_advantages` also times, in the same rounds, the step on the same batch with every
advantage 0 (as when every rollout of every group scored alike): with no KL and no entropy
term its loss has no gradient, and the step runs only the forward pass of each micro-batch.

`--one_row` also times, in the same rounds, the same sequences packed into one row of
rows x micro_batches x seq_len positions, a single micro-batch: the layout a micro-batch
budget of that many tokens gives (and what a smaller budget gave before the batch layout kept
micro-batches within it), against the one measured here.

`--peer=torch` also times the same update in PyTorch, in the same process: transformers'
`Qwen2ForCausalLM` (same shapes, sdpa attention) with a per-token weighted log-likelihood loss
over the same micro-batches, gradient accumulation and `torch.optim.AdamW`. With `--pack`, each
packed sequence is a row of its own there (rows x pack rows of seq_len / pack positions): the
same attention work as ours, which keeps a query within its own sequence. On a CUDA GPU it
runs there, float32 master weights with bfloat16 autocast when `--dtype=bfloat16`, and
gradient checkpointing per layer when `--remat` is not "none" (as ours).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sage_jax import sharding as shd
from sage_jax.model import attention_kernels, get_preset, init_model
from sage_jax.rl import batch as B
from sage_jax.rl import grpo
from sage_jax.train.optimizer import OptimizerConfig
from sage_jax.train.rl_loop import grpo_trainer


def matmul_timer(n: int, dtype):
  """A callable timing one n x n x n matmul (seconds), compiled and warmed up."""
  a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), dtype)
  b = jnp.asarray(np.random.default_rng(1).standard_normal((n, n)), dtype)
  f = jax.jit(lambda x, y: x @ y)
  f(a, b).block_until_ready()

  def run() -> float:
    t = time.perf_counter()
    f(a, b).block_until_ready()
    return time.perf_counter() - t

  return run


def torch_peer(cfg, batch, steps: int, threads: int = 0, pack: int = 1) -> dict:
  """Median seconds of a transformers Qwen2 train step on the same micro-batches, each row's
  `pack` sequences (which fill it exactly, one after the other) as rows of their own."""
  import contextlib

  import torch
  import transformers

  if threads:
    torch.set_num_threads(threads)
  torch.manual_seed(0)
  device = "cuda" if torch.cuda.is_available() else "cpu"
  hf = transformers.Qwen2Config(**{k: v for k, v in cfg.to_hf().items() if k != "dtype"})
  model = transformers.Qwen2ForCausalLM._from_config(hf, attn_implementation="sdpa",
                                                     torch_dtype=torch.float32).to(device)
  if cfg.remat != "none":
    model.gradient_checkpointing_enable()
  model.train()
  opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
  def unpacked(x):  # [rows, seq_len] -> [rows * pack, seq_len / pack]
    return np.asarray(x).reshape(-1, x.shape[-1] // pack)

  segments = unpacked(batch.segment_ids)
  if (segments != segments[:, :1]).any() or (segments == 0).any():
    raise ValueError("the packed sequences do not fill their rows exactly")
  micros = [tuple(torch.as_tensor(unpacked(x), dtype=dtype, device=device) for x, dtype in (
      (batch.tokens[m], torch.long), (batch.targets[m], torch.long),
      (batch.weights[m] * batch.advantages[m], torch.float32)))
            for m in range(batch.shape[0])]
  autocast = (torch.autocast(device, dtype=torch.bfloat16) if cfg.dtype == "bfloat16"
              else contextlib.nullcontext())

  def step():
    for tokens, targets, weights in micros:
      with autocast:
        logits = model(input_ids=tokens).logits.float()
      logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
      (-(weights * logp).sum()).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device == "cuda":
      torch.cuda.synchronize()

  step()  # warm-up
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
  return {"torch_version": torch.__version__, "torch_device": device,
          "torch_dtype": "bfloat16 autocast" if cfg.dtype == "bfloat16" else "float32",
          "torch_gradient_checkpointing": cfg.remat != "none",
          "torch_threads": torch.get_num_threads(),
          "step_s_median": round(statistics.median(times), 4),
          "step_s_all": [round(x, 4) for x in times]}


def model_flops_per_token(cfg, seq_len: int) -> float:
  e, i, l = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
  q = cfg.num_attention_heads * cfg.head_dim
  kv = cfg.num_key_value_heads * cfg.head_dim
  matmul = l * (e * q + 2 * e * kv + q * e + 3 * e * i) + cfg.vocab_size * e
  return 6 * matmul + 12 * l * q * seq_len


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--preset", default="small")
  p.add_argument("--vocab_size", type=int, default=0, help="0 = the preset's")
  p.add_argument("--seq_len", type=int, default=512)
  p.add_argument("--rows", type=int, default=4, help="rows per micro-batch")
  p.add_argument("--pack", type=int, default=1,
                 help="sequences packed per row (RL batches pack episodes); the torch peer "
                      "gets each sequence as a row of its own")
  p.add_argument("--micro_batches", type=int, default=2)
  p.add_argument("--dtype", default="float32", help="compute dtype (params stay float32)")
  p.add_argument("--remat", default="none")
  p.add_argument("--attention_block", type=int, default=0, help="0 = dense attention")
  p.add_argument("--attention_impl", default="auto",
                 help="auto (cuDNN on GPU, splash on TPU, XLA elsewhere), xla, cudnn, splash")
  p.add_argument("--logprob_chunk", type=int, default=0)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--peak_n", type=int, default=2048)
  p.add_argument("--mesh", default="", help="data,fsdp,tensor (default: one device)")
  p.add_argument("--one_row", action="store_true",
                 help="also time the same sequences as one row in one micro-batch")
  p.add_argument("--peer", default="", choices=["", "torch"],
                 help="also time the same update in PyTorch/transformers")
  p.add_argument("--torch_threads", type=int, default=0, help="0 = torch's default")
  p.add_argument("--zero_advantages", action="store_true",
                 help="also time the step on the same batch with every advantage 0")
  args = p.parse_args()

  cfg = get_preset(args.preset).replace(dtype=args.dtype, remat=args.remat,
                                        attention_block=args.attention_block,
                                        attention_impl=args.attention_impl)
  if args.vocab_size:
    cfg = cfg.replace(vocab_size=args.vocab_size)
  mesh = None
  if args.mesh:
    data, fsdp, tensor = (int(x) for x in args.mesh.split(","))
    mesh = shd.make_mesh(shd.MeshConfig(data=data, fsdp=fsdp, tensor=tensor))
    model = shd.create_sharded(lambda: init_model(cfg, seed=0), mesh)
  else:
    model = init_model(cfg, seed=0)
  config = grpo.GRPOConfig(logprob_chunk=args.logprob_chunk)
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
  trainer = grpo_trainer(model, config, OptimizerConfig(learning_rate=1e-6), mesh=mesh)
  gc.collect()
  setup_bytes = sum(x.nbytes for x in jax.live_arrays())

  # `pack` sequences of exactly seq_len / pack + 1 tokens fill a row of seq_len positions
  # with no padding.
  rng = np.random.default_rng(0)
  if args.seq_len % args.pack:
    p.error(f"--pack={args.pack} must divide --seq_len={args.seq_len}")
  n_seq, seq_tokens = args.rows * args.micro_batches * args.pack, args.seq_len // args.pack + 1
  records = []
  for _ in range(n_seq):
    mask = (rng.random(seq_tokens) < 0.5).astype(np.int8)
    mask[0] = 0
    lp = np.where(mask, -np.log(cfg.vocab_size), 0).astype(np.float32)
    records.append(dict(tokens=rng.integers(0, cfg.vocab_size, seq_tokens),
                        loss_mask=mask, model_logprobs=lp, sampler_logprobs=lp,
                        advantage=float(rng.normal())))
  batch_config = B.BatchConfig(micro_batch_tokens=args.rows * args.seq_len,
                               num_micro_batches=args.micro_batches,
                               length_buckets=(args.seq_len,))
  batch, info = B.make_batch(records, batch_config)
  assert batch.shape == (args.micro_batches, args.rows, args.seq_len), batch.shape
  device_batch = trainer.place_batch(batch)
  zero_batch = trainer.place_batch(batch.replace(advantages=np.zeros_like(batch.advantages)))
  if args.one_row:
    positions = args.rows * args.micro_batches * args.seq_len
    row_batch = B.make_batch(records, B.BatchConfig(micro_batch_tokens=positions,
                                                    length_buckets=(positions,)))[0]
    assert row_batch.shape == (1, 1, positions), row_batch.shape
    row_batch = trainer.place_batch(row_batch)
    row_temp_bytes = trainer.step_temp_bytes(row_batch)
    jax.block_until_ready(trainer.step(row_batch))

  temp_bytes = trainer.step_temp_bytes(device_batch)
  t = time.perf_counter()
  jax.block_until_ready(trainer.step(device_batch))
  compile_s = time.perf_counter() - t
  peak_dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
  matmul = matmul_timer(args.peak_n, peak_dtype)
  times, zero_times, row_times, peaks, mfus = [], [], [], [], []
  tokens = info.real_positions
  flops_tok = model_flops_per_token(cfg, args.seq_len // args.pack)
  for _ in range(args.steps):
    t = time.perf_counter()
    jax.block_until_ready(trainer.step(device_batch))
    times.append(time.perf_counter() - t)
    if args.zero_advantages:
      t = time.perf_counter()
      jax.block_until_ready(trainer.step(zero_batch))
      zero_times.append(time.perf_counter() - t)
    if args.one_row:
      t = time.perf_counter()
      jax.block_until_ready(trainer.step(row_batch))
      row_times.append(time.perf_counter() - t)
    peaks.append(2 * args.peak_n ** 3 / min(matmul() for _ in range(3)))
    mfus.append(tokens * flops_tok / times[-1] / peaks[-1])
  assert trainer.num_compiled == 1 + args.one_row
  step_s = statistics.median(times)
  peak = statistics.median(peaks)
  out = {
      "bench": "train_step",
      "device": jax.devices()[0].device_kind,
      "platform": jax.default_backend(),
      "num_devices": jax.device_count(),
      "cpu": platform.processor() or platform.machine(),
      "cpu_count": os.cpu_count(),
      "load_avg_1m": os.getloadavg()[0],
      "preset": args.preset, "params": cfg.num_params(), "vocab_size": cfg.vocab_size,
      "dtype": args.dtype, "remat": args.remat, "logprob_chunk": args.logprob_chunk,
      "attention_block": args.attention_block, "temp_bytes": temp_bytes,
      "param_bytes": param_bytes, "setup_bytes": setup_bytes,
      "setup_bytes_over_params": round(setup_bytes / param_bytes, 3),
      "attention_kernel": attention_kernels.kernel_for(cfg.attention_impl, cfg.jnp_dtype,
                                                       cfg.head_dim),
      "seq_len": args.seq_len, "pack": args.pack, "rows": args.rows,
      "micro_batches": args.micro_batches,
      "tokens_per_step": tokens,
      "compile_s": round(compile_s, 2),
      "step_s_median": round(step_s, 4),
      "step_s_all": [round(x, 4) for x in times],
      "tokens_per_s": round(tokens / step_s, 1),
      "model_flops_per_token": flops_tok,
      "model_flops_per_s": round(tokens * flops_tok / step_s, 1),
      "peak_matmul_flops_per_s": round(peak, 1),
      "peak_matmul": f"{args.peak_n}^3 {np.dtype(peak_dtype).name}",
      "mfu": round(statistics.median(mfus), 4),
      "mfu_all": [round(x, 4) for x in mfus],
  }
  if zero_times:
    out["zero_advantage_step_s_median"] = round(statistics.median(zero_times), 4)
    out["zero_advantage_step_s_all"] = [round(x, 4) for x in zero_times]
    out["zero_advantage_speedup"] = round(step_s / statistics.median(zero_times), 3)
  if row_times:
    out["one_row_temp_bytes"] = row_temp_bytes
    out["one_row_step_s_median"] = round(statistics.median(row_times), 4)
    out["one_row_step_s_all"] = [round(x, 4) for x in row_times]
    out["speedup_vs_one_row"] = round(statistics.median(row_times) / step_s, 3)
  if args.peer == "torch":
    peer = torch_peer(cfg, batch, args.steps, args.torch_threads, args.pack)
    peer["tokens_per_s"] = round(tokens / peer["step_s_median"], 1)
    out["torch_peer"] = peer
    out["speedup_vs_torch"] = round(peer["step_s_median"] / step_s, 3)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
