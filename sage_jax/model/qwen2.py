"""Qwen2 decoder in Flax NNX: one set of modules for prefill, cached decode and training.

Module and attribute names follow HF's `Qwen2ForCausalLM` so the name table in
`sage_jax/weights/hf.py` stays a plain mapping. Kernels are stored in torch's order,
[out..., in...], with heads kept as their own axis, so tensor parallelism can split heads.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from sage_jax.model.attention_kernels import KernelCausal, kernel_attention, kernel_for
from sage_jax.model.blocked_attention import BlockedCausal, blocked_attention
from sage_jax.model.config import Qwen2Config
from sage_jax.model.lora import Adapter, LoraConfig, add_adapters
from sage_jax.model.ragged_decode import RaggedDecode, decode_kernel_for, ragged_decode_attention
from sage_jax.model.shape_only import ShapeOnlyRngs
from sage_jax.sharding import CACHE_AXES, constrain

_F32 = jnp.float32
# Up to this many rows (a decode step, a short prefill chunk), XLA:CPU multiplies faster when
# the product is written as [out, rows] (see `project`).
_FEW_ROWS = 64
# Logical axes of [rows, t, vocab] logits (and their gradient in model/logprobs.py).
LOGIT_AXES = ("act_batch", "act_len", "act_vocab")


def _param(rngs: nnx.Rngs | None, shape, dtype, axes, init: str) -> nnx.Param:
  if init == "ones":
    value = jnp.ones(shape, dtype)
  elif init == "zeros":
    value = jnp.zeros(shape, dtype)
  else:
    value = (0.02 * jax.random.normal(rngs.params(), shape, _F32)).astype(dtype)
  return nnx.Param(value, logical_axes=axes)


# --- KV cache ---------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  """Per-layer keys and values, [batch, max_len, kv_heads, head_dim] each.

  A token at position p of sequence b lives at index p of row b, so each sequence has its
  own length and position, and a slot can be refilled from position 0 for a new sequence:
  queries only ever see keys at positions <= their own, all written by this sequence.
  """

  k: list[jax.Array]
  v: list[jax.Array]

  @classmethod
  def zeros(cls, cfg: Qwen2Config, batch: int, max_len: int, dtype=None) -> "KVCache":
    shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    dtype = dtype or cfg.jnp_dtype
    make = lambda: constrain(jnp.zeros(shape, dtype), CACHE_AXES)
    return cls([make() for _ in range(cfg.num_hidden_layers)],
               [make() for _ in range(cfg.num_hidden_layers)])

  @property
  def max_len(self) -> int:
    return self.k[0].shape[1]


def _write(buf: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
  """Scatters new[b, t] to buf[b, positions[b, t]]; positions >= max_len are dropped (padding)."""
  rows = jnp.broadcast_to(jnp.arange(buf.shape[0])[:, None], positions.shape)
  return buf.at[rows, positions].set(new.astype(buf.dtype), mode="drop")


# --- Layers -----------------------------------------------------------------------------


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, param_dtype):
    self.weight = _param(None, (dim,), param_dtype, ("norm",), "ones")
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(_F32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.weight[...].astype(x.dtype) * y.astype(x.dtype)


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding (HF's half-split layout) of x: [b, t, heads, dim] at positions [b, t]."""
  dim = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=_F32) / dim))
  angles = positions.astype(_F32)[..., None] * inv_freq  # [b, t, dim/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
  half = dim // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin


def project(x: jax.Array, w: jax.Array, **dot_kwargs) -> jax.Array:
  """x [..., in] . w [out, in] -> [..., out], as one 2-D matmul with w as its [out, in]
  operand: for the few rows of a decode step, XLA:CPU runs that 1.2-1.5x faster than
  [in, out] weights or multi-axis contractions (bench/sampler.py).

  With at most `_FEW_ROWS` rows on CPU the product is written as [out, rows] and transposed
  after an optimization barrier, which stops XLA from folding the transpose back into the
  matmul: 1.2-1.4x faster again on a batch-8 decode step's MLP. Accelerators do not care.
  """
  lead = x.shape[:-1]
  rows = math.prod(lead)
  if rows <= _FEW_ROWS and jax.default_backend() == "cpu":
    y = jnp.einsum("ni,oi->on", x.reshape(rows, -1), w, **dot_kwargs)
    return jax.lax.optimization_barrier(y).T.reshape(lead + (-1,))
  return jnp.einsum("...i,oi->...o", x, w, **dot_kwargs)


