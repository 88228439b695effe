"""Hugging Face safetensors import and export for `Qwen2`.

Import streams one tensor at a time from the safetensors files straight into its target
sharding; export writes sharded safetensors with an index, config.json,
generation_config.json and (optionally) the tokenizer files, the source checkpoint's own where
they encode text as the model's tokenizer does, loadable by
`transformers.AutoModelForCausalLM.from_pretrained`. An export replaces only a directory that
is missing, empty or a previous export (`check_export_target`).

One explicit table, `NAME_TABLE`, maps HF tensor names to module paths and says how each
tensor is laid out; both directions use it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import uuid
from typing import Iterable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from etils import epath
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from sage_jax import sharding as shd
from sage_jax import storage
from sage_jax import tokenizer as tokenizer_lib
from sage_jax.model import lora
from sage_jax.model.config import CheckpointError, Qwen2Config, read_checkpoint_json
from sage_jax.model.qwen2 import Qwen2, abstract_model

# kind: "copy" (same shape), "flat" (HF keeps it flat: [heads * head_dim] biases), or
# "kernel<n>": a torch Linear weight [out, in] that we store as [out..., in...] with n
# trailing input axes (HF = ours.reshape(out, in)). No kind transposes: every conversion is
# a reshape.
NAME_TABLE: tuple[tuple[str, str, str], ...] = (
    ("model.embed_tokens.weight", "embed_tokens", "copy"),
    ("model.norm.weight", "norm.weight", "copy"),
    ("lm_head.weight", "lm_head", "kernel1"),
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.input_layernorm.weight", "copy"),
    ("model.layers.{i}.post_attention_layernorm.weight",
     "layers.{i}.post_attention_layernorm.weight", "copy"),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.self_attn.q_proj.kernel", "kernel1"),
    ("model.layers.{i}.self_attn.q_proj.bias", "layers.{i}.self_attn.q_proj.bias", "flat"),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers.{i}.self_attn.k_proj.kernel", "kernel1"),
    ("model.layers.{i}.self_attn.k_proj.bias", "layers.{i}.self_attn.k_proj.bias", "flat"),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers.{i}.self_attn.v_proj.kernel", "kernel1"),
    ("model.layers.{i}.self_attn.v_proj.bias", "layers.{i}.self_attn.v_proj.bias", "flat"),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.self_attn.o_proj.kernel", "kernel2"),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.mlp.gate_proj.kernel", "kernel1"),
    ("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.mlp.up_proj.kernel", "kernel1"),
    ("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.mlp.down_proj.kernel", "kernel1"),
)

NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _compile(template: str) -> re.Pattern:
  return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


_HF_PATTERNS = [(_compile(hf), ours, kind) for hf, ours, kind in NAME_TABLE]


def hf_to_path(hf_name: str) -> tuple[str, str] | None:
  """HF tensor name -> (dotted module path, kind), or None for names not in the table."""
  for pattern, ours, kind in _HF_PATTERNS:
    m = pattern.match(hf_name)
    if m:
      return ours.format(**m.groupdict()), kind
  return None


def path_to_hf(path: str) -> tuple[str, str]:
  for hf, ours, kind in NAME_TABLE:
    m = _compile(ours).match(path)
    if m:
      return hf.format(**m.groupdict()), kind
  raise KeyError(f"module path {path!r} has no HF name in NAME_TABLE")


def hf_layout(ours: np.ndarray | jax.ShapeDtypeStruct, kind: str) -> tuple[int, ...]:
  """The HF shape of a tensor whose module shape is `ours.shape`."""
  shape = tuple(ours.shape)
  if kind == "copy":
    return shape
  if kind == "flat":
    return (math.prod(shape),)
  n_in = int(kind[len("kernel"):])
  return (math.prod(shape[:-n_in]), math.prod(shape[-n_in:]))


def to_hf_layout(ours: np.ndarray, kind: str) -> np.ndarray:
  return ours.reshape(hf_layout(ours, kind))


def _flat_paths(state: nnx.State) -> dict[str, nnx.Variable]:
  return {".".join(str(p) for p in path): v for path, v in nnx.to_flat_state(state)}


# --- Import --------------------------------------------------------------------------------


def _open_safetensors(path: str):
  """safe_open, failing with CheckpointError naming the file when it is truncated or damaged."""
  try:
    return safe_open(path, framework="numpy")
  except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError
    raise CheckpointError(f"{path}: not a readable safetensors file "
                          f"({os.path.getsize(path)} bytes): {e}") from e


def _weight_files(model_dir: str) -> dict[str, str]:
  """HF tensor name -> file path, checking that every referenced shard exists."""
  index = os.path.join(model_dir, "model.safetensors.index.json")
  single = os.path.join(model_dir, "model.safetensors")
  if os.path.exists(index):
    weight_map = read_checkpoint_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
      raise CheckpointError(f"{index}: no weight_map (tensor name -> shard file) object")
    files = {name: os.path.join(model_dir, fname) for name, fname in weight_map.items()}
    missing = sorted({p for p in files.values() if not os.path.exists(p)})
    if missing:
      raise CheckpointError(f"{index} references missing shard file(s): {missing}")
    return files
  if os.path.exists(single):
    with _open_safetensors(single) as f:
      return {name: single for name in f.keys()}
  raise CheckpointError(f"{model_dir}: neither model.safetensors nor "
                        "model.safetensors.index.json found")


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, str, np.ndarray]]:
  """Yields (file, HF name, array) one tensor at a time, file by file."""
  files = _weight_files(model_dir)
  by_file: dict[str, list[str]] = {}
  for name, path in files.items():
    by_file.setdefault(path, []).append(name)
  for path, names in sorted(by_file.items()):
    with _open_safetensors(path) as f:
      present = set(f.keys())
      for name in sorted(names):
        if name not in present:
          raise CheckpointError(f"{path}: the index lists tensor {name!r}, but the file lacks it")
        try:
          array = f.get_tensor(name)
        except Exception as e:  # noqa: BLE001 - e.g. numpy has no type for a float8 tensor
          raise CheckpointError(
              f"{path}: tensor {name!r} ({f.get_slice(name).get_dtype()}) cannot be read as an "
              f"array ({type(e).__name__}: {e}); expected floating-point weights") from e
        yield path, name, array


def stated_dtype(model_dir: str) -> str | None:
  """The weights' dtype the checkpoint's config.json states, if it is one we write."""
  hf = read_checkpoint_json(os.path.join(model_dir, "config.json"))
  name = hf.get("dtype") or hf.get("torch_dtype")
  return name if name in NP_DTYPES else None


def _checkpoint_dtype(model_dir: str) -> str:
  return stated_dtype(model_dir) or "float32"


def load_tensors(cfg: Qwen2Config, tensors: Iterable[tuple[str, str, np.ndarray]],
                 mesh: Mesh | None = None, rules: shd.ShardingRules = shd.ShardingRules(),
                 origin: str = "checkpoint") -> Qwen2:
  """Builds a `Qwen2` from (source, HF name, array) triples, placing each tensor as it comes.

  Every tensor is checked against the model's expected name and shape; the model is only
  assembled once every parameter has arrived, so a failure never leaves a partial model.
  """
  abstract = abstract_model(cfg)
  graphdef, abstract_state = nnx.split(abstract)
  expected = _flat_paths(abstract_state)
  loaded: dict[str, jax.Array] = {}
  for source, name, array in tensors:
    mapped = hf_to_path(name)
    if mapped is None:
      raise CheckpointError(f"{source}: unknown tensor {name!r} (not a Qwen2 weight)")
    path, kind = mapped
    if path == "lm_head" and cfg.tie_word_embeddings:
      logging.info("%s: ignoring %s, the config ties it to the embeddings", source, name)
      continue
    if path not in expected:
      raise CheckpointError(f"{source}: tensor {name!r} does not fit the config "
                            f"({cfg.num_hidden_layers} layers, tied={cfg.tie_word_embeddings})")
    if path in loaded:
      raise CheckpointError(f"{source}: tensor {name!r} appears twice")
    var = expected[path]
    target = var.get_value()
    want = hf_layout(target, kind)
    if tuple(array.shape) != want:
      raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(array.shape)}, "
                            f"the config expects {want}")
    if not jnp.issubdtype(array.dtype, jnp.floating):  # quantised or damaged: not to cast
      raise CheckpointError(f"{source}: tensor {name!r} is {np.dtype(array.dtype).name}, "
                            "expected floating-point weights")
    value = array.reshape(target.shape).astype(target.dtype)
    loaded[path] = _place(value, shd.logical_axes_of(var), mesh, rules)
  missing = sorted(set(expected) - set(loaded))
  if missing:
    raise CheckpointError(f"{origin} lacks {len(missing)} tensor(s) the config needs, "
                          f"e.g. {[path_to_hf(p)[0] for p in missing[:5]]}")
  flat = [(tuple(int(p) if p.isdigit() else p for p in path.split(".")),
           expected[path].replace(loaded[path])) for path in expected]
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _place(value: np.ndarray, axes, mesh: Mesh | None, rules: shd.ShardingRules) -> jax.Array:
  if mesh is None:
    return jnp.asarray(value)
  sharding = shd.param_sharding(axes, value.shape, mesh, rules)
  return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])


def load_hf(model_dir: str, *, mesh: Mesh | None = None,
            rules: shd.ShardingRules = shd.ShardingRules(),
            param_dtype: str | None = None, dtype: str | None = None) -> Qwen2:
  """Loads an HF Qwen2 checkpoint directory (config.json + safetensors).

  `param_dtype` defaults to the checkpoint's own dtype; `dtype` (compute) to `param_dtype`.
  """
  cfg = checkpoint_config(model_dir, param_dtype=param_dtype, dtype=dtype)
  return load_tensors(cfg, iter_safetensors(model_dir), mesh, rules, origin=model_dir)


def checkpoint_config(model_dir: str, *, param_dtype: str | None = None,
                      dtype: str | None = None) -> Qwen2Config:
  """The config `load_hf` loads the checkpoint with, read without its weights (but the two
  tensors that decide whether its head is tied)."""
  param_dtype = param_dtype or _checkpoint_dtype(model_dir)
  cfg = Qwen2Config.from_hf(model_dir, param_dtype=param_dtype, dtype=dtype or param_dtype)
  if cfg.tie_word_embeddings and _stores_another_head(model_dir):
    logging.warning("%s: config.json ties the LM head to the embeddings, but the checkpoint "
                    "stores an lm_head.weight of other values: loaded untied, with that head "
                    "(as transformers loads it)", model_dir)
    cfg = cfg.replace(tie_word_embeddings=False)
  return cfg


def _stores_another_head(model_dir: str) -> bool:
  """Whether the checkpoint holds an lm_head.weight that differs from its embeddings (left
  behind by training that untied them, say)."""
  files = _weight_files(model_dir)
  names = ("lm_head.weight", "model.embed_tokens.weight")
  if not all(n in files for n in names):
    return False
  head, embed = (_read_tensor(files[n], n) for n in names)
  return head.shape != embed.shape or not np.array_equal(head, embed)


def _read_tensor(path: str, name: str) -> np.ndarray:
  with _open_safetensors(path) as f:
    return f.get_tensor(name)


# --- Export --------------------------------------------------------------------------------


# Written into every directory an export creates. A later export replaces a non-empty
# directory only if it holds this file, so it never deletes a run or a model it did not write.
EXPORT_MARKER = "sage_jax_export.json"


class ExportError(ValueError):
  """An export that would delete files it did not write."""


# What an export refused by `check_export_target` is told to do, unless its caller knows better.
CHOOSE_ANOTHER = "choose another output directory or remove it"


def _resolved(p: str | os.PathLike) -> epath.Path:
  return storage.path(p if storage.is_remote(p) else os.path.realpath(p))


def check_export_target(out_dir: str | os.PathLike, keep: Iterable[str] = (),
                        remedy: str = CHOOSE_ANOTHER) -> None:
  """Fails unless an export may replace `out_dir` (local or remote): it must be missing, empty
  or a previous export (it holds `EXPORT_MARKER`), and must not be or contain any path in
  `keep` (the run's workdir, the source model), since replacing deletes what is there.
  `remedy` ends the message of a target that is no directory or export."""
  out = _resolved(out_dir)
  for path in keep:
    kept = _resolved(path)
    if out == kept or out in kept.parents:
      raise ExportError(f"{out_dir}: exporting there would delete {path}; choose another "
                        "output directory")
  if out.exists() and not out.is_dir():
    raise ExportError(f"{out_dir} is a file, not a directory an export can replace; {remedy}")
  if out.exists() and any(out.iterdir()) and not (out / EXPORT_MARKER).exists():
    raise ExportError(f"{out_dir} is not empty and is not a previous export (it has no "
                      f"{EXPORT_MARKER}); {remedy}")


def _remove_abandoned(out_dir: str) -> None:
  """Removes the directories that exports to `out_dir` left when killed (named
  `<out_dir>.tmp-<pid>-<8 hex>` by `export_dir`, their process no longer running here)."""
  parent, name = os.path.split(out_dir)
  pattern = re.compile(rf"{re.escape(name)}\.tmp-(\d+)-[0-9a-f]{{8}}")
  for entry in os.listdir(parent) if os.path.isdir(parent) else ():
    match = pattern.fullmatch(entry)
    if match and not _running(int(match.group(1))):
      shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _running(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


@contextlib.contextmanager
def export_dir(out_dir: str, *, writer: bool = True,
               of: dict | None = None) -> Iterator[str | None]:
  """A new directory beside local `out_dir` to write an export into (None where `writer` is
  false: processes that only join the gathers). When the block ends, the export is marked as
  ours (the marker records `of`, what the export is of, where given) and swapped in for
  `out_dir` (which `check_export_target` allowed), so an interrupted export never looks
  complete; on an error the new directory is removed and `out_dir` is left as it was. The
  name is new each time: no directory beside `out_dir` is replaced."""
  if not writer:
    yield None
    return
  out_dir = os.path.realpath(out_dir)  # a link's target is what check_export_target allowed
  _remove_abandoned(out_dir)
  tmp = f"{out_dir}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
  os.makedirs(tmp)
  try:
    yield tmp
    with open(os.path.join(tmp, EXPORT_MARKER), "w") as f:
      json.dump({"written_by": "sage_jax", "note": "a later export may replace this directory",
                 **({"of": of} if of is not None else {})}, f, indent=2)
    _with_default_modes(tmp)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  # The previous export is renamed away, not removed, before the new one takes its name: a
  # kill partway through a removal would leave a part of it that later exports refuse.
  old = None
  if os.path.exists(out_dir):
    old = f"{out_dir}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.replace(out_dir, old)
  os.replace(tmp, out_dir)
  if old is not None:
    shutil.rmtree(old)


def _with_default_modes(directory: str) -> None:
  """Gives every file under `directory` the mode a file created by `open` gets (0644 under
  the usual umask): safetensors writes its files 0600, which other users of a shared
  filesystem could not read."""
  umask = os.umask(0)
  os.umask(umask)
  for parent, _, names in os.walk(directory):
    for name in names:
      os.chmod(os.path.join(parent, name), 0o666 & ~umask)


def read_generation_config(directory: str) -> tuple[str | None, dict]:
  """(path, contents) of a checkpoint's generation_config.json; (None, {}) when it has none
  (a .gguf file, a directory without one)."""
  path = os.path.join(directory, "generation_config.json")
  if not os.path.isfile(path):
    return None, {}
  return path, read_checkpoint_json(path)


def write_configs(out_dir: str, cfg: Qwen2Config, *, dtype: str,
                  tokenizer_dir: str | os.PathLike | None = None,
                  source_dir: str | None = None) -> None:
  """Writes config.json and generation_config.json into `out_dir`.

  Special token ids are those of the exported tokenizer (`tokenizer_dir`, else Qwen2.5's):
  `cfg` holds Qwen2.5 ids, which a compact vocabulary renumbers, so each is carried over by its
  token; an id `cfg` lacks (None) stays null, as in the source's config.json.
  generation_config.json keeps the values of `source_dir`'s (transformers' `generate` and vLLM
  sample with them unless told otherwise), its token ids only when the exported
  tokenizer is the source's (ids of another vocabulary would name other tokens), and stops at
  both turn ends the sampler stops on (`<|im_end|>`, `<|endoftext|>`) besides the source's.
  """
  qwen = tokenizer_lib.Tokenizer()
  vocab = tokenizer_lib.Tokenizer(tokenizer_dir) if tokenizer_dir else qwen

  def exported(token_id: int | None) -> int | None:
    if token_id is None:
      return None
    [new_id] = vocab.encode(qwen.id_to_token(token_id))  # An added token's text encodes to it.
    return new_id

  ids = {"bos_token_id": exported(cfg.bos_token_id), "eos_token_id": exported(cfg.eos_token_id)}
  _, source = read_generation_config(source_dir) if source_dir else (None, {})
  if not (tokenizer_dir and source_dir
          and os.path.realpath(tokenizer_dir) == os.path.realpath(source_dir)):
    source = {k: v for k, v in source.items() if not k.endswith("_token_id")}
  stop = source.get("eos_token_id", [])
  stops = (*(stop if isinstance(stop, list) else [stop]), vocab.im_end, vocab.endoftext,
           ids["eos_token_id"])
  # pad only here: in config.json, transformers would freeze that embedding row (padding_idx).
  generation = {**{k: v for k, v in ids.items() if v is not None}, "pad_token_id": vocab.pad_id,
                **source, "eos_token_id": [i for i in dict.fromkeys(stops) if i is not None]}
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump({**cfg.to_hf(torch_dtype=dtype), **ids}, f, indent=2)
  with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
    json.dump(generation, f, indent=2)


def _to_host(x: jax.Array) -> np.ndarray:
  if jax.process_count() > 1 and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def save_hf(model: Qwen2, out_dir: str, *, dtype: str | None = None,
            max_shard_bytes: int = 2 << 30, tokenizer_dir: str | None = None,
            source_dir: str | None = None) -> list[str]:
  """Writes `model` as an HF checkpoint directory (`write_hf`) through `export_dir`, so an
  interrupted export never looks complete; returns the safetensors file names. In a
  multi-host run every process must call this (the gathers are collective); only process 0
  writes."""
  check_export_target(out_dir)
  with export_dir(out_dir, writer=jax.process_index() == 0) as directory:
    return write_hf(model, directory, dtype=dtype, max_shard_bytes=max_shard_bytes,
                    tokenizer_dir=tokenizer_dir, source_dir=source_dir)


def write_hf(model: Qwen2, directory: str | None, *, dtype: str | None = None,
             max_shard_bytes: int = 2 << 30, tokenizer_dir: str | None = None,
             source_dir: str | None = None) -> list[str]:
  """Writes the files of `model`'s HF checkpoint into `directory` (None: gather only, on the
  processes that do not write); returns the safetensors file names.

  `dtype` defaults to the model's param_dtype; `source_dir`, the checkpoint the model was
  loaded from, lends its tokenizer (`export_tokenizer_dir`, in place of `tokenizer_dir`, the
  one the model's ids are of) and its generation_config.json values (`write_configs`).
  Tensors are gathered one at a time. LoRA adapters are merged into their kernels as those are
  written, so the files hold the adapted model's full weights.
  """
  cfg = model.config
  dtype = dtype or cfg.param_dtype
  np_dtype = NP_DTYPES[dtype]
  params = {path: v for path, v in _flat_paths(nnx.state(model, nnx.Param)).items()
            if not isinstance(v, lora.LoraParam)}
  adapters = {".".join(map(str, path)): adapter
              for path, adapter in lora.adapters_by_kernel(model).items()}
  plan = _plan_shards(params, np.dtype(np_dtype).itemsize, max_shard_bytes)
  if directory is not None:
    os.makedirs(directory, exist_ok=True)
  weight_map = {}
  for fname, paths in plan:
    tensors = {}
    for path in paths:
      hf_name, kind = path_to_hf(path)
      value = params[path].get_value()
      if path in adapters:
        adapter = adapters[path]
        value = lora.merge(value, adapter.a[...], adapter.b[...], adapter.scale, np_dtype)
      tensors[hf_name] = to_hf_layout(_to_host(value), kind).astype(np_dtype)
      weight_map[hf_name] = fname
    if directory is not None:
      save_file(tensors, os.path.join(directory, fname), metadata={"format": "pt"})
  if directory is None:
    return [f for f, _ in plan]
  total = sum(math.prod(v.get_value().shape) for v in params.values()) * np.dtype(np_dtype).itemsize
  with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
              f, indent=2)
  tokenizer_dir = tokenizer_dir and export_tokenizer_dir(tokenizer_dir, source_dir)
  write_configs(directory, cfg, dtype=dtype, tokenizer_dir=tokenizer_dir, source_dir=source_dir)
  if tokenizer_dir:
    tokenizer_lib.save_tokenizer(directory, tokenizer_dir)
  return [f for f, _ in plan]


def export_tokenizer_dir(tokenizer_dir: str | os.PathLike,
                         source_dir: str | None = None) -> str | os.PathLike:
  """The tokenizer an export ships for a model trained on `tokenizer_dir`'s ids: the source
  checkpoint's own where `source_dir` holds one that encodes text to those same ids, so the
  export loads like the source (its chat template, special tokens, model_max_length); else
  `tokenizer_dir`, with a warning naming what differs when the source's reads ids otherwise."""
  if not source_dir or not all(os.path.isfile(os.path.join(source_dir, name))
                               for name in tokenizer_lib.REQUIRED_FILES):
    return tokenizer_dir
  differences = tokenizer_lib.encoding_differences(source_dir, tokenizer_dir)
  if not differences:
    return source_dir
  logging.warning("%s: its tokenizer encodes text to other token ids than the one the model "
                  "was trained with, so the export ships that one (%s), with its own chat "
                  "template and special tokens:\n  %s", source_dir, os.fspath(tokenizer_dir),
                  "\n  ".join(differences))
  return tokenizer_dir


def _plan_shards(params: dict[str, nnx.Variable], itemsize: int,
                 max_bytes: int) -> list[tuple[str, list[str]]]:
  """Groups tensors (in HF-name order) into files of at most `max_bytes` each."""
  order = sorted(params, key=lambda p: _natural_key(path_to_hf(p)[0]))
  groups: list[list[str]] = [[]]
  size = 0
  for path in order:
    n = math.prod(params[path].get_value().shape) * itemsize
    if groups[-1] and size + n > max_bytes:
      groups.append([])
      size = 0
    groups[-1].append(path)
    size += n
  k = len(groups)
  return [(f"model-{i + 1:05d}-of-{k:05d}.safetensors", g) for i, g in enumerate(groups)]


def _natural_key(name: str):
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
