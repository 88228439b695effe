"""`python -m sage_jax.generate` samples as the checkpoint's generation_config.json says (as
transformers does), flags given on the command line winning, and stops at every eos id the
file names."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import transformers

from sage_jax import generate
from sage_jax import tokenizer as tokenizer_lib
from sage_jax.sampler import Engine, EngineConfig, SamplingParams
from sage_jax.weights import loader
from tests.hf_reference import tiny_hf_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "def add(a, b):"


def test_generation_defaults_read_as_transformers_reads_them():
  defaults = lambda generation: generate.generation_defaults(generation, prompt_length=5)
  assert defaults({}) == {}
  assert defaults({"eos_token_id": 2, "temperature": 0.7, "min_p": 0.1}) == {}
  assert defaults({"do_sample": False, "temperature": 0.7, "min_p": 0.1,
                   "max_new_tokens": 9}) == {"temperature": 0.0, "max_new_tokens": 9}
  assert defaults({"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}) == {
      "temperature": 0.7, "top_p": 0.8, "top_k": 20}
  # null is the default, as transformers 5 reads it (its top_k of 50), not "off"
  assert defaults({"do_sample": True, "top_k": None, "min_p": None}) == {
      "temperature": 1.0, "top_p": 1.0, "top_k": 50}
  assert defaults({"do_sample": True}) == {"temperature": 1.0, "top_p": 1.0, "top_k": 50}
  assert defaults({"do_sample": True, "min_p": 0.1, "repetition_penalty": 1.05}) == {
      "temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": 0.1, "repetition_penalty": 1.05}
  # The penalty applies to greedy decoding too; max_length counts the prompt.
  assert defaults({"repetition_penalty": 1.05, "max_length": 12}) == {
      "repetition_penalty": 1.05, "max_new_tokens": 7}
  assert defaults({"max_length": 12, "max_new_tokens": 3}) == {"max_new_tokens": 3}
  assert generate.not_applied({"repetition_penalty": 1.05, "min_p": 0.1, "max_length": 30,
                               "num_beams": 1, "typical_p": 0.9, "top_k": 20,
                               "stop_strings": ["\n\n"], "forced_eos_token_id": None}) == {
      "typical_p": 0.9, "stop_strings": ["\n\n"]}
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


def _run(directory, *flags: str, generation: dict | None = None,
         devices: int = 1) -> subprocess.CompletedProcess:
  """The command on `directory` on a host of `devices` CPU devices, with `generation` written
  as its generation_config.json by transformers (None: the file as it is)."""
  if generation is not None:
    transformers.GenerationConfig(**generation).save_pretrained(directory)
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
  return subprocess.run([sys.executable, "-m", "sage_jax.generate", f"--model={directory}",
                         f"--prompt={PROMPT}", "--nochat", *flags], cwd=REPO,
                        capture_output=True, text=True, timeout=300, env=env)


def _generate(directory, *flags: str, generation: dict | None = None,
              devices: int = 1) -> tuple[str, str]:
  """(completion, log) of a successful run of the command (see `_run`)."""
  out = _run(directory, *flags, generation=generation, devices=devices)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout.removesuffix("\n"), out.stderr


def test_without_sampling_settings_the_flags_defaults_apply(checkpoint):
  directory, greedy = checkpoint
  tok = tokenizer_lib.Tokenizer(directory)
  text, log = _generate(directory, "--max_new_tokens=8")
  assert text == tok.decode(greedy)
  assert ("Sampling settings: temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, "
          "repetition_penalty=1.0 from generate's defaults; "
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
            "max_new_tokens": 8, "repetition_penalty": 1.05, "min_p": 0.05, "typical_p": 0.9}


def test_the_files_sampling_settings_are_the_defaults_and_flags_win(checkpoint):
  directory, greedy = checkpoint
  tok = tokenizer_lib.Tokenizer(directory)
  sampled, log = _generate(directory, generation=SAMPLING)
  assert (f"temperature=0.7, top_p=0.8, top_k=20, min_p=0.05, repetition_penalty=1.05, "
          f"max_new_tokens=8 from {directory}/generation_config.json") in log, log
  assert (f"{directory}/generation_config.json sets typical_p=0.9, which this sampler does not "
          "apply: ignored") in log, log
  # The same as those settings given as flags.
  flagged, _ = _generate(directory, "--temperature=0.7", "--top_p=0.8", "--top_k=20",
                         "--min_p=0.05", "--repetition_penalty=1.05", "--max_new_tokens=8",
                         generation={})
  assert sampled == flagged != tok.decode(greedy)
  # A flag wins over the file; the file still gives the rest.
  text, log = _generate(directory, "--temperature=0", "--repetition_penalty=1",
                        generation=SAMPLING)
  assert text == tok.decode(greedy)
  assert ("temperature=0.0, repetition_penalty=1.0 from the command line; top_p=0.8, top_k=20, "
          f"min_p=0.05, max_new_tokens=8 from {directory}/generation_config.json") in log, log


OBSERVATION = [11, 22, 33]


@pytest.fixture(scope="module")
def penalized(checkpoint):
  """transformers' greedy completions under a repetition penalty of 1.3, 16 tokens without
  stopping: of PROMPT's ids, and of the conversation after it and OBSERVATION."""
  directory, greedy = checkpoint
  reference = transformers.AutoModelForCausalLM.from_pretrained(
      directory, attn_implementation="eager").eval()

  def complete(ids):
    with torch.no_grad():
      out = reference.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                               repetition_penalty=1.3, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()

  prompt = tokenizer_lib.Tokenizer(directory).encode(PROMPT)
  first = complete(prompt)
  assert first[:8] != greedy  # The penalty changes the completion.
  return prompt, first, complete(prompt + first + OBSERVATION)


