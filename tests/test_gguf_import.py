"""GGUF import against transformers' own GGUF loader, on the real Qwen2.5-Coder-0.5B-Instruct
(its tensors, config and logits, one load of each side for the module) and on small GGUF files
written with `gguf.GGUFWriter`."""

import json
import os
import re
import subprocess
import sys
import warnings

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from sage_jax import tokenizer as tokenizer_lib
from sage_jax.configurable import ConfigError
from sage_jax.model.config import Qwen2Config
from sage_jax.weights import gguf_import, hf, loader

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_TEXT = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n"
         "        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
         "The capital of France is Paris. The capital of Germany is Berlin.")
_CODE_PROMPT = (
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
    "    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
    "    out, i, j = [], 0, 0\n"
    "    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n"
    "            out.append(a[i]); i += 1\n"
    "        else:\n")


def _write_gguf(path, arch="qwen2", layers=2, tied=False, drop=(), extra=(), rope_scaling=None):
  """A small random GGUF in llama.cpp's layout (float32 and float16 tensors)."""
  hidden, ffn, heads, kv_heads, vocab = 16, 32, 4, 2, 24
  head_dim = hidden // heads
  writer = gguf.GGUFWriter(path, arch)
  writer.add_name("tiny qwen2")
  writer.add_block_count(layers)
  writer.add_context_length(128)
  writer.add_embedding_length(hidden)
  writer.add_feed_forward_length(ffn)
  writer.add_head_count(heads)
  writer.add_head_count_kv(kv_heads)
  writer.add_rope_freq_base(1e6)
  if rope_scaling:
    writer.add_rope_scaling_type(rope_scaling)
  writer.add_layer_norm_rms_eps(1e-6)
  writer.add_token_list([f"t{i}" for i in range(vocab)])
  writer.add_eos_token_id(2)
  writer.add_bos_token_id(1)
  shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
  if not tied:
    shapes["output.weight"] = (vocab, hidden)
  for i in range(layers):
    shapes.update({
        f"blk.{i}.attn_norm.weight": (hidden,),
        f"blk.{i}.attn_q.weight": (heads * head_dim, hidden),
        f"blk.{i}.attn_q.bias": (heads * head_dim,),
        f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
        f"blk.{i}.attn_k.bias": (kv_heads * head_dim,),
        f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
        f"blk.{i}.attn_v.bias": (kv_heads * head_dim,),
        f"blk.{i}.attn_output.weight": (hidden, heads * head_dim),
        f"blk.{i}.ffn_norm.weight": (hidden,),
        f"blk.{i}.ffn_gate.weight": (ffn, hidden),
        f"blk.{i}.ffn_up.weight": (ffn, hidden),
        f"blk.{i}.ffn_down.weight": (hidden, ffn),
    })
  shapes.update({name: (hidden,) for name in extra})
  rng = np.random.default_rng(0)
  for name, shape in shapes.items():
    if name not in drop:
      dtype = np.float16 if name.endswith("ffn_up.weight") else np.float32
      writer.add_tensor(name, rng.standard_normal(shape).astype(dtype))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


# --- Small files -----------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_small_file_config_and_tensors_as_transformers_reads_them(tmp_path, tied):
  path = _write_gguf(tmp_path / "tiny.gguf", tied=tied)
  config, tensors = gguf_import.read_gguf(path)
  assert config == load_gguf_checkpoint(str(path), return_tensors=False)["config"]
  assert config["tie_word_embeddings"] is tied

  tensors = dict(tensors)
  model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config))
  expected = {k: v for k, v in model.state_dict().items()
              if not (tied and k == "lm_head.weight")}
  assert sorted(tensors) == sorted(expected)
  for name, value in tensors.items():
    assert value.dtype == np.float32 and value.shape == tuple(expected[name].shape), name


def test_small_file_tensors_are_transformers_tensors(tmp_path):
  path = _write_gguf(tmp_path / "tiny.gguf")
  config, tensors = gguf_import.read_gguf(path)
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf")
  reference = model.state_dict()
  for name, value in tensors:
    np.testing.assert_array_equal(value, reference[name].numpy(), err_msg=name)


