r"""Completes one prompt with the sampler engine and prints the completion.

  python -m sage_jax.generate --model=qwen2.5-coder-0.5b-instruct \
      --prompt="Write a Python function that reverses a string." --max_new_tokens=64 \
      --temperature=0

--model takes an HF checkpoint directory (a training run's export among them), a .gguf file,
the bundled model's name, or a training run's workdir: its checkpoint of --stage (rl or sft)
at --step (default: the latest), with the run's tokenizer, on the run's sampler mesh unless
--tensor or --param_dtype replace its keys. A checkpoint is loaded straight onto --tensor of
the host's devices, sharded over them, in --param_dtype. An HF directory without
tokenizer.json samples with Qwen2.5's tokenizer, which its vocabulary must hold. With --chat
(default) the prompt is a user message in Qwen's ChatML; --nochat completes raw text. A prompt
must leave room for a new token in the model's context.

An HF directory's generation_config.json gives the sampling defaults, as it does for
transformers' `generate`: greedy unless it sets do_sample, else its temperature, top_p, top_k
(transformers' 1.0, 1.0 and 50 for those it leaves out or sets to null) and min_p; its
repetition_penalty (greedy too); its max_new_tokens, else its max_length less the prompt's
length. A flag given on the command line wins. Generation stops at every one of its
eos_token_id (else at `<|im_end|>` and `<|endoftext|>`). A log line says where each setting
came from; settings the sampler does not apply (beams, typical_p...) are named in a warning.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable

import jax
from absl import app, flags, logging
from jax.sharding import Mesh

from sage_jax import multihost, run_checkpoint, run_config, storage
from sage_jax import tokenizer as tokenizer_lib
from sage_jax.configurable import ConfigError
from sage_jax.model.config import CheckpointError, Qwen2Config
from sage_jax.model.qwen2 import Qwen2
from sage_jax.sampler import Engine, EngineConfig, SamplingParams
from sage_jax.weights import gguf_import, hf, loader


# The flags a checkpoint's generation_config.json gives defaults for.
SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                  "max_new_tokens")
# What transformers samples with when do_sample is set and the file leaves a setting out or
# sets it to null (transformers 5 fills a null from these defaults too).
TRANSFORMERS_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 50}
# generation_config.json settings the sampler has no counterpart for, at the values where they
# change nothing.
NOT_APPLIED = {"encoder_repetition_penalty": 1.0, "typical_p": 1.0, "epsilon_cutoff": 0.0,
               "eta_cutoff": 0.0, "num_beams": 1, "penalty_alpha": None,
               "no_repeat_ngram_size": 0, "min_length": 0, "min_new_tokens": None,
               "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None,
               "sequence_bias": None, "guidance_scale": None, "top_h": None,
               "exponential_decay_length_penalty": None, "forced_bos_token_id": None,
               "forced_eos_token_id": None, "stop_strings": None, "max_time": None,
               "watermarking_config": None}


def generation_defaults(generation: dict[str, Any], prompt_length: int) -> dict[str, Any]:
  """Flag name -> the value transformers' `generate` takes from `generation` (a
  generation_config.json), for the flags it decides: greedy (temperature 0) when do_sample
  is false; the sampling settings (min_p among them) when it is true; the repetition penalty
  either way; its max_new_tokens, else its max_length (which counts the prompt's
  `prompt_length` tokens too)."""
  defaults: dict[str, Any] = {}
  if "do_sample" in generation and not generation["do_sample"]:
    defaults["temperature"] = 0.0
  elif generation.get("do_sample"):
    for name, default in TRANSFORMERS_SAMPLING.items():
      value = generation.get(name)
      defaults[name] = default if value is None else type(default)(value)
    if generation.get("min_p") is not None:
      defaults["min_p"] = float(generation["min_p"])
  if generation.get("repetition_penalty") is not None:
    defaults["repetition_penalty"] = float(generation["repetition_penalty"])
  if generation.get("max_new_tokens") is not None:
    defaults["max_new_tokens"] = int(generation["max_new_tokens"])
  elif generation.get("max_length") is not None:
    defaults["max_new_tokens"] = int(generation["max_length"]) - prompt_length
  return defaults


def not_applied(generation: dict[str, Any]) -> dict[str, Any]:
  """The settings of `generation` that would change transformers' sampling but not ours."""
  return {name: generation[name] for name, neutral in NOT_APPLIED.items()
          if name in generation and generation[name] != neutral}


