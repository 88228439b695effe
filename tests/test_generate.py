"""`python -m sage_jax.generate` samples as the checkpoint's generation_config.json says (as
transformers does), flags given on the command line winning, and stops at every eos id the
file names."""

import os
import subprocess
import sys

import pytest
import torch
import transformers

from sage_jax import generate
from sage_jax import tokenizer as tokenizer_lib
from tests.hf_reference import tiny_hf_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "def add(a, b):"


def test_generation_defaults_read_as_transformers_reads_them():
  assert generate.generation_defaults({}) == {}
  assert generate.generation_defaults({"eos_token_id": 2, "temperature": 0.7}) == {}
  assert generate.generation_defaults({"do_sample": False, "temperature": 0.7,
                                       "max_new_tokens": 9}) == {"temperature": 0.0,
                                                                 "max_new_tokens": 9}
  assert generate.generation_defaults({"do_sample": True, "temperature": 0.7, "top_p": 0.8,
                                       "top_k": 20}) == {"temperature": 0.7, "top_p": 0.8,
                                                         "top_k": 20}
  assert generate.generation_defaults({"do_sample": True, "top_k": None}) == {
      "temperature": 1.0, "top_p": 1.0, "top_k": 0}
  assert generate.generation_defaults({"do_sample": True}) == {
      "temperature": 1.0, "top_p": 1.0, "top_k": 50}
  assert generate.not_applied({"repetition_penalty": 1.05, "min_p": 0.1, "num_beams": 1,
                               "typical_p": 1.0, "top_k": 20}) == {"repetition_penalty": 1.05,
                                                                  "min_p": 0.1}
  tok = tokenizer_lib.Tokenizer()
  assert generate.eos_ids({}, tok) == [tok.im_end, tok.endoftext]
  assert generate.eos_ids({"eos_token_id": 7}, tok) == [7]
  assert generate.eos_ids({"eos_token_id": [7, 9]}, tok) == [7, 9]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A tiny Qwen2 saved with transformers (its generation_config.json sets no sampling and no
  eos), with the Qwen2.5 tokenizer; and transformers' greedy completion of PROMPT, 8 tokens
  without stopping."""
  directory = tmp_path_factory.mktemp("tiny") / "model"
  model = tiny_hf_model(str(directory), vocab=151936, seed=0)
  tokenizer_lib.save_tokenizer(directory, tokenizer_lib.ensure_qwen25_tokenizer_dir())
  prompt = tokenizer_lib.Tokenizer(directory).encode(PROMPT)
  with torch.no_grad():
    greedy = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
  return directory, greedy[0, len(prompt):].tolist()


def _generate(directory, *flags: str, generation: dict | None = None) -> tuple[str, str]:
  """(completion, log) of the command on `directory`, with `generation` written as its
  generation_config.json by transformers (None: the file as it is)."""
  if generation is not None:
    transformers.GenerationConfig(**generation).save_pretrained(directory)
  out = subprocess.run([sys.executable, "-m", "sage_jax.generate", f"--model={directory}",
                        f"--prompt={PROMPT}", "--nochat", *flags], cwd=REPO,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout.removesuffix("\n"), out.stderr


def test_without_sampling_settings_the_flags_defaults_apply(checkpoint):
  directory, greedy = checkpoint
  tok = tokenizer_lib.Tokenizer(directory)
  text, log = _generate(directory, "--max_new_tokens=8")
  assert text == tok.decode(greedy)
  assert ("Sampling settings: temperature=0.0, top_p=1.0, top_k=0 from generate's defaults; "
          "max_new_tokens=8 from the command line; "
          f"eos_token_id=[{tok.im_end}, {tok.endoftext}] from the tokenizer") in log, log
  assert "does not apply" not in log


def test_generation_stops_at_every_eos_id_of_the_file(checkpoint):
  directory, greedy = checkpoint
  tok = tokenizer_lib.Tokenizer(directory)
  stop = next(t for t in greedy if t != greedy[0])  # one the model reaches after a token
  text, log = _generate(directory, "--max_new_tokens=8",
                        generation={"eos_token_id": [tok.im_end, stop]})
  assert text == tok.decode(greedy[:greedy.index(stop)])
  assert (f"eos_token_id=[{tok.im_end}, {stop}] from {directory}/generation_config.json"
          in log), log
  assert "finish: eos" in log


SAMPLING = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
            "max_new_tokens": 8, "repetition_penalty": 1.05, "min_p": 0.05}


def test_the_files_sampling_settings_are_the_defaults_and_flags_win(checkpoint):
  directory, greedy = checkpoint
  tok = tokenizer_lib.Tokenizer(directory)
  sampled, log = _generate(directory, generation=SAMPLING)
  assert (f"temperature=0.7, top_p=0.8, top_k=20, max_new_tokens=8 from "
          f"{directory}/generation_config.json") in log, log
  assert (f"{directory}/generation_config.json sets repetition_penalty=1.05, min_p=0.05, "
          "which this sampler does not apply: ignored") in log, log
  # The same as those settings given as flags.
  flagged, _ = _generate(directory, "--temperature=0.7", "--top_p=0.8", "--top_k=20",
                         "--max_new_tokens=8", generation={})
  assert sampled == flagged != tok.decode(greedy)
  # A flag wins over the file; the file still gives the rest.
  text, log = _generate(directory, "--temperature=0", generation=SAMPLING)
  assert text == tok.decode(greedy)
  assert ("temperature=0.0 from the command line; top_p=0.8, top_k=20, max_new_tokens=8 from "
          f"{directory}/generation_config.json") in log, log
