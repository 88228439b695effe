"""The real Qwen2.5-Coder-0.5B-Instruct: our logits against transformers on the same GGUF."""

import warnings

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from sage_jax import tokenizer as tokenizer_lib
from sage_jax.weights import hf, loader

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

CODE_PROMPT = (
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
    "    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
    "    out, i, j = [], 0, 0\n"
    "    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n"
    "            out.append(a[i]); i += 1\n"
    "        else:\n")


@pytest.fixture(scope="module")
def prompt_ids():
  ids = tokenizer_lib.Tokenizer().encode(CODE_PROMPT)
  assert len(ids) >= 64
  return np.asarray(ids[:64])[None]


@pytest.fixture(scope="module")
def ours(real_gguf_path):
  return loader.load_model(real_gguf_path)


def _our_logits(model, ids):
  logits, _ = model(jnp.asarray(ids), jnp.arange(ids.shape[1])[None])
  return np.asarray(logits)


def _torch_logits(model, ids):
  with torch.no_grad():
    return model(torch.as_tensor(ids)).logits.float().numpy()


def test_logits_match_transformers_on_the_gguf(real_gguf_path, ours, prompt_ids):
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      str(real_gguf_path.rsplit("/", 1)[0]), gguf_file=real_gguf_path.rsplit("/", 1)[1],
      torch_dtype=torch.float32, attn_implementation="eager").eval()
  expected = _torch_logits(ref, prompt_ids)
  got = _our_logits(ours, prompt_ids)
  assert np.abs(got - expected).max() <= 1e-3
  np.testing.assert_array_equal(got.argmax(-1), expected.argmax(-1))


def test_export_reloads_in_transformers_with_same_logits(ours, prompt_ids, tmp_path):
  hf.save_hf(ours, str(tmp_path / "export"), tokenizer_dir=tokenizer_lib.ensure_qwen25_tokenizer_dir())
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "export"), attn_implementation="eager", output_loading_info=True)
  assert not any(info.values()), info
  tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "export"))
  assert tok("Hello world")["input_ids"] == [9707, 1879]
  np.testing.assert_allclose(_torch_logits(reloaded.eval(), prompt_ids),
                             _our_logits(ours, prompt_ids), atol=1e-3, rtol=0)


def test_greedy_completion_is_sensible(ours):
  tok = tokenizer_lib.Tokenizer()
  ids = tok.encode("The capital of France is")
  logits = _our_logits(ours, np.asarray(ids)[None])
  assert tok.decode([int(logits[0, -1].argmax())]) == " Paris"