def eos_ids(generation: dict[str, Any], tok: tokenizer_lib.Tokenizer) -> list[int]:
  """The ids generation stops at: every eos_token_id of `generation` (one id or a list), else
  Qwen's turn and text ends."""
  ids = generation.get("eos_token_id")
  if ids is None:
    return [tok.eos_id, tok.pad_id]
  return [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]


def _next_pow2(n: int) -> int:
  return 1 << max(n - 1, 1).bit_length()


def prompt_ids(tok: tokenizer_lib.Tokenizer, prompt: str, chat: bool, system: str) -> list[int]:
  if not chat:
    return tok.encode(prompt)
  conversation = tokenizer_lib.Conversation(tok, system)
  conversation.add_user(prompt)
  return conversation.start_assistant()


def sampling_settings(generation_path: str | None, generation: dict[str, Any],
                      tok: tokenizer_lib.Tokenizer,
                      prompt_length: int) -> tuple[SamplingParams, list[int]]:
  """The request's sampling and eos ids: each flag given on the command line, else the
  checkpoint's generation_config.json, else the flag's default; logged with where each
  came from."""
  from_file = generation_defaults(generation, prompt_length)
  values, origins = {}, {}
  for name in SAMPLING_FLAGS:
    if flags.FLAGS[name].present or name not in from_file:
      values[name] = flags.FLAGS[name].value
      origins[name] = "the command line" if flags.FLAGS[name].present else "generate's defaults"
    else:
      values[name], origins[name] = from_file[name], generation_path
  if origins["max_new_tokens"] == generation_path and generation.get("max_new_tokens") is None:
    max_length = generation["max_length"]
    if values["max_new_tokens"] < 1:
      raise app.UsageError(f"{generation_path} sets max_length={max_length}, which the "
                           f"{prompt_length}-token prompt already reaches: no room for new "
                           "tokens (--max_new_tokens asks for some)")
    origins["max_new_tokens"] = (f"{generation_path}'s max_length={max_length} less the "
                                 f"{prompt_length}-token prompt")
  stop = eos_ids(generation, tok)
  origins["eos_token_id"] = generation_path if "eos_token_id" in generation else "the tokenizer"
  by_origin: dict[str, list[str]] = {}
  for name, value in {**values, "eos_token_id": stop}.items():
    by_origin.setdefault(origins[name], []).append(f"{name}={value}")
  logging.info("Sampling settings: %s", "; ".join(
      f"{', '.join(settings)} from {origin}" for origin, settings in by_origin.items()))
  ignored = not_applied(generation)
  if ignored:
    logging.warning("%s sets %s, which this sampler does not apply: ignored", generation_path,
                    ", ".join(f"{k}={v}" for k, v in ignored.items()))
  try:
    return SamplingParams(**values), stop
  except ValueError as e:  # a value out of range (--temperature=-1, --top_p=0, ...)
    raise app.UsageError(str(e)) from None