def test_greedy_with_a_repetition_penalty_equals_transformers(checkpoint, penalized):
  """Through the engine (the second turn after appended ids), and through the command reading
  the penalty and max_length from generation_config.json."""
  directory, _ = checkpoint
  prompt, first, second = penalized
  engine = Engine(loader.load_model(str(directory)),
                  EngineConfig(num_slots=1, max_len=64, prefill_buckets=(16,), min_attend=64),
                  eos_ids=())
  seq = engine.start(prompt, SamplingParams(temperature=0.0, repetition_penalty=1.3,
                                            max_new_tokens=16))
  assert engine.run()[0].tokens == first
  engine.append(seq, OBSERVATION)
  assert engine.run()[0].tokens == second
  tok = tokenizer_lib.Tokenizer(directory)
  text, log = _generate(directory, generation={"repetition_penalty": 1.3,
                                               "max_length": len(prompt) + 16})
  assert text == tok.decode(first)
  config = f"{directory}/generation_config.json"
  assert (f"repetition_penalty=1.3 from {config}; max_new_tokens=16 from {config}'s "
          f"max_length={len(prompt) + 16} less the {len(prompt)}-token prompt") in log, log


def test_a_max_length_the_prompt_reaches_fails_unless_max_new_tokens_is_given(checkpoint,
                                                                              penalized):
  directory, _ = checkpoint
  prompt, first, _ = penalized
  failed = _run(directory, generation={"repetition_penalty": 1.3, "max_length": len(prompt)})
  assert failed.returncode != 0
  assert (f"{directory}/generation_config.json sets max_length={len(prompt)}, which the "
          f"{len(prompt)}-token prompt already reaches") in failed.stderr, failed.stderr[-3000:]
  assert "Traceback" not in failed.stderr
  text, _ = _generate(directory, "--max_new_tokens=4")
  assert text == tokenizer_lib.Tokenizer(directory).decode(first[:4])


@pytest.mark.parametrize("flag,message", [("--temperature=-1", "temperature=-1.0"),
                                          ("--top_p=0", "top_p"),
                                          ("--max_new_tokens=0", "max_new_tokens")])
def test_a_sampling_value_out_of_range_is_refused_in_one_line(checkpoint, flag, message):
  directory, _ = checkpoint
  out = _run(directory, flag, generation={})  # the module's checkpoint, without settings
  assert out.returncode != 0 and message in out.stderr
  assert "Traceback" not in out.stderr, out.stderr[-3000:]


