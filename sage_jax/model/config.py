"""Qwen2 architecture hyper-parameters: presets and the HF `config.json` mapping.

Presets serve models built from scratch and memory plans; when importing weights the
checkpoint's own `config.json` is the truth (`Qwen2Config.from_hf`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from sage_jax.model import ragged_decode
from sage_jax.model.attention_kernels import check_implementation
from sage_jax.model.lora import LoraConfig

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_from_name(name: str) -> Any:
  """Maps a dtype name from a config to a jnp dtype, with an error naming the choices."""
  try:
    return _DTYPES[name]
  except KeyError:
    raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def check_remat(mode: str) -> None:
  """Rematerialisation modes of decoder layers: "none", "full" (save nothing) or "dots"."""
  if mode not in ("none", "full", "dots"):
    raise ValueError(f"remat={mode!r}; expected 'none', 'full' or 'dots'")


def check_attention_block(block: int) -> None:
  """Block size of training attention: 0 (dense) or a positive number of tokens."""
  if not isinstance(block, int) or block < 0:
    raise ValueError(f"attention_block={block!r}; expected 0 (dense) or a positive token count")


class CheckpointError(ValueError):
  """A checkpoint that does not match the model it is loaded into."""


def read_checkpoint_json(path: str) -> Any:
  """A checkpoint's JSON file; a missing or malformed one raises CheckpointError naming it."""
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    raise CheckpointError(f"{path}: not found") from None
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def sliding_window(hf: dict[str, Any]) -> int | None:
  """The window transformers gives sliding layers: none without use_sliding_window, else
  sliding_window (null: none; absent: transformers' default, 4096)."""
  return hf.get("sliding_window", 4096) if hf.get("use_sliding_window") else None


def windowed_layers(hf: dict[str, Any]) -> list[int]:
  """The layers transformers marks "sliding_attention": those `layer_types` marks, or without
  layer_types, where there is a window, those from max_window_layers on (the Qwen2.5 releases
  set max_window_layers to at least their depth)."""
  if hf.get("layer_types") is not None:
    return [i for i, kind in enumerate(hf["layer_types"]) if kind == "sliding_attention"]
  if sliding_window(hf) is None:
    return []
  first = hf.get("max_window_layers", 28)
  return list(range(first, hf.get("num_hidden_layers") or 0))