class Linear(nnx.Module):
  """y = x . kernel (+ bias) with kernel [out..., in...] (torch's [out, in] order), contracted
  over its `n_in` trailing axes (flattened, see `project`). `axes` name the kernel's axes in
  that order. `lora`: an optional low-rank adapter (`lora.add_adapters`) added to the output.
  """

  def __init__(self, in_shape, out_shape, axes, *, bias: bool, param_dtype, rngs):
    in_shape, out_shape = tuple(in_shape), tuple(out_shape)
    self.n_in = len(in_shape)
    self.kernel = _param(rngs, out_shape + in_shape, param_dtype, axes, "normal")
    self.bias = (_param(None, out_shape, param_dtype, axes[:len(out_shape)], "zeros")
                 if bias else None)
    self.lora: Adapter | None = nnx.data(None)

  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.kernel[...].astype(x.dtype)
    out_shape = kernel.shape[:kernel.ndim - self.n_in]
    lead = x.shape[:x.ndim - self.n_in]
    flat_x = x.reshape(lead + (-1,))
    y = project(flat_x, kernel.reshape(math.prod(out_shape), -1))
    if self.lora is not None:
      y = y + self.lora(flat_x, project)
    y = y.reshape(lead + out_shape)
    if self.bias is not None:
      y = y + self.bias[...].astype(x.dtype)
    return y


class Attention(nnx.Module):
  """Grouped-query attention with q/k/v bias, optionally over a KV cache."""

  def __init__(self, cfg: Qwen2Config, *, rngs: nnx.Rngs):
    e, h, kv, d, pd = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                       cfg.head_dim, cfg.jnp_param_dtype)
    self.fused = cfg.fused_projections
    if self.fused:
      # Per KV head: its group of query heads, then its key and its value head, so tensor
      # parallelism splits whole groups as it splits the KV heads.
      self.qkv_proj = Linear((e,), (kv, h // kv + 2, d),
                             ("kv_heads", None, "head_dim", "embed"), bias=True,
                             param_dtype=pd, rngs=rngs)
    else:
      self.q_proj = Linear((e,), (h, d), ("heads", "head_dim", "embed"), bias=True,
                           param_dtype=pd, rngs=rngs)
      self.k_proj = Linear((e,), (kv, d), ("kv_heads", "head_dim", "embed"), bias=True,
                           param_dtype=pd, rngs=rngs)
      self.v_proj = Linear((e,), (kv, d), ("kv_heads", "head_dim", "embed"), bias=True,
                           param_dtype=pd, rngs=rngs)
    self.o_proj = Linear((h, d), (e,), ("embed", "heads", "head_dim"), bias=False,
                         param_dtype=pd, rngs=rngs)
    self.theta = cfg.rope_theta
    self.num_kv_heads = kv

  def _qkv(self, x):
    """Queries [b, t, heads, d], keys and values [b, t, kv_heads, d] of x."""
    if not self.fused:
      return self.q_proj(x), self.k_proj(x), self.v_proj(x)
    qkv = self.qkv_proj(x)  # [b, t, kv_heads, group + 2, d]
    b, t, kv, slots, d = qkv.shape
    return qkv[..., :-2, :].reshape(b, t, kv * (slots - 2), d), qkv[..., -2, :], qkv[..., -1, :]

  def __call__(self, x, positions, mask, kv_cache=None):
    q, k, v = self._qkv(x)
    q = constrain(rotary(q, positions, self.theta), ("act_batch", "act_len", "act_heads", None))
    k = rotary(k, positions, self.theta)
    if kv_cache is not None:
      k = constrain(_write(kv_cache[0], k, positions), CACHE_AXES)
      v = constrain(_write(kv_cache[1], v, positions), CACHE_AXES)
      kv_cache = (k, v)
      if not isinstance(mask, RaggedDecode):
        # Attend only over the cache prefix the mask covers (see `attend_len`).
        k, v = k[:, :mask.shape[-1]], v[:, :mask.shape[-1]]
    b, t, h, d = q.shape
    q_groups = q.reshape(b, t, self.num_kv_heads, h // self.num_kv_heads, d)
    if isinstance(mask, RaggedDecode):
      out = ragged_decode_attention(q[:, 0], k, v, mask.lengths)
    elif isinstance(mask, KernelCausal):
      out = kernel_attention(q_groups, k, v, mask).reshape(b, t, h, d)
    elif isinstance(mask, BlockedCausal):
      out = blocked_attention(q_groups, k, v, mask).reshape(b, t, h, d)
    elif kv_cache is not None and t == 1:
      out = _decode_attention(q[:, 0], k, v, mask[:, 0])
    else:
      scores = jnp.einsum("btkgd,bskd->bkgts", q_groups, k, preferred_element_type=_F32)
      scores = scores * (d ** -0.5)
      scores = jnp.where(mask[:, None, None], scores, jnp.finfo(_F32).min)
      probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
      out = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h, d)
    out = constrain(out, ("act_batch", "act_len", "act_heads", None))
    return self.o_proj(out), kv_cache


def _decode_attention(q, k, v, mask):
  """One query per sequence (q: [b, heads, d]) over cache keys / values k, v: [b, s, kv, d]
  where mask [b, s] allows; returns [b, 1, heads, d].

  A batched einsum over (batch, kv head) makes XLA transpose (copy) the attended cache
  window in every layer and decode step, which costs more than reading it. Here both
  products contract over all KV heads at once, with the batch as the only batch dimension,
  so K and V are read where they lie: the query becomes block-diagonal over heads (zero
  off the diagonal, so the sums are unchanged), and the output keeps the diagonal blocks.
  """
  b, s, kv, d = k.shape
  g = q.shape[1] // kv
  eye = jnp.eye(kv, dtype=q.dtype)
  q_blocks = jnp.einsum("bkgd,kj->bkdjg", q.reshape(b, kv, g, d), eye).reshape(b, kv * d, -1)
  batch_dot = lambda x, y, contract: jax.lax.dot_general(
      x, y, (contract, ((0,), (0,))), preferred_element_type=_F32)
  scores = batch_dot(k.reshape(b, s, kv * d), q_blocks, ((2,), (1,))) * (d ** -0.5)
  scores = jnp.where(mask[:, :, None], scores, jnp.finfo(_F32).min)  # [b, s, kv * g]
  probs = jax.nn.softmax(scores, axis=1).astype(v.dtype)
  blocks = batch_dot(probs, v.reshape(b, s, kv * d), ((1,), (1,)))  # [b, kv * g, kv * d]
  out = jnp.einsum("bkgjd,kj->bkgd", blocks.reshape(b, kv, g, kv, d), eye)
  return out.reshape(b, 1, kv * g, d).astype(v.dtype)


class MLP(nnx.Module):
  """SwiGLU feed-forward."""

  def __init__(self, cfg: Qwen2Config, *, rngs: nnx.Rngs):
    e, i, pd = cfg.hidden_size, cfg.intermediate_size, cfg.jnp_param_dtype
    self.fused = cfg.fused_projections
    if self.fused:
      self.gate_up_proj = Linear((e,), (2, i), (None, "mlp", "embed"), bias=False,
                                 param_dtype=pd, rngs=rngs)
    else:
      self.gate_proj = Linear((e,), (i,), ("mlp", "embed"), bias=False, param_dtype=pd,
                              rngs=rngs)
      self.up_proj = Linear((e,), (i,), ("mlp", "embed"), bias=False, param_dtype=pd, rngs=rngs)
    self.down_proj = Linear((i,), (e,), ("embed", "mlp"), bias=False, param_dtype=pd, rngs=rngs)

  def __call__(self, x):
    if self.fused:
      gate_up = self.gate_up_proj(x)  # [..., 2, mlp]
      h = jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]
    else:
      h = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)
    return self.down_proj(constrain(h, ("act_batch", "act_len", "act_mlp")))