def test_a_checkpoint_loads_sharded_over_the_tensor_flags_devices(checkpoint):
  """--tensor=2 on a host of 8 devices: the model is loaded sharded over 2 of them and
  completes as transformers does."""
  directory, greedy = checkpoint
  text, log = _generate(directory, "--max_new_tokens=8", "--tensor=2", devices=8)
  assert text == tokenizer_lib.Tokenizer(directory).decode(greedy)
  assert "Sampling on 2 of this host's devices: data=1, fsdp=1, tensor=2" in log, log


def test_a_tensor_size_that_does_not_divide_the_hosts_devices_is_refused(checkpoint):
  directory, _ = checkpoint
  out = _run(directory, "--tensor=3", generation={}, devices=8)
  assert out.returncode != 0
  assert "--tensor=3: config.sampler_mesh.tensor: 3 does not divide the 8 devices" in out.stderr
  assert "Traceback" not in out.stderr, out.stderr[-3000:]


def _one_line_refusal(out: subprocess.CompletedProcess, message: str) -> None:
  """The command failed with `message`, before it sampled, and without a traceback."""
  assert out.returncode != 0 and message in out.stderr, out.stderr[-3000:]
  assert "Traceback" not in out.stderr and "finish:" not in out.stderr, out.stderr[-3000:]


def test_a_prompt_the_models_context_cannot_hold_is_refused(checkpoint, tmp_path):
  """The engine would end it at once (context_full) with an empty completion."""
  directory, _ = checkpoint
  short = tmp_path / "short"
  shutil.copytree(directory, short)
  config = json.loads((short / "config.json").read_text())
  (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
  long_prompt = PROMPT * 30
  length = len(tokenizer_lib.Tokenizer(directory).encode(long_prompt))
  assert length > 64
  _one_line_refusal(_run(short, f"--prompt={long_prompt}", generation={}),
                    f"--prompt: {length} tokens, and the model's context "
                    "(max_position_embeddings) is 64")
  text, _ = _generate(short, "--max_new_tokens=4")  # a prompt it holds still completes
  assert text


def test_an_empty_prompt_is_refused_before_the_model_loads(checkpoint):
  directory, _ = checkpoint
  out = _run(directory, "--prompt=", generation={})
  _one_line_refusal(out, "--prompt is empty: with --nochat there is no text to complete")
  assert "Sampling settings" not in out.stderr


def test_what_is_not_a_loadable_model_is_named_in_one_line(checkpoint, tmp_path):
  directory, _ = checkpoint
  (tmp_path / "empty").mkdir()
  _one_line_refusal(_run(tmp_path / "empty"),
                    f"--model={tmp_path / 'empty'}: {tmp_path / 'empty'}/config.json: not found")
  (tmp_path / "notes.txt").write_text("not a model")
  _one_line_refusal(_run(tmp_path / "notes.txt"), f"--model={tmp_path / 'notes.txt'}: neither "
                                                  "a directory nor a .gguf file")
  no_weights = tmp_path / "no_weights"
  shutil.copytree(directory, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
  _one_line_refusal(_run(no_weights, generation={}), f"--model={no_weights}: {no_weights}: "
                                                     "neither model.safetensors nor")


def test_a_directory_without_a_tokenizer_samples_with_qwen25s_when_its_vocabulary_fits(
    checkpoint, tmp_path):
  """A Qwen2.5 checkpoint saved without its tokenizer completes as with it, and says which
  tokenizer it took; a smaller vocabulary (a compact export that lost its tokenizer) is
  refused before the model loads, not at the first id the model has no row for."""
  directory, greedy = checkpoint
  bare = tmp_path / "bare"
  shutil.copytree(directory, bare, ignore=shutil.ignore_patterns(
      "tokenizer*", "vocab.json", "merges.txt", "special_tokens_map.json", "*.jinja"))
  text, log = _generate(bare, "--max_new_tokens=8", generation={})
  assert text == tokenizer_lib.Tokenizer(directory).decode(greedy)
  assert (f"{bare} has no tokenizer.json: sampling with Qwen2.5's tokenizer, right for a "
          "Qwen2.5 checkpoint only") in log, log
  compact = tmp_path / "compact"
  tiny_hf_model(str(compact), vocab=512, seed=0)
  _one_line_refusal(_run(compact), f"--model={compact}: no tokenizer.json there, and the "
                                   "model's vocabulary (512 ids) is smaller than that of "
                                   "Qwen2.5's tokenizer (151665)")
