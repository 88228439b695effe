"""The train step's two heaviest pieces on their own, against PyTorch; prints one JSON object.

    python bench/train_kernels.py [--tokens=2048 --embed=256 --vocab=151936]
                                  [--seq_len=4096 --heads=8 --kv_heads=2 --head_dim=32]

1. head: LM head + log-softmax of the targets (+ entropy for ours) with the backward pass
   into the hidden states and the head, for `tokens` positions: `model.logprobs.head_logprobs`
   against autodiff of the same formula in JAX and against PyTorch's
   `log_softmax(h @ W^T).gather(...)` (which computes no entropy).
2. attention: causal attention of one `seq_len`-token row, forward + backward:
   `model.blocked_attention` at each of `blocks` against PyTorch's
   `scaled_dot_product_attention(is_causal=True)` (its fused CPU flash-attention kernel).

Float32, warm (compile excluded), best of `repeats`, the systems interleaved round by round.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from sage_jax.model.blocked_attention import BlockedCausal, blocked_attention
from sage_jax.model.logprobs import head_logprobs


def _timer(fn, *args):
  jax.block_until_ready(fn(*args))

  def run():
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start

  return run


def _torch_timer(step):
  step()

  def run():
    start = time.perf_counter()
    step()
    return time.perf_counter() - start

  return run


def _autodiff_head(hidden, head, targets):
  """The same formula as `head_logprobs`, differentiated by JAX: [rows, t] each."""
  logits = jnp.einsum("rte,ve->rtv", hidden, head, preferred_element_type=jnp.float32)
  log_p = jax.nn.log_softmax(logits, axis=-1)
  logprob = jnp.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]
  return logprob, -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)


def head_systems(tokens: int, embed: int, vocab: int) -> dict:
  import torch

  rng = np.random.default_rng(0)
  hidden = rng.standard_normal((tokens, embed)).astype(np.float32)
  head = (0.02 * rng.standard_normal((vocab, embed))).astype(np.float32)
  targets = rng.integers(0, vocab, tokens)
  weights = rng.standard_normal(tokens).astype(np.float32)

  def jax_system(fn):
    def loss(h, w):
      lp, ent = fn(h[None], w, jnp.asarray(targets)[None])
      return jnp.sum(jnp.asarray(weights) * lp[0]), jax.lax.stop_gradient(ent).sum()
    grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    return _timer(grad, jnp.asarray(hidden), jnp.asarray(head))

  h = torch.tensor(hidden, requires_grad=True)
  w = torch.tensor(head, requires_grad=True)
  y, wt = torch.tensor(targets), torch.tensor(weights)

  def torch_step():
    lp = torch.log_softmax(h @ w.T, -1).gather(-1, y[:, None])[:, 0]
    (-(wt * lp).sum()).backward()
    h.grad = w.grad = None

  return {"ours": jax_system(head_logprobs), "jax_autodiff": jax_system(_autodiff_head),
          "torch": _torch_timer(torch_step)}


def attention_systems(seq_len: int, heads: int, kv_heads: int, head_dim: int,
                      blocks: list[int]) -> dict:
  import torch

  group = heads // kv_heads
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(keys[0], (1, seq_len, kv_heads, group, head_dim))
  k = jax.random.normal(keys[1], (1, seq_len, kv_heads, head_dim))
  v = jax.random.normal(keys[2], (1, seq_len, kv_heads, head_dim))
  weights = jax.random.normal(keys[3], q.shape)
  segments = jnp.ones((1, seq_len), jnp.int32)
  systems = {}
  for block in blocks:
    fn = lambda q, k, v, b=block: jnp.sum(blocked_attention(q, k, v, BlockedCausal(segments, b))
                                          * weights)
    systems[f"ours_block_{block}"] = _timer(jax.jit(jax.grad(fn, argnums=(0, 1, 2))), q, k, v)
  tq = torch.randn(1, heads, seq_len, head_dim, requires_grad=True)
  tk = torch.randn(1, kv_heads, seq_len, head_dim, requires_grad=True)
  tv = torch.randn(1, kv_heads, seq_len, head_dim, requires_grad=True)
  tw = torch.randn(1, heads, seq_len, head_dim)

  def torch_step():
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True,
                                                           enable_gqa=True)
    (out * tw).sum().backward()
    tq.grad = tk.grad = tv.grad = None

  systems["torch_sdpa"] = _torch_timer(torch_step)
  return systems


def measure(systems: dict, repeats: int) -> dict:
  times = {name: [] for name in systems}
  for _ in range(repeats):
    for name, run in systems.items():
      times[name].append(run())
  best = {name: min(t) for name, t in times.items()}
  return {"best_s": {k: round(v, 4) for k, v in best.items()},
          "all_s": {k: [round(x, 4) for x in v] for k, v in times.items()}}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--tokens", type=int, default=2048)
  p.add_argument("--embed", type=int, default=256)
  p.add_argument("--vocab", type=int, default=151936)
  p.add_argument("--seq_len", type=int, default=4096)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv_heads", type=int, default=2)
  p.add_argument("--head_dim", type=int, default=32)
  p.add_argument("--blocks", default="128,256,512")
  p.add_argument("--repeats", type=int, default=5)
  args = p.parse_args()

  out = {"bench": "train_kernels", "cpu_count": os.cpu_count(),
         "load_avg_1m": os.getloadavg()[0], "args": vars(args)}
  head = measure(head_systems(args.tokens, args.embed, args.vocab), args.repeats)
  head["torch_over_ours"] = round(head["best_s"]["torch"] / head["best_s"]["ours"], 3)
  head["autodiff_over_ours"] = round(head["best_s"]["jax_autodiff"] / head["best_s"]["ours"], 3)
  out["head"] = head
  blocks = [int(b) for b in args.blocks.split(",")]
  attention = measure(attention_systems(args.seq_len, args.heads, args.kv_heads,
                                        args.head_dim, blocks), args.repeats)
  attention["torch_over_ours"] = {
      name: round(attention["best_s"]["torch_sdpa"] / t, 3)
      for name, t in attention["best_s"].items() if name != "torch_sdpa"}
  out["attention"] = attention
  out["load_avg_1m_end"] = os.getloadavg()[0]
  print(json.dumps(out))


if __name__ == "__main__":
  main()