def test_a_model_load_parses_the_file_once_and_a_rewritten_file_again(tmp_path, monkeypatch):
  """Loading reads the file twice (config, then weights); its metadata is parsed once while
  the file stays as it was."""
  path = _write_gguf(str(tmp_path / "model.gguf"), layers=2)
  parses, parse = [], gguf.GGUFReader
  monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: parses.append(a) or parse(*a, **k))
  assert loader.load_model(path).config.num_hidden_layers == 2
  assert len(parses) == 1
  _write_gguf(path, layers=3)
  assert loader.load_model(path).config.num_hidden_layers == 3
  assert len(parses) == 2


def test_rejects_other_architectures(tmp_path):
  path = _write_gguf(tmp_path / "llama.gguf", arch="llama")
  with pytest.raises(gguf_import.GGUFError, match="architecture 'llama'"):
    gguf_import.read_gguf(path)


def test_rejects_unknown_tensors(tmp_path):
  path = _write_gguf(tmp_path / "extra.gguf", extra=("blk.0.attn_q_norm.weight", "blk.2.attn_norm.weight"))
  with pytest.raises(gguf_import.GGUFError,
                     match=r"unknown qwen2 tensors \['blk.0.attn_q_norm.weight', 'blk.2.attn_norm.weight'\]"):
    gguf_import.read_gguf(path)


def test_rejects_missing_tensors(tmp_path):
  path = _write_gguf(tmp_path / "short.gguf", drop=("blk.1.ffn_up.weight",))
  with pytest.raises(gguf_import.GGUFError, match=r"missing tensors \['blk.1.ffn_up.weight'\]"):
    gguf_import.read_gguf(path)


def test_rope_scaling_other_than_none_is_refused(tmp_path):
  gguf_import.read_gguf(_write_gguf(tmp_path / "none.gguf", rope_scaling=gguf.RopeScalingType.NONE))
  path = _write_gguf(tmp_path / "yarn.gguf", rope_scaling=gguf.RopeScalingType.YARN)
  with pytest.raises(gguf_import.GGUFError,
                     match=rf"{path}: qwen2.rope.scaling.type='yarn': the model implements the "
                           r"default RoPE only.*--remove-metadata qwen2.rope.scaling.type"):
    gguf_import.read_gguf(path)


def test_export_refuses_a_foreign_vocabulary(tmp_path):
  path = _write_gguf(tmp_path / "tiny.gguf")
  with pytest.raises(gguf_import.GGUFError, match="24 tokens, the Qwen2.5 tokenizer has 151665"):
    gguf_import.export_hf(path, tmp_path / "out")
  assert not (tmp_path / "out").exists()


