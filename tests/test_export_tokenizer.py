"""An export from an HF checkpoint carries that checkpoint's tokenizer (chat template, special
tokens, model_max_length) and generation_config.json values, so it loads in transformers like
the source; a source tokenizer that would read the model's ids otherwise is not shipped."""

import json
import logging

import numpy as np
import pytest
import transformers

from sage_jax import export
from sage_jax import tokenizer as tokenizer_lib
from sage_jax.weights import hf
from tests.hf_reference import hf_logits, tiny_hf_model

# A chat template of its own: a default system prompt unlike Qwen2.5 Instruct's.
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
SOURCE_SYSTEM = "You are a careful coding agent working through an API."
SOURCE_TEMPLATE = tokenizer_lib.QWEN25_CHAT_TEMPLATE.replace(QWEN_SYSTEM, SOURCE_SYSTEM)
SOURCE_GENERATION = {"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True,
                     "eos_token_id": [151645, 151643], "repetition_penalty": 1.1,
                     "temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_new_tokens": 512,
                     "transformers_version": "4.43.1"}
MESSAGES = [{"role": "user", "content": "Who are my Venmo friends?"},
            {"role": "assistant", "content": "print(apis.venmo.show_friends())"},
            {"role": "user", "content": "Pay the first one $5."}]


def _save_source(directory, edit=None):
  """A tiny Qwen2 checkpoint of the real vocabulary, saved by transformers with Qwen2.5's
  tokenizer under another chat template and context length (`edit(tokenizer)` changes it
  more), and a generation_config.json."""
  tiny_hf_model(str(directory), vocab=151936)
  tok = transformers.AutoTokenizer.from_pretrained(tokenizer_lib.ensure_qwen25_tokenizer_dir())
  tok.chat_template = SOURCE_TEMPLATE
  tok.model_max_length = 32768
  if edit:
    edit(tok)
  tok.save_pretrained(str(directory))
  (directory / "generation_config.json").write_text(json.dumps(SOURCE_GENERATION))
  return directory


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  return _save_source(tmp_path_factory.mktemp("source"))


def _chat(tok):
  text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
  return text, tok.encode(text, add_special_tokens=False)


def test_an_export_loads_with_the_source_checkpoints_tokenizer(source, tmp_path):
  model = hf.load_hf(str(source))
  export.write_model(model, str(tmp_path / "out"), tokenizer_lib.ensure_qwen25_tokenizer_dir(),
                     base_model=str(source))
  theirs = transformers.AutoTokenizer.from_pretrained(str(source))
  exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
  text, ids = _chat(exported)
  assert SOURCE_SYSTEM in text
  assert (tmp_path / "out" / "chat_template.jinja").exists()  # as transformers saved it
  assert (text, ids) == _chat(theirs)
  assert ids == tokenizer_lib.Tokenizer().encode(text)  # the ids the run trained with
  assert exported.model_max_length == 32768
  assert (exported.eos_token, exported.pad_token) == (theirs.eos_token, theirs.pad_token)
  assert json.load(open(tmp_path / "out" / "generation_config.json")) == SOURCE_GENERATION
  tokens = np.asarray([ids])
  source_logits = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(
      str(source), attn_implementation="eager").eval(), tokens)
  exported_logits = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path / "out"), attn_implementation="eager").eval(), tokens)
  np.testing.assert_allclose(exported_logits, source_logits, atol=1e-5)


def _add_token(tok):
  tok.add_tokens(["<think>"], special_tokens=True)


def _renumber_two_tokens(directory):
  spec = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
  vocab = spec["model"]["vocab"]
  vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
  (directory / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False),
                                             encoding="utf-8")


@pytest.mark.parametrize("change", ["an added token", "vocabulary entries renumbered"])
def test_a_source_tokenizer_that_reads_ids_otherwise_is_not_shipped(tmp_path, caplog, change):
  """The model learned the run's token ids: a source tokenizer that maps text or ids
  otherwise would mislead every user of the export, so the run's ships, with a warning."""
  src = _save_source(tmp_path / "src", edit=_add_token if change == "an added token" else None)
  if change == "vocabulary entries renumbered":
    _renumber_two_tokens(src)
  with caplog.at_level(logging.WARNING):
    export.write_model(hf.load_hf(str(src)), str(tmp_path / "out"),
                       tokenizer_lib.ensure_qwen25_tokenizer_dir(), base_model=str(src))
  [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert str(src) in warning
  assert ("added tokens" if change == "an added token" else "vocabulary") in warning
  exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
  text, ids = _chat(exported)
  assert QWEN_SYSTEM in text and ids == tokenizer_lib.Tokenizer().encode(text)
  assert not (tmp_path / "out" / "chat_template.jinja").exists()
  generation = json.load(open(tmp_path / "out" / "generation_config.json"))
  assert generation["temperature"] == 0.7 and generation["max_new_tokens"] == 512


def test_the_run_tokenizer_agrees_with_itself_saved_by_transformers(source):
  assert tokenizer_lib.encoding_differences(
      source, tokenizer_lib.ensure_qwen25_tokenizer_dir()) == []