def source(spec: str) -> tuple[tokenizer_lib.Tokenizer, str | None, dict[str, Any],
                               Callable[[], tuple[Qwen2, Mesh | None]]]:
  """What `spec` names: its tokenizer, its generation settings (the file, its contents), and
  how to load the model and the mesh it samples on (after the settings are checked: a large
  model takes minutes). A run's workdir: its tokenizer, no settings file, its checkpoint
  (--stage, --step) as the run's sampler holds it. Else an HF directory (its own tokenizer and
  generation_config.json where it has them), a .gguf file or the bundled model."""
  FLAGS = flags.FLAGS
  try:
    run_checkpoint.check_not_checkpoints(spec)
    recorded = run_checkpoint.run_config_at(spec)
  except FileNotFoundError as e:
    raise app.UsageError(f"--model={e}") from None
  except storage.WorkdirError as e:  # a config.json that is not JSON
    raise app.UsageError(f"--model={spec}: {e}") from None
  if recorded is not None:
    for name in ("tensor", "param_dtype"):  # this host's mesh instead of the run's
      if FLAGS[name].present:
        recorded["sampler_mesh"][name] = FLAGS[name].value
    try:
      run = run_config.resolve(recorded, local_devices=jax.local_device_count(), trained=True)
    except ConfigError as e:
      raise app.UsageError(f"--model={spec}: {e}") from None

    def restore() -> tuple[Qwen2, Mesh]:
      try:
        model, mesh, step = run_checkpoint.restore_sampling_model(spec, run, FLAGS.step,
                                                                  FLAGS.stage)
      except FileNotFoundError as e:  # no such stage or step: name the ones there are
        raise app.UsageError(str(e)) from e
      logging.info("%s: the %s stage's checkpoint at step %d", spec, FLAGS.stage, step)
      return model, mesh

    return tokenizer_lib.Tokenizer(run_checkpoint.tokenizer_dir(spec, run)), None, {}, restore
  if FLAGS["step"].present or FLAGS["stage"].present:
    raise app.UsageError(f"--step and --stage choose a checkpoint of a training run's workdir; "
                         f"--model={spec} is not one")
  path = loader.resolve(spec)
  weights = loader.weights_format(path)
  if weights is None:
    problem = ("no such directory or file" if not os.path.exists(path)
               else "neither a directory nor a .gguf file")
    raise app.UsageError(f"--model={spec}: {problem} (expected an HF checkpoint directory, a "
                         f".gguf file, a training run's workdir or {loader.BUNDLED_0P5B!r})")
  try:
    if weights == "gguf":  # sampled with Qwen2.5's tokenizer: its own?
      gguf_import.check_vocabulary(path)
      tok = tokenizer_lib.Tokenizer()
    else:
      tok = directory_tokenizer(path, Qwen2Config.from_hf(path).vocab_size)
  except (CheckpointError, gguf_import.GGUFError) as e:
    raise app.UsageError(f"--model={spec}: {e}") from None
  mesh_config = multihost.SamplerMeshConfig(tensor=FLAGS.tensor, param_dtype=FLAGS.param_dtype)
  try:
    mesh_config.check_host(jax.local_device_count(), 1)
  except ConfigError as e:
    raise app.UsageError(f"--tensor={FLAGS.tensor}: {e}") from None

  def load() -> tuple[Qwen2, Mesh]:
    try:
      return multihost.load_sampling_model(loader.ModelSpec(spec=path), mesh_config, num_slots=1)
    except (CheckpointError, gguf_import.GGUFError) as e:  # a shard missing, a tensor's shape
      raise app.UsageError(f"--model={spec}: {e}") from None

  return (tok, *hf.read_generation_config(path), load)


def directory_tokenizer(path: str, vocab_size: int) -> tokenizer_lib.Tokenizer:
  """The tokenizer of HF directory `path`, whose model has `vocab_size` ids: its own, else
  Qwen2.5's (a Qwen2.5 checkpoint saved without one), which must fit that vocabulary: raises
  CheckpointError up front, not at the first id the model has no row for."""
  if os.path.isfile(os.path.join(path, "tokenizer.json")):
    return tokenizer_lib.Tokenizer(path)
  tok = tokenizer_lib.Tokenizer()
  if vocab_size < tok.vocab_size:
    raise CheckpointError(
        f"no tokenizer.json there, and the model's vocabulary ({vocab_size} ids) is smaller "
        f"than that of Qwen2.5's tokenizer ({tok.vocab_size}), which stands in for a missing "
        "one (a compact-vocabulary export without its tokenizer?): put the checkpoint's "
        "tokenizer files (tokenizer.json, tokenizer_config.json) there")
  logging.warning("%s has no tokenizer.json: sampling with Qwen2.5's tokenizer, right for a "
                  "Qwen2.5 checkpoint only", path)
  return tok