def test_a_run_or_generate_refuses_a_gguf_whose_vocabulary_is_not_qwen25s(tmp_path):
  """A GGUF used directly is read in Qwen2.5's ids (a run's prompts, `generate`'s encoding),
  so its own vocabulary is checked as the export checks it."""
  path = str(_write_gguf(tmp_path / "tiny.gguf"))
  with pytest.raises(ConfigError, match=re.escape(f"config.model.spec={path!r}: not the "
                                                  "Qwen2.5 tokenizer") + ".*24 tokens"):
    loader.check_tokenizer(loader.ModelSpec(spec=path))
  out = subprocess.run([sys.executable, "-m", "sage_jax.generate", f"--model={path}",
                        "--prompt=hi", "--max_new_tokens=2"], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode != 0
  assert f"--model={path}: {path}: 24 tokens, the Qwen2.5 tokenizer has 151665" in out.stderr, (
      out.stderr[-2000:])


# --- The real Qwen2.5-Coder-0.5B-Instruct ------------------------------------------------------


@pytest.fixture(scope="session")
def coder_gguf():
  return gguf_import.fetch_qwen25_coder_0p5b_gguf()


@pytest.fixture(scope="module")
def ours(coder_gguf):
  config, tensors = gguf_import.read_gguf(coder_gguf)
  return config, dict(tensors)


@pytest.fixture(scope="module")
def reference(coder_gguf):
  """transformers' own GGUF loader: dequantised, mapped and configured by transformers."""
  return transformers.AutoModelForCausalLM.from_pretrained(
      coder_gguf.parent, gguf_file=coder_gguf.name, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def our_model(coder_gguf):
  """The GGUF as `sage_jax` runs it (`loader.load_model`, the bundled model's path)."""
  return loader.load_model(str(coder_gguf))


@pytest.fixture(scope="module")
def prompt_ids():
  ids = tokenizer_lib.Tokenizer().encode(_CODE_PROMPT)
  assert len(ids) >= 64
  return np.asarray(ids[:64])[None]


def _torch_logits(model, ids):
  with torch.no_grad():
    return model(torch.as_tensor(ids)).logits.float().numpy()


def _our_logits(model, ids):
  logits, _ = model(jnp.asarray(ids), jnp.arange(ids.shape[1])[None])
  return np.asarray(logits)


@pytest.mark.real_model
@pytest.mark.slow
def test_fetch_is_cached(coder_gguf):
  assert coder_gguf.stat().st_size == gguf_import.CODER_0P5B_GGUF_BYTES
  assert gguf_import.fetch_qwen25_coder_0p5b_gguf() == coder_gguf


@pytest.mark.real_model
@pytest.mark.slow
def test_tensors_equal_transformers_exactly(ours, reference):
  _, tensors = ours
  state = reference.state_dict()
  assert sorted(tensors) == sorted(state)
  assert len(tensors) == 2 + 24 * 12 + 1
  for name, value in tensors.items():
    assert value.dtype == np.float32, name
    assert np.array_equal(value, state[name].numpy()), name


@pytest.mark.real_model
@pytest.mark.slow
def test_config_as_transformers_builds_it(ours, reference):
  config, _ = ours
  assert config == {
      "model_type": "qwen2",
      "_model_name_or_path": "Qwen2.5 Coder 0.5B Instruct AWQ",
      "num_hidden_layers": 24,
      "hidden_size": 896,
      "intermediate_size": 4864,
      "num_attention_heads": 14,
      "num_key_value_heads": 2,
      "max_position_embeddings": 32768,
      "rope_theta": 1e6,
      "rms_norm_eps": float(np.float32(1e-6)),  # GGUF stores it as float32
      "vocab_size": 151936,
      "bos_token_id": 151643,
      "eos_token_id": 151645,
      "pad_token_id": 151643,
      # The original is tied, but the GGUF stores a separately quantised head: untied.
      "tie_word_embeddings": False,
  }
  ignore = {"_name_or_path", "dtype", "architectures", "quantization_config", "transformers_version"}
  built = {k: v for k, v in transformers.Qwen2Config(**config).to_dict().items() if k not in ignore}
  loaded = {k: v for k, v in reference.config.to_dict().items() if k not in ignore}
  assert built == loaded


@pytest.mark.real_model
@pytest.mark.slow
def test_logits_match_transformers_on_the_gguf(our_model, reference, prompt_ids):
  expected = _torch_logits(reference, prompt_ids)
  got = _our_logits(our_model, prompt_ids)
  assert np.abs(got - expected).max() <= 1e-3
  np.testing.assert_array_equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.real_model
@pytest.mark.slow
def test_export_reloads_in_transformers_with_same_logits(our_model, prompt_ids, tmp_path):
  hf.save_hf(our_model, str(tmp_path / "export"),
             tokenizer_dir=tokenizer_lib.ensure_qwen25_tokenizer_dir())
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "export"), attn_implementation="eager", output_loading_info=True)
  assert not any(info.values()), info
  tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "export"))
  assert tok("Hello world")["input_ids"] == [9707, 1879]
  np.testing.assert_allclose(_torch_logits(reloaded.eval(), prompt_ids),
                             _our_logits(our_model, prompt_ids), atol=1e-3, rtol=0)