def check_supported(hf: dict[str, Any], source: str) -> None:
  """Refuses HF config settings the model does not implement: loaded anyway, it would compute
  another function than transformers and vLLM do on the same checkpoint, without a sign."""
  for field in ("rope_scaling", "rope_parameters"):
    rope = hf.get(field) or {}
    # rope_parameters may also hold one set per layer type ({"full_attention": {...}}).
    types = [p.get("rope_type", p.get("type", "default"))
             for p in ([v for v in rope.values() if isinstance(v, dict)] or [rope])]
    rope_type = next((t for t in types if t != "default"), "default")
    if rope_type != "default":
      fix = ("remove rope_scaling from config.json" if field == "rope_scaling" else
             "keep only rope_type 'default' and rope_theta in config.json's rope_parameters")
      native = rope.get("original_max_position_embeddings")
      raise CheckpointError(
          f"{source}: {field}={rope}: the model implements the default RoPE only, not "
          f"{rope_type!r}. To train at the native context, {fix}"
          + (f" and set max_position_embeddings to {native}" if native else ""))
  windowed, window = windowed_layers(hf), sliding_window(hf)
  full = " and every layer 'full_attention' in layer_types" if hf.get("layer_types") else ""
  if windowed and window is None:  # transformers builds such a model but fails to run it
    raise CheckpointError(
        f"{source}: layer_types marks layers {windowed} 'sliding_attention' without a window "
        f"(use_sliding_window={hf.get('use_sliding_window', False)!r}, sliding_window="
        f"{hf.get('sliding_window', 4096)!r}), which transformers cannot run. Mark every layer "
        "'full_attention' in config.json to use it with full attention")
  if windowed:
    raise CheckpointError(
        f"{source}: use_sliding_window={hf['use_sliding_window']!r} with a window of "
        f"{window} tokens on layers {windowed}: the model implements full attention only. Set "
        f"use_sliding_window to false{full} in config.json (as the Qwen2.5 releases do) to use "
        "it with full attention")
  if dropout := hf.get("attention_dropout") or 0.0:
    raise CheckpointError(f"{source}: attention_dropout={dropout}: the model implements no "
                          "dropout, which transformers applies in training; set it to 0.0 in "
                          "config.json (as the Qwen2.5 releases do)")
  if quantization := hf.get("quantization_config"):
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    raise CheckpointError(
        f"{source}: quantization_config (quant_method={method!r}): the checkpoint's weights are "
        "quantised (packed integers or 8-bit floats with scales), which the model does not "
        "read; use the full-precision release (e.g. Qwen/Qwen2.5-7B-Instruct rather than its "
        "-AWQ or -GPTQ-Int4 variant)")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise CheckpointError(f"{source}: hidden_act={act!r}: the model implements 'silu' only "
                          "(Qwen2.5's MLP), so it cannot run this checkpoint")


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
  """Shape and numerics of a Qwen2 decoder. Field names follow HF's `Qwen2Config`."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 32768
  # Qwen2.5's ids; None where a checkpoint's config.json has none (transformers' reading).
  bos_token_id: int | None = 151643
  eos_token_id: int | None = 151645
  # Numerics: parameters are stored in `param_dtype`, matmuls run in `dtype`; norms,
  # softmax and logits are always accumulated in float32.
  param_dtype: str = "float32"
  dtype: str = "float32"
  # Rematerialisation per decoder layer: "none", "full" (save nothing) or
  # "dots" (save matmul outputs without batch dims). `remat_layers` picks which
  # layers (empty = all) so memory can be traded per layer.
  remat: str = "none"
  remat_layers: tuple[int, ...] = ()
  # Training attention over rows longer than this many tokens runs this many at a time
  # (`blocked_attention`): memory grows with length x block, not length^2. 0 = always dense.
  attention_block: int = 0
  # Training attention's kernel (`attention_kernels`): "auto" (cuDNN on GPU, Pallas splash on
  # TPU, XLA elsewhere), "xla" (dense or blocked as above), "cudnn" or "splash".
  attention_impl: str = "auto"
  # The sampler's decode attention (`ragged_decode`): "auto" (the ragged Pallas kernel on TPU,
  # XLA elsewhere), "xla" or "ragged".
  decode_attention_impl: str = "auto"
  # Low-rank adapters on the projections (`lora.add_adapters` sets this; rank 0 = none).
  lora: LoraConfig = LoraConfig()
  # The sampler's layout (`fused_projections.fuse` makes it from the trained one): q/k/v as
  # one `qkv_proj` and gate/up as one `gate_up_proj`, so a decode step runs 4 matmuls a layer
  # instead of 7. It has no HF names and takes no adapters.
  fused_projections: bool = False

  def __post_init__(self):
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
          f"num_attention_heads={self.num_attention_heads} is not a multiple of "
          f"num_key_value_heads={self.num_key_value_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
    check_remat(self.remat)
    if outside := [i for i in self.remat_layers if not 0 <= i < self.num_hidden_layers]:
      raise ValueError(f"remat_layers={tuple(self.remat_layers)}: layers {outside} are not among "
                       f"the model's {self.num_hidden_layers} (0-{self.num_hidden_layers - 1})")
    check_attention_block(self.attention_block)
    check_implementation(self.attention_impl)
    ragged_decode.check_implementation(self.decode_attention_impl)
    dtype_from_name(self.param_dtype)
    dtype_from_name(self.dtype)
    if self.fused_projections and self.lora.enabled:
      raise ValueError("fused_projections is the sampler's layout without adapters: fold the "
                       "LoRA adapters into their kernels first (lora.fold_adapters)")

  def replace(self, **changes) -> "Qwen2Config":
    return dataclasses.replace(self, **changes)

  @property
  def jnp_param_dtype(self):
    return dtype_from_name(self.param_dtype)

  @property
  def jnp_dtype(self):
    return dtype_from_name(self.dtype)

  def check_token_ids(self, ids: Any, name: str) -> None:
    """Refuses ids outside the vocabulary, naming some: on device their embedding lookup
    gives NaN (or a clamped row), which attention spreads over the whole sequence."""
    ids = np.asarray(ids)
    if ids.size and not 0 <= ids.min() <= ids.max() < self.vocab_size:
      bad = sorted(set(ids[(ids < 0) | (ids >= self.vocab_size)].tolist()))
      raise ValueError(f"{name} hold ids outside the model's vocabulary "
                       f"[0, {self.vocab_size}): {bad[:5]}")

  def num_params(self) -> int:
    """Exact parameter count, the LM head counted once when tied."""
    e, i, l = self.hidden_size, self.intermediate_size, self.num_hidden_layers
    q = self.num_attention_heads * self.head_dim
    kv = self.num_key_value_heads * self.head_dim
    attn = e * q + q + 2 * (e * kv + kv) + q * e
    per_layer = attn + 3 * e * i + 2 * e
    head = 0 if self.tie_word_embeddings else self.vocab_size * e
    return self.vocab_size * e + l * per_layer + e + head

  # --- HF config.json ---------------------------------------------------------------

  @classmethod
  def from_hf(cls, hf: dict[str, Any] | str, **overrides) -> "Qwen2Config":
    """Builds the config from an HF `config.json` (a dict, a file or a model directory)."""
    source = "config dict"
    if isinstance(hf, (str, os.PathLike)):
      path = os.path.join(hf, "config.json") if os.path.isdir(hf) else str(hf)
      source = path
      hf = read_checkpoint_json(path)
    # Null means unset, as in transformers, but for sliding_window, where it means no window.
    hf = {k: v for k, v in hf.items() if v is not None or k == "sliding_window"}
    arch = hf.get("model_type")
    if arch not in ("qwen2", None):
      raise CheckpointError(f"{source}: model_type={arch!r}, expected 'qwen2'")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                           "num_hidden_layers", "num_attention_heads") if k not in hf]
    if missing:
      raise CheckpointError(f"{source}: missing (or null) keys {missing}")
    check_supported(hf, source)
    rope = hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    eos = hf.get("eos_token_id")
    kwargs = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        rope_theta=float(theta),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
    )
    kwargs.update(overrides)
    return cls(**kwargs)

  def to_hf(self, torch_dtype: str | None = None) -> dict[str, Any]:
    """The HF `config.json` dict for this architecture (`Qwen2ForCausalLM`)."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
        "max_window_layers": self.num_hidden_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": self.eos_token_id,
        # Both names: transformers 5 reads `dtype`, older versions and many tools `torch_dtype`.
        "dtype": torch_dtype or self.param_dtype,
        "torch_dtype": torch_dtype or self.param_dtype,
    }


