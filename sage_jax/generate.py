r"""Completes one prompt with the sampler engine and prints the completion.

  python -m sage_jax.generate --model=qwen2.5-coder-0.5b-instruct \
      --prompt="Write a Python function that reverses a string." --max_new_tokens=64 \
      --temperature=0

--model takes an HF checkpoint directory, a .gguf file, or the bundled model's name. With
--chat (default) the prompt is a user message in Qwen's ChatML; --nochat completes raw text.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags, logging

from sage_jax import multihost
from sage_jax import tokenizer as tokenizer_lib
from sage_jax.sampler import Engine, EngineConfig, SamplingParams
from sage_jax.weights import loader

_MODEL = flags.DEFINE_string("model", None, "HF directory, .gguf file or bundled model name.")
_PROMPT = flags.DEFINE_string("prompt", None, "The prompt text.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Most tokens to generate.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1 = off).")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k sampling (0 = off).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_CHAT = flags.DEFINE_bool("chat", True, "Wrap the prompt as a ChatML user message.")
_SYSTEM = flags.DEFINE_string(
    "system", "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "System message in chat mode.")


def _next_pow2(n: int) -> int:
  return 1 << max(n - 1, 1).bit_length()


def prompt_ids(tok: tokenizer_lib.Tokenizer, prompt: str, chat: bool, system: str) -> list[int]:
  if not chat:
    return tok.encode(prompt)
  conversation = tokenizer_lib.Conversation(tok, system)
  conversation.add_user(prompt)
  return conversation.start_assistant()


def main(argv: list[str]) -> None:
  del argv
  multihost.initialize()  # several processes: each generates on its own devices
  path = loader.resolve(_MODEL.value)
  tok_dir = path if os.path.isfile(os.path.join(path, "tokenizer.json")) else None
  tok = tokenizer_lib.Tokenizer(tok_dir)
  ids = prompt_ids(tok, _PROMPT.value, _CHAT.value, _SYSTEM.value)
  model = loader.load_model(path)
  # One prefill chunk and one attention window sized to this request: two compilations.
  max_len = min(_next_pow2(len(ids) + _MAX_NEW.value), model.config.max_position_embeddings)
  config = EngineConfig(num_slots=1, max_len=max_len, min_attend=max_len,
                        prefill_buckets=(min(_next_pow2(len(ids)), 512, max_len),),
                        max_top_k=max(_TOP_K.value, 1))
  engine = Engine(model, config, eos_ids=(tok.eos_id, tok.pad_id), detokenize=tok.decode)
  sampling = SamplingParams(temperature=_TEMPERATURE.value, top_p=_TOP_P.value,
                            top_k=_TOP_K.value, max_new_tokens=_MAX_NEW.value)
  start = time.perf_counter()
  (result,) = engine.generate([ids], sampling, seeds=[_SEED.value])
  elapsed = time.perf_counter() - start
  multihost.finish()
  tokens = result.tokens
  if result.finish_reason == "eos":
    tokens = tokens[:-1]
  if multihost.is_lead():
    print(tok.decode(tokens))
    sys.stdout.flush()
  logging.info("%d prompt tokens, %d new tokens in %.2f s (compilation included), finish: %s",
               len(ids), len(result.tokens), elapsed, result.finish_reason)


if __name__ == "__main__":
  flags.mark_flags_as_required(["model", "prompt"])
  app.run(main)