@pytest.mark.real_model
@pytest.mark.slow
def test_greedy_completion_is_sensible(our_model):
  tok = tokenizer_lib.Tokenizer()
  ids = tok.encode("The capital of France is")
  logits = _our_logits(our_model, np.asarray(ids)[None])
  assert tok.decode([int(logits[0, -1].argmax())]) == " Paris"


@pytest.mark.real_model
@pytest.mark.slow
def test_the_bundled_gguf_passes_the_tokenizer_check(coder_gguf):
  loader.check_tokenizer(loader.ModelSpec(spec=str(coder_gguf)))


@pytest.mark.real_model
@pytest.mark.slow
def test_the_bundled_architecture_a_plan_assumes_is_the_files(coder_gguf):
  """Memory plans take the bundled model's shapes without fetching it."""
  read = loader.checkpoint_config(loader.BUNDLED_0P5B)
  assumed = loader.checkpoint_architecture(loader.BUNDLED_0P5B)
  assert {k: getattr(read, k) for k in loader.ARCHITECTURE_FIELDS} == {
      k: getattr(assumed, k) for k in loader.ARCHITECTURE_FIELDS}


@pytest.mark.real_model
@pytest.mark.slow
def test_the_bundled_model_loads_from_its_conversion_in_the_cache(ours):
  """The bundled name resolves to the GGUF's HF conversion, made once and cached (a load of
  the GGUF itself parses and dequantises it again), which holds the GGUF's tensors exactly."""
  path = loader.resolve(loader.BUNDLED_0P5B)
  assert os.path.isfile(os.path.join(path, hf.EXPORT_MARKER))
  _, tensors = ours
  converted = {name: array for _, name, array in hf.iter_safetensors(path)}
  assert sorted(converted) == sorted(tensors)
  for name, value in tensors.items():
    assert np.array_equal(converted[name], value), name


@pytest.mark.real_model
@pytest.mark.slow
def test_cli_writes_a_checkpoint_transformers_loads(coder_gguf, ours, tmp_path):
  out = tmp_path / "qwen2.5-coder-0.5b-instruct"
  # The export also checks that the GGUF's vocabulary and chat template are the Qwen2.5
  # tokenizer's that it writes.
  subprocess.run([sys.executable, "-m", "sage_jax.weights.gguf_import", f"--out={out}",
                  f"--gguf={coder_gguf}"],
                 check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert sorted(p.name for p in out.iterdir()) == sorted(
      ["config.json", "generation_config.json", "model.safetensors", hf.EXPORT_MARKER,
       *tokenizer_lib.TOKENIZER_FILES])
  config, tensors = ours
  assert Qwen2Config.from_hf(str(out)) == Qwen2Config.from_hf(config)
  generation = json.loads((out / "generation_config.json").read_text())
  assert generation["eos_token_id"] == [151645, 151643]

  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  state = model.state_dict()
  assert sorted(state) == sorted(tensors)
  for name, value in tensors.items():
    assert np.array_equal(state[name].numpy(), value), name

  # The weights work as a Qwen2 (rotate-half rotary) model. " Paris" alone would survive a
  # wrong q/k permutation; the loss would not (1.29 here, 1.99 with llama's permutation undone).
  tok = transformers.AutoTokenizer.from_pretrained(out)
  prompt = tok("The capital of France is", return_tensors="pt")
  text = tok(_TEXT, return_tensors="pt")["input_ids"]
  with torch.no_grad():
    generated = model.generate(**prompt, max_new_tokens=1, do_sample=False)
    loss = model(text, labels=text).loss.item()
  assert tok.decode(generated[0, prompt["input_ids"].shape[1]:]) == " Paris"
  assert loss < 1.5


@pytest.mark.parametrize("keep", [0.5, 0.98, 0.01])
def test_truncated_file_names_the_file_and_the_problem(tmp_path, keep):
  path = _write_gguf(str(tmp_path / "whole.gguf"))
  data = open(path, "rb").read()
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(data[:int(len(data) * keep)])
  with pytest.raises(gguf_import.GGUFError, match=f"{cut}: .*truncated"):
    _, tensors = gguf_import.read_gguf(cut)
    list(tensors)
