"""A run trains and evaluates in Qwen2.5's token ids (prompts, expert data, stop tokens): a
`model.spec` checkpoint whose own tokenizer reads ids otherwise is refused at the start,
before the workdir records the run, and one with Qwen2.5's tokenizer (whatever its chat
template) is not."""

import os
import sys

import pytest
import transformers

from sage_jax import pipeline
from sage_jax import tokenizer as tokenizer_lib
from sage_jax.configurable import ConfigError
from sage_jax.eval import runner
from sage_jax.weights import loader
from tests.hf_reference import tiny_hf_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from configs import eval as eval_configs  # noqa: E402
from configs import sage as sage_configs  # noqa: E402


def _checkpoint(directory, edit=None):
  """A tiny Qwen2 checkpoint of the real vocabulary with Qwen2.5's tokenizer, saved by
  transformers under another chat template; `edit(tokenizer)` changes it more."""
  tiny_hf_model(str(directory), vocab=151936)
  tok = transformers.AutoTokenizer.from_pretrained(tokenizer_lib.ensure_qwen25_tokenizer_dir())
  tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
  if edit:
    edit(tok)
  tok.save_pretrained(str(directory))
  return str(directory)


def _add_token(tok):
  tok.add_tokens(["<tool>"], special_tokens=True)


def _spec(path):
  return loader.ModelSpec(spec=path)


def test_a_checkpoint_with_qwen25s_tokenizer_or_none_passes(tmp_path):
  loader.check_tokenizer(_spec(_checkpoint(tmp_path / "qwen")))
  tiny_hf_model(str(tmp_path / "bare"))  # no tokenizer files: taken to be Qwen2.5's
  loader.check_tokenizer(_spec(str(tmp_path / "bare")))
  loader.check_tokenizer(loader.ModelSpec(spec=loader.BUNDLED_0P5B))  # fetches nothing


def test_training_refuses_a_checkpoint_whose_tokenizer_reads_ids_otherwise(tmp_path):
  path = _checkpoint(tmp_path / "ckpt", edit=_add_token)
  c = sage_configs.get_config("demo")
  c.model.update(spec=path, preset="", vocabulary="full")
  c.engine.num_slots = 8  # slots split over the session's 8 simulated devices
  workdir = tmp_path / "run"
  with pytest.raises(ConfigError, match=r"config.model.spec=.*ckpt.*other token ids than "
                                        r"Qwen2.5's(.|\n)*added tokens: 1 differing"):
    pipeline.Pipeline(c, str(workdir))
  # Nothing recorded: the run starts once spec points elsewhere.
  assert not (workdir / "config.json").exists()


def test_evaluation_refuses_it_too(tmp_path):
  c = eval_configs.get_config("tiny")
  c.eval.policy = "model"
  c.model.update(spec=_checkpoint(tmp_path / "ckpt", edit=_add_token), preset="")
  with pytest.raises(ConfigError, match="other token ids than Qwen2.5's"):
    runner.evaluate(c, str(tmp_path / "eval"))