def _qwen25(layers, hidden, inter, heads, kv, tied, vocab, head_dim=128, **kw) -> Qwen2Config:
  return Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                     num_hidden_layers=layers, num_attention_heads=heads,
                     num_key_value_heads=kv, head_dim=head_dim, tie_word_embeddings=tied, **kw)


# Published Qwen2.5 shapes (config.json of the releases) plus tiny test models. The tiny
# ones keep the real vocabulary so the real tokenizer drives them.
PRESETS: dict[str, Qwen2Config] = {
    "qwen2.5-0.5b": _qwen25(24, 896, 4864, 14, 2, True, 151936, head_dim=64),
    "qwen2.5-1.5b": _qwen25(28, 1536, 8960, 12, 2, True, 151936),
    "qwen2.5-3b": _qwen25(36, 2048, 11008, 16, 2, True, 151936),
    "qwen2.5-7b": _qwen25(28, 3584, 18944, 28, 4, False, 152064),
    "qwen2.5-14b": _qwen25(48, 5120, 13824, 40, 8, False, 152064),
    "qwen2.5-32b": _qwen25(64, 5120, 27648, 40, 8, False, 152064),
    "qwen2.5-72b": _qwen25(80, 8192, 29568, 64, 8, False, 152064),
    # Tiny: random-init models for tests and the CPU demo.
    "tiny": _qwen25(2, 64, 128, 4, 2, True, 151936, head_dim=16),
    "tiny-untied": _qwen25(2, 64, 128, 4, 2, False, 151936, head_dim=16),
    "mini": _qwen25(4, 128, 384, 4, 2, True, 151936, head_dim=32),
    "small": _qwen25(4, 256, 768, 8, 2, True, 151936, head_dim=32),
}


def get_preset(name: str, **overrides) -> Qwen2Config:
  try:
    base = PRESETS[name]
  except KeyError:
    raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None
  return base.replace(**overrides) if overrides else base