def main(argv: list[str]) -> None:
  del argv
  FLAGS = flags.FLAGS
  if not FLAGS.chat and not FLAGS.prompt:
    raise app.UsageError("--prompt is empty: with --nochat there is no text to complete")
  multihost.initialize()  # several processes: each generates on its own devices
  tok, generation_path, generation, load_model = source(FLAGS.model)
  ids = prompt_ids(tok, FLAGS.prompt, FLAGS.chat, FLAGS.system)
  sampling, stop = sampling_settings(generation_path, generation, tok, len(ids))
  model, mesh = load_model()
  context = model.config.max_position_embeddings
  if len(ids) >= context:  # the engine would end it at once, as context_full
    chatml = " as a ChatML conversation" if FLAGS.chat else ""
    raise app.UsageError(f"--prompt: {len(ids)} tokens{chatml}, and the model's context "
                         f"(max_position_embeddings) is {context}: no room for a new token "
                         f"after it; shorten the prompt to fewer than {context} tokens")
  if mesh is not None:
    logging.info("Sampling on %d of this host's devices: %s", mesh.size,
                 ", ".join(f"{axis}={size}" for axis, size in mesh.shape.items()))
  # One prefill chunk and one attention window sized to this request: two compilations.
  max_len = min(_next_pow2(len(ids) + sampling.max_new_tokens),
                model.config.max_position_embeddings)
  config = EngineConfig(num_slots=1, max_len=max_len, min_attend=max_len,
                        prefill_buckets=(min(_next_pow2(len(ids)), 512, max_len),),
                        max_top_k=max(sampling.top_k, 1))
  engine = Engine(model, config, eos_ids=stop, detokenize=tok.decode, mesh=mesh)
  start = time.perf_counter()
  (result,) = engine.generate([ids], sampling, seeds=[FLAGS.seed])
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


def define_flags() -> None:
  """The entry point's flags (defined only when run, so importing this module defines none).
  The sampling flags' defaults apply where the checkpoint's generation_config.json sets none."""
  flags.DEFINE_string("model", None, "HF directory, .gguf file, bundled model name, or a "
                      "training run's workdir.", required=True)
  flags.DEFINE_string("prompt", None, "The prompt text.", required=True)
  flags.DEFINE_integer("max_new_tokens", 128, "Most tokens to generate.")
  flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
  flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1 = off).")
  flags.DEFINE_integer("top_k", 0, "Top-k sampling (0 = off).")
  flags.DEFINE_float("min_p", 0.0, "Drop tokens less likely than min_p times the most likely "
                     "one (0 = off).")
  flags.DEFINE_float("repetition_penalty", 1.0, "transformers' repetition penalty on every "
                     "token id of the prompt and the completion, greedy too (1 = off).")
  flags.DEFINE_integer("seed", 0, "Sampling seed.")
  flags.DEFINE_integer("step", None, "With a run's workdir: the checkpoint step (default: the "
                       "latest).")
  flags.DEFINE_enum("stage", "rl", list(run_checkpoint.STAGE_DIRS), "With a run's workdir: "
                    "which stage's checkpoints.")
  flags.DEFINE_integer("tensor", 1, "The checkpoint is loaded sharded over this many of the "
                       "host's devices (tensor parallel), and generates there: set it for a "
                       "model larger than one device. A run's workdir samples on the run's "
                       "sampler_mesh.tensor unless this is given.")
  flags.DEFINE_enum("param_dtype", "auto", list(multihost.SAMPLING_DTYPES), "The checkpoint's "
                    "weights are sampled in this dtype (auto: bfloat16 on accelerators, "
                    "float32 on CPU; a run's workdir: the run's sampler_mesh.param_dtype "
                    "unless this is given).")
  flags.DEFINE_bool("chat", True, "Wrap the prompt as a ChatML user message.")
  flags.DEFINE_string("system", "You are Qwen, created by Alibaba Cloud. You are a helpful "
                      "assistant.", "System message in chat mode.")


if __name__ == "__main__":
  define_flags()
  app.run(main)