class DecoderLayer(nnx.Module):

  def __init__(self, cfg: Qwen2Config, *, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_param_dtype)
    self.self_attn = Attention(cfg, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                            cfg.jnp_param_dtype)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x, positions, mask, kv_cache=None):
    attn, kv_cache = self.self_attn(self.input_layernorm(x), positions, mask, kv_cache)
    x = x + attn
    x = x + self.mlp(self.post_attention_layernorm(x))
    return constrain(x, ("act_batch", "act_len", "act_embed")), kv_cache


_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def _rematerialised_layer(layer, x, positions, mask, policy):
  """The training forward of `layer` (no cache) under `jax.checkpoint`, as a pure function of
  the layer's state: nnx's lifted remat writes the state back into the module afterwards,
  which fails for a module whose parameters come from two traces (LoRA: the adapters traced
  by the gradient, the frozen base by the step around it)."""
  graphdef, state = nnx.split(layer)

  def forward(state, x):
    return nnx.merge(graphdef, state)(x, positions, mask, None)

  return jax.checkpoint(forward, policy=policy)(state, x)


# --- Model ------------------------------------------------------------------------------


class Qwen2(nnx.Module):
  """Qwen2 causal LM.

  `__call__(tokens, positions, cache=..., segment_ids=...)` serves all three uses:
  - training: no cache; `segment_ids` (0 = padding) keep packed sequences apart;
  - prefill / decode: with a `KVCache`; each row writes its tokens at its own positions
    and attends to everything at or before them. Padding tokens in a row get a position
    >= cache length, so they are never written.
  """

  def __init__(self, cfg: Qwen2Config, *, rngs: nnx.Rngs):
    self.config = cfg
    pd = cfg.jnp_param_dtype
    self.embed_tokens = _param(rngs, (cfg.vocab_size, cfg.hidden_size), pd,
                               ("vocab", "embed"), "normal")
    self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
    self.lm_head = (None if cfg.tie_word_embeddings else
                    _param(rngs, (cfg.vocab_size, cfg.hidden_size), pd, ("vocab", "embed"),
                           "normal"))

  def hidden_states(self, tokens, positions, *, cache: KVCache | None = None,
                    segment_ids=None, attend_len: int | None = None):
    """Final-norm hidden states [b, t, embed] (and the updated cache).

    With a cache, `attend_len` (static, default the cache length) limits attention to cache
    indices [0, attend_len): a sampler that knows every query position is below it skips
    the empty tail of a long cache. Keys are still written anywhere in the cache.
    """
    cfg = self.config
    x = jnp.take(self.embed_tokens[...], tokens, axis=0).astype(cfg.jnp_dtype)
    x = constrain(x, ("act_batch", "act_len", "act_embed"))
    segments = jnp.ones_like(tokens) if segment_ids is None else segment_ids
    # Fused kernels serve training rows; sampling with a cache keeps the XLA paths.
    kernel = "xla" if cache is not None else kernel_for(cfg.attention_impl, cfg.jnp_dtype,
                                                         cfg.head_dim)
    if kernel != "xla":
      mask = KernelCausal(segments, kernel)
    elif cache is None and 0 < cfg.attention_block < tokens.shape[1]:
      mask = BlockedCausal(segments, cfg.attention_block)
    elif cache is None:
      mask = _training_mask(tokens.shape, segment_ids)
    else:
      attend_len = attend_len or cache.max_len
      if not 0 < attend_len <= cache.max_len:
        raise ValueError(f"attend_len={attend_len} must be in (0, {cache.max_len}]")
      if tokens.shape[1] == 1 and decode_kernel_for(cfg.decode_attention_impl,
                                                    cache.max_len) == "ragged":
        # Each sequence reads its own keys, up to its position (and the window).
        mask = RaggedDecode(jnp.clip(positions[:, 0] + 1, 0, attend_len))
      else:
        key_pos = jnp.arange(attend_len)
        mask = key_pos[None, None, :] <= positions[:, :, None]
    remat_layers = set(cfg.remat_layers) or set(range(cfg.num_hidden_layers))
    new_k, new_v = [], []
    for i, layer in enumerate(self.layers):
      # Remat is for training; sampling with a cache keeps no activations to save.
      if cfg.remat != "none" and cache is None and i in remat_layers:
        x, layer_cache = _rematerialised_layer(layer, x, positions, mask,
                                               _REMAT_POLICIES[cfg.remat])
      else:
        layer_cache = None if cache is None else (cache.k[i], cache.v[i])
        x, layer_cache = layer(x, positions, mask, layer_cache)
      if cache is not None:
        new_k.append(layer_cache[0])
        new_v.append(layer_cache[1])
    x = self.norm(x)
    return x, (None if cache is None else KVCache(new_k, new_v))

  def head_weight(self) -> jax.Array:
    """The output embedding [vocab, embed]: the input one when the two are tied."""
    return (self.embed_tokens if self.lm_head is None else self.lm_head)[...]

  def logits(self, hidden: jax.Array) -> jax.Array:
    """Float32 logits [..., vocab] of final hidden states."""
    out = project(hidden, self.head_weight().astype(hidden.dtype), preferred_element_type=_F32)
    return constrain(out, LOGIT_AXES) if out.ndim == 3 else out

  def __call__(self, tokens, positions, *, cache: KVCache | None = None, segment_ids=None):
    hidden, cache = self.hidden_states(tokens, positions, cache=cache, segment_ids=segment_ids)
    return self.logits(hidden), cache


def _training_mask(shape, segment_ids):
  """[b, t, t] causal mask; with segment ids, tokens attend only within their segment."""
  b, t = shape
  causal = jnp.tril(jnp.ones((t, t), jnp.bool_))[None]
  if segment_ids is None:
    return jnp.broadcast_to(causal, (b, t, t))
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  return causal & same


def init_model(cfg: Qwen2Config, seed: int = 0) -> Qwen2:
  """A randomly initialised model on the default device."""
  return Qwen2(cfg, rngs=nnx.Rngs(seed))


def abstract_model(cfg: Qwen2Config) -> Qwen2:
  """The structure, shapes and dtypes of the model `cfg` describes (with `cfg.lora`'s adapters,
  as `add_adapters` gives them), making no weights."""
  keys, base = ShapeOnlyRngs(), cfg.replace(lora=LoraConfig())
  return nnx.eval_shape(lambda: add_adapters(Qwen2(base, rngs=keys), cfg.lora, rngs=keys))
