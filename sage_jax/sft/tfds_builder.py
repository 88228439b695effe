"""A tensorflow-datasets builder for expert trajectories (array_record; TensorFlow not needed).

The builder reads every `*.jsonl` file (the format of `sage_jax.sft.data`) in its manual
directory, tokenises each trajectory with the Qwen2.5 tokenizer through the same
`Conversation` builder as rollouts, and stores per example:

  id         text
  tokens     int32 [L]
  loss_mask  int8  [L]   1 on assistant tokens
  messages   text        the trajectory's JSON (messages and metadata), for inspection

    builder = ExpertTrajectories(data_dir=DATA_DIR)
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=DIR))
    source = builder.as_data_source()["train"]   # random access, no TensorFlow
    source[0]["tokens"], source[0]["loss_mask"]

`prepare(jsonl_dir, data_dir)` builds it, again when the JSONL files changed (the dataset
records their fingerprint); `load_examples(data_dir)` returns the split as `SFTExample`s for
the SFT loop.
"""

from __future__ import annotations

import glob
import hashlib
import inspect
import json
import logging
import os

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from sage_jax.sft import data as data_lib
from sage_jax.tokenizer import Tokenizer

# The dataset's metadata key of `input_fingerprint` of the files it was built from.
INPUTS_KEY = "inputs"


def jsonl_paths(jsonl_dir: str | os.PathLike) -> list[str]:
  paths = sorted(glob.glob(os.path.join(os.fspath(jsonl_dir), "*.jsonl")))
  if not paths:
    raise FileNotFoundError(f"no *.jsonl in {jsonl_dir}")
  return paths


def input_fingerprint(paths: list[str]) -> str:
  """How many files and bytes, and a digest of each file's name, size and content in order."""
  digest, total = hashlib.sha256(), 0
  for path in paths:
    with open(path, "rb") as f:
      content = hashlib.file_digest(f, "sha256").digest()
      size = f.tell()
    name = os.path.basename(path).encode()
    digest.update(len(name).to_bytes(8, "little") + name + size.to_bytes(8, "little") + content)
    total += size
  return f"{len(paths)} files, {total} bytes, sha256 {digest.hexdigest()[:16]}"


class LocalDatasetInfo(tfds.core.DatasetInfo):
  """The info of a dataset built here, never one of TFDS's catalog. A builder of a directory
  not yet prepared looks for the catalog's pre-computed info in its bucket (gs://tfds-data),
  first making a temporary directory for the files (/tmp/tmp*tfds); with the lookup off
  (TFDS's default) it returns at once and leaves that directory behind, empty."""

  def initialize_from_bucket(self) -> None:
    pass


class ExpertTrajectories(tfds.core.GeneratorBasedBuilder):
  """Expert multi-turn trajectories in the skill-library format, tokenised for SFT."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Tokenised trajectories (ids, assistant loss mask)."}
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
      "Put expert-trajectory JSONL files (*.jsonl, format: sage_jax.sft.data) in manual_dir, "
      "e.g. the output of `python -m sage_jax.sft.expert`.")

  def __init__(self, *args, file_format: str = "array_record", **kwargs):
    super().__init__(*args, file_format=file_format, **kwargs)

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    # The default looks the module up as a package resource, which needs the optional
    # `importlib_resources` package for an editable install; the source file is the answer.
    return epath.Path(inspect.getfile(cls))

  def _info(self) -> tfds.core.DatasetInfo:
    return LocalDatasetInfo(
        builder=self,
        description="Expert trajectories for SAGE's SFT stage, tokenised with Qwen2.5 ChatML.",
        features=tfds.features.FeaturesDict({
            "id": tfds.features.Text(),
            "tokens": tfds.features.Tensor(shape=(None,), dtype=np.int32),
            "loss_mask": tfds.features.Tensor(shape=(None,), dtype=np.int8),
            "messages": tfds.features.Text(),
        }),
        supervised_keys=None,
        metadata=tfds.core.MetadataDict(),
    )

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    paths = jsonl_paths(dl_manager.manual_dir)
    self.info.metadata[INPUTS_KEY] = input_fingerprint(paths)
    return {"train": self._generate_examples(paths)}

  def _generate_examples(self, paths):
    tokenizer = Tokenizer()
    seen = set()
    for path in paths:
      for trajectory in data_lib.iter_jsonl(path):
        if trajectory.id in seen:
          raise data_lib.FormatError(f"{path}: duplicate id {trajectory.id!r}")
        seen.add(trajectory.id)
        example = data_lib.tokenize(trajectory, tokenizer)
        yield trajectory.id, {
            "id": trajectory.id,
            "tokens": example.tokens,
            "loss_mask": example.loss_mask,
            "messages": json.dumps(trajectory.to_json(), ensure_ascii=False),
        }


def prepare(jsonl_dir: str, data_dir: str) -> ExpertTrajectories:
  """Builds the dataset from the JSONL files in `jsonl_dir` under `data_dir`, unless it was
  built from these very files (a reused build of edited files would train on the old data).
  One process prepares; others read once it returned (TFDS writes a build in a temporary
  directory, then replaces the old one)."""
  builder = ExpertTrajectories(data_dir=data_dir)
  inputs = input_fingerprint(jsonl_paths(jsonl_dir))
  if builder.is_prepared():
    built_from = builder.info.metadata.get(INPUTS_KEY)
    if built_from == inputs:
      return builder
    logging.info("Rebuilding %s: built from %s, %s now holds %s", builder.data_dir,
                 built_from, jsonl_dir, inputs)
  builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
      manual_dir=jsonl_dir, download_mode=tfds.download.GenerateMode.REUSE_CACHE_IF_EXISTS))
  return builder


def load_examples(data_dir: str, split: str = "train") -> list[data_lib.SFTExample]:
  """The prepared split as SFTExamples (random-access array_record reads, no TensorFlow)."""
  source = ExpertTrajectories(data_dir=data_dir).as_data_source()[split]
  out = []
  for i in range(len(source)):
    row = source[i]
    name = row["id"]
    out.append(data_lib.SFTExample(name.decode() if isinstance(name, bytes) else str(name),
                                   np.asarray(row["tokens"], np.int32),
                                   np.asarray(row["loss_mask"], np.int8)))
  return out
