"""Builds transformers' PyTorch Qwen2 (the numerical reference) with random weights."""

import numpy as np
import torch
import transformers

from sage_jax.model.config import Qwen2Config


def tiny_hf_model(out_dir: str, *, heads=4, kv_heads=2, tied=True, vocab=512, layers=2,
                  head_dim=16, hidden=64, dtype=torch.float32, seed=0):
  """Saves a random `Qwen2ForCausalLM` to `out_dir` and returns it (eager attention, eval)."""
  torch.manual_seed(seed)
  cfg = transformers.Qwen2Config(
      vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
      head_dim=head_dim, tie_word_embeddings=tied, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
      max_position_embeddings=4096, attn_implementation="eager")
  model = transformers.Qwen2ForCausalLM(cfg).eval()
  with torch.no_grad():  # non-trivial biases and norms so every tensor matters
    for name, p in model.named_parameters():
      if name.endswith("bias") or "norm" in name:
        p.add_(0.1 * torch.randn_like(p))
  model = model.to(dtype)
  model.save_pretrained(out_dir)
  return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    out = model(torch.as_tensor(np.asarray(tokens), dtype=torch.long))
  return out.logits.float().numpy()


def sage_config(model) -> Qwen2Config:
  return Qwen2Config.from_hf(model.config.to_dict())
