"""The sampler engine on the real Qwen2.5-Coder-0.5B-Instruct (fp32) against transformers."""

import numpy as np
import pytest
import torch
import transformers

from sage_jax import tokenizer as tokenizer_lib
from sage_jax.sampler import Engine, EngineConfig, SamplingParams
from sage_jax.weights import hf

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

QUESTIONS = (
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "What is the difference between a list and a tuple in Python? Answer in two sentences.",
    "Explain what this does: sorted(d.items(), key=lambda kv: -kv[1])[:3]",
)
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def tok():
  return tokenizer_lib.Tokenizer()


@pytest.fixture(scope="module")
def prompts(tok):
  out = []
  for question in QUESTIONS:
    conversation = tokenizer_lib.Conversation(tok, "You are a helpful coding assistant.")
    conversation.add_user(question)
    out.append(conversation.start_assistant())
  return out


@pytest.fixture(scope="module")
def ours(real_hf_dir):
  return hf.load_hf(real_hf_dir)


@pytest.fixture(scope="module")
def engine_results(ours, prompts, tok):
  config = EngineConfig(num_slots=len(prompts), max_len=256, prefill_buckets=(64,),
                        min_attend=256)
  engine = Engine(ours, config, eos_ids=(tok.eos_id, tok.pad_id))
  return engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS))


def test_greedy_equals_transformers_generate(real_hf_dir, prompts, engine_results):
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      real_hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
  for prompt, result in zip(prompts, engine_results):
    ids = torch.tensor([prompt])
    with torch.no_grad():
      out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                         do_sample=False)
    expected = out[0, len(prompt):].tolist()
    assert result.tokens == expected
    assert result.finish_reason == ("eos" if len(expected) < NEW_TOKENS else "max_new_tokens")


def test_model_logprobs_equal_training_forward(ours, prompts, engine_results):
  for prompt, result in zip(prompts, engine_results):
    ids = np.asarray([prompt + result.tokens])
    logits, _ = ours(ids, np.arange(ids.shape[1])[None])
    logits = np.asarray(logits[0, len(prompt) - 1:-1], np.float64)
    logprobs = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    expected = logprobs[np.arange(len(result.tokens)), result.tokens]
    assert np.abs(result.model_logprobs - expected).max() <= 1e-3
